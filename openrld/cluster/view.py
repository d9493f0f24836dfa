"""The cluster as `GET /openrl/v1/cluster` shows it: the members this node knows, with their state and resources.

Pure: built from the membership node's table at one instant, no I/O. On a node
outside any cluster the view lists the node alone (`is_clustered=False`).
"""

from __future__ import annotations

import msgspec
import trio

from openrld.cluster.membership.node import MembershipNode, MembershipStatistics


class DeviceView(msgspec.Struct, frozen=True):
    name: str
    kind: str
    memory_bytes: int
    free_bytes: int
    groups: int  # worker groups placed on it
    is_exclusive: bool  # held by an exclusive job


class GroupView(msgspec.Struct, frozen=True):
    base_model: str
    adapters: int
    queue_depth: int


class ClusterMember(msgspec.Struct, frozen=True):
    """One member as GET /openrl/v1/cluster shows it (the gossip payload, with field names)."""

    name: str
    state: str  # "alive", "suspect", "dead", "left"
    incarnation: int
    gossip_addr: str
    peer_url: str
    devices: tuple[DeviceView, ...]
    groups: tuple[GroupView, ...]
    jobs: tuple[str, ...]
    state_age_s: float  # how long ago this node saw the state begin


class ClusterView(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/cluster."""

    node: str  # the node that answered
    is_clustered: bool
    members: tuple[ClusterMember, ...]
    statistics: MembershipStatistics | None


def cluster_view(node: MembershipNode | None, node_name: str) -> ClusterView:
    """What this node knows of the cluster now; `node_name` names it when it is in none (`node` is None)."""
    if node is None:
        return ClusterView(node=node_name, is_clustered=False, members=(), statistics=None)
    now = trio.current_time()
    members = tuple(
        ClusterMember(
            name=m.name, state=m.state.name.lower(), incarnation=m.incarnation, gossip_addr=m.addr,
            peer_url=m.peer_url,
            devices=tuple(
                DeviceView(d.name, d.kind, d.memory_bytes, d.free_bytes, d.groups, d.is_exclusive)
                for d in m.payload.devices
            ),
            groups=tuple(GroupView(g.base_model, g.adapters, g.queue_depth) for g in m.payload.groups),
            jobs=m.payload.jobs,
            state_age_s=round(now - m.state_since_s, 3),
        )
        for m in node.members()
    )
    return ClusterView(node=node.name, is_clustered=True, members=members, statistics=node.statistics())
