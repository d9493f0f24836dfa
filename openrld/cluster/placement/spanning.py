"""Which nodes a trainer larger than any one node spans: the plan of a multi-node torchrun group.

A job whose `openrl.trainer_gpus` is more than the devices of the largest
node runs as one torch.distributed group over several nodes. This module
decides, from the cluster view, which nodes and how many free devices of
each; it books nothing. The home node (rank 0, the rendezvous, the job's
owner) books its own devices in its pool and asks each member node to hold
its part (`actors/span_members.py`); every node's pool is the authority, so
a stale view costs a refusal, never a double booking.

The rules, in order:
1. free devices only: a job that spans nodes is exclusive on its devices (its
   ranks talk over the network at every step; a turn-taking neighbour would stall
   every node's ranks at once);
2. whole nodes first: the fewest nodes, each taken whole where it can be (8 + 8
   rather than 5 + 5 + 6); the last part goes to the smallest node it fills;
3. one network segment where known (`segment`, a label from the node's config:
   zone, rack, GKE node pool): a plan inside one segment beats one across them;
4. the home is the plan's first node (its largest part); a given home takes
   all of its free devices it needs first.

Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from openrld.cluster.membership.table import Member

SETTING = "openrl.trainer_gpus"


class SpanNode(msgspec.Struct, frozen=True):
    """A node as the span planner sees it."""

    name: str
    free_devices: int  # devices with no group on them
    segment: str = ""  # its network segment label; "": unknown


class SpanPart(msgspec.Struct, frozen=True):
    node: str
    devices: int  # the node's ranks in the group (one per device)


class SpanPlan(msgspec.Struct, frozen=True):
    parts: tuple[SpanPart, ...]  # the home's first: it holds global rank 0

    @property
    def home(self) -> str:
        return self.parts[0].node

    @property
    def devices(self) -> int:
        return sum(p.devices for p in self.parts)


def span_nodes(members: Iterable[Member]) -> list[SpanNode]:
    """The live members with a free device, as the planner sees them."""
    nodes = []
    for m in members:
        free = sum(1 for d in m.payload.devices if d.groups == 0)
        if m.is_alive and free:
            nodes.append(SpanNode(m.name, free, m.payload.segment))
    return nodes


def largest_node(members: Iterable[Member]) -> int:
    """The devices of the largest live node (free or not): a trainer up to that size runs on one node."""
    return max((len(m.payload.devices) for m in members if m.is_alive), default=0)


def plan_span(nodes: Sequence[SpanNode], devices: int, *, home: str | None = None) -> SpanPlan | None:
    """The nodes a trainer of `devices` ranks spans, the home first; None when their free devices are too few.

    With `home`, that node is in the plan and holds rank 0 (it must have a free device).
    """
    if home is not None and not any(n.name == home for n in nodes):
        return None
    segments = sorted({n.segment for n in nodes if n.segment})
    if home is not None:
        home_segment = next(n.segment for n in nodes if n.name == home)
        segments = [home_segment] if home_segment else []
    plans = [
        plan for segment in segments
        if (plan := _fit([n for n in nodes if n.segment == segment], devices, home)) is not None
    ]
    if plans:
        return min(plans, key=_cost)
    return _fit(list(nodes), devices, home)


def _cost(plan: SpanPlan) -> tuple[int, tuple[str, ...]]:
    return len(plan.parts), tuple(p.node for p in plan.parts)


def _fit(nodes: list[SpanNode], devices: int, home: str | None) -> SpanPlan | None:
    """Whole nodes, the largest first, until the rest fits on one; that one is the smallest it fits."""
    if sum(n.free_devices for n in nodes) < devices:
        return None
    pool = sorted(nodes, key=lambda n: (-n.free_devices, n.name))
    parts: list[SpanPart] = []
    remaining = devices
    if home is not None:
        first = next(n for n in pool if n.name == home)
        pool.remove(first)
        parts.append(SpanPart(first.name, min(first.free_devices, remaining)))
        remaining -= parts[0].devices
    while remaining > 0:
        fits = [n for n in pool if n.free_devices >= remaining]
        if fits:
            last = min(fits, key=lambda n: (n.free_devices, n.name))
            parts.append(SpanPart(last.name, remaining))
            break
        whole = pool.pop(0)
        parts.append(SpanPart(whole.name, whole.free_devices))
        remaining -= whole.free_devices
    if home is None:
        parts.sort(key=lambda p: -p.devices)  # stable: the home is the largest part, first taken on a tie
    return SpanPlan(tuple(parts))


def span_refusal(nodes: Sequence[SpanNode], devices: int) -> str:
    """The 400's detail when no plan fits: the setting, and the cluster's free devices node by node."""
    free = sum(n.free_devices for n in nodes)
    each = ", ".join(f"{n.name}: {n.free_devices}" for n in sorted(nodes, key=lambda n: n.name)) or "none"
    return (
        f"{SETTING}={devices}: no node has {devices} devices, and a trainer that spans nodes takes free ones only; "
        f"the cluster has {free} free ({each}); lower {SETTING}, or wait for jobs to end"
    )
