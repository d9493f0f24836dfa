"""Which node a new job goes to: candidates from the cluster view, ranked by fit.

This module owns the ranking and the placer's memory of its own recent
placements; it never books anything. The chosen node's device pool
(`actors/device_pool.py`) is the authority: the node that got the request
offers the job to the ranked nodes in order, each confirms against its own
state or refuses, and the next is tried. Two placers can therefore never
double-book a device, however stale their views.

The rules, in order:
1. a LoRA job joins a resident LoRA group for the same base model that has room;
2. else a new group starts on a node with a free device (the most free first);
3. else a device is time-sliced (the least crowded first);
4. an exclusive job takes free devices only; a trainer on several devices (`trainer_gpus`)
   needs that many free ones, or, when it may share, that many no exclusive job holds;
5. a trainer wider than the largest node spans several (`spanning.py`): it is offered to
   the home its plan names first, then to the plan's other nodes.

A member's payload lags its state by a refresh and a gossip round, so the
placer also counts the placements it made since it last heard from a node:
a burst of creations spreads out instead of all going to the same node and
being refused there. It is pure: no trio, no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from openrld.cluster.membership.messages import GroupLoad
from openrld.cluster.membership.table import Member
from openrld.cluster.placement.spanning import largest_node, plan_span, span_nodes, span_refusal

GROUP_ROOM = 32  # LoRA adapters a resident group takes before a new job is sent elsewhere


class JobNeeds(msgspec.Struct, frozen=True):
    """What a new job asks of a node."""

    base_model: str
    own_group: bool  # full fine-tuning or exclusive: a group of its own, not the base model's LoRA group
    is_exclusive: bool  # openrl.exclusive: free devices only, never time-sliced
    devices: int = 1  # devices its trainer needs


class Candidate(msgspec.Struct, frozen=True):
    """A node as placement sees it."""

    name: str
    free_devices: int  # devices with no group on them
    shared_devices: int  # devices no exclusive job holds (time-sliceable)
    groups_on_shared: int  # groups placed on those devices
    groups: tuple[GroupLoad, ...]


def candidate(member: Member) -> Candidate:
    devices = member.payload.devices
    shared = [d for d in devices if not d.is_exclusive]
    return Candidate(
        name=member.name,
        free_devices=sum(1 for d in devices if d.groups == 0),
        shared_devices=len(shared),
        groups_on_shared=sum(d.groups for d in shared),
        groups=member.payload.groups,
    )


def rank(candidates: Iterable[Candidate], needs: JobNeeds) -> list[str]:
    """Node names in the order the job should be offered to them; nodes it cannot go to are left out."""
    joins, fresh, sliced = [], [], []
    for c in candidates:
        resident = [g for g in c.groups if g.base_model == needs.base_model and g.adapters < GROUP_ROOM]
        # A node whose every device an exclusive job holds runs only own groups: none a LoRA job can join.
        if resident and not needs.own_group and c.shared_devices > 0:
            load = min(g.adapters + g.queue_depth for g in resident)
            joins.append(((load, c.name), c.name))
        elif c.free_devices >= needs.devices:
            fresh.append(((-c.free_devices, c.name), c.name))
        elif not needs.is_exclusive and c.shared_devices >= needs.devices:
            sliced.append(((c.groups_on_shared / c.shared_devices, c.name), c.name))
    return [name for tier in (joins, fresh, sliced) for _, name in sorted(tier)]


def too_large(members: Iterable[Member], needs: JobNeeds) -> str | None:
    """Why the cluster cannot take the job now, or None: its trainer is wider than the largest live
    node (so it spans nodes, `spanning.py`) and the cluster's free devices are too few for it."""
    alive = [m for m in members if m.is_alive and m.payload.devices]
    if needs.devices <= 1 or not alive or needs.devices <= largest_node(alive):
        return None
    nodes = span_nodes(alive)
    return span_refusal(nodes, needs.devices) if plan_span(nodes, needs.devices) is None else None


class Booking(msgspec.Struct, frozen=True):
    """One placement the placer counts until the node's payload shows it."""

    node: str
    incarnation: int  # the node's incarnation when it was placed there; a newer payload includes it
    needs: JobNeeds


class Placer:
    """Ranks members for a job, counting the placements this node made that their payloads do not show yet."""

    def __init__(self) -> None:
        self._recent: dict[str, list[Booking]] = {}

    def rank(self, members: Iterable[Member], needs: JobNeeds) -> list[str]:
        alive = [m for m in members if m.is_alive and m.payload.devices]
        if needs.devices > 1 and needs.devices > largest_node(alive):
            # A trainer that spans nodes: its plan's home first; the home books the members itself.
            plan = plan_span(span_nodes(alive), needs.devices)
            return [p.node for p in plan.parts] if plan is not None else []
        return rank((self._with_recent(m) for m in alive), needs)

    def placed(self, member: Member, needs: JobNeeds) -> Booking:
        """A job is being offered to `member`: count it until the member publishes a newer payload."""
        booking = Booking(member.name, member.incarnation, needs)
        self._recent.setdefault(member.name, []).append(booking)
        return booking

    def forget(self, booking: Booking) -> None:
        """The node refused the job, or failed: it is not there."""
        bookings = self._recent.get(booking.node, [])
        if booking in bookings:
            bookings.remove(booking)

    def _with_recent(self, member: Member) -> Candidate:
        seen = [b for b in self._recent.get(member.name, []) if b.incarnation >= member.incarnation]
        self._recent[member.name] = seen
        c = candidate(member)
        groups = list(c.groups)
        for needs in (b.needs for b in seen):
            resident = next((i for i, g in enumerate(groups) if g.base_model == needs.base_model), None)
            if resident is not None and not needs.own_group:
                g = groups[resident]
                groups[resident] = GroupLoad(g.base_model, g.adapters + 1, g.queue_depth)
                continue
            if not needs.own_group:
                groups.append(GroupLoad(needs.base_model, 1, 0))
            if c.free_devices >= needs.devices:
                c = msgspec.structs.replace(c, free_devices=c.free_devices - needs.devices)
            else:
                c = msgspec.structs.replace(c, groups_on_shared=c.groups_on_shared + 1)
            if needs.is_exclusive:
                c = msgspec.structs.replace(c, shared_devices=max(0, c.shared_devices - needs.devices))
        return msgspec.structs.replace(c, groups=tuple(groups))
