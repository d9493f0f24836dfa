"""A cluster of membership nodes on the in-memory network, for tests and `bench/gossip.py`.

`SimulatedCluster` starts nodes in a nursery it is given, each under its own
cancel scope so that one can be crashed (its tasks stop and the network
stops delivering to it) while the others run on. It answers questions about
the whole cluster's views (`is_converged`, `declared_dead_by_all`,
`false_positives`). It never sleeps to wait for a state; callers poll it
under trio's fake clock, where a poll interval costs no wall time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import trio

from openrld.cluster.membership.config import MembershipConfig
from openrld.cluster.membership.fake_network import FakeNetwork
from openrld.cluster.membership.messages import MemberState, NodePayload
from openrld.cluster.membership.node import MembershipNode

SIMULATION_KEY = b"simulated-cluster-secret"


class SimulatedCluster:
    def __init__(self, network: FakeNetwork, config: MembershipConfig, rng: random.Random, key: bytes = SIMULATION_KEY) -> None:
        self.network = network
        self.config = config
        self.key = key
        self._rng = rng
        self.nodes: dict[str, MembershipNode] = {}
        self._scopes: dict[str, trio.CancelScope] = {}

    async def add(self, nursery: trio.Nursery, name: str, seeds: Iterable[str] = (), *, key: bytes | None = None) -> MembershipNode:
        """Start a node called `name` and join it through the seeds' names."""
        node = MembershipNode(
            name=name,
            config=self.config,
            key=key or self.key,
            transport=self.network.new_transport(name),
            push_pull=self.network.push_pull_client(name),
            payload=NodePayload(peer_url=FakeNetwork.url(name)),
            rng=random.Random(self._rng.getrandbits(64)),
        )
        self.network.serve_push_pull(name, node.handle_push_pull)
        scope = trio.CancelScope()

        async def run_node(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await node.run(task_status=task_status)

        await nursery.start(run_node)
        self.nodes[name] = node
        self._scopes[name] = scope
        seed_urls = [FakeNetwork.url(seed) for seed in seeds]
        if seed_urls:
            await node.join(lambda: _now(seed_urls))
        return node

    def crash(self, name: str) -> None:
        self.network.crash(name)
        self._scopes[name].cancel()

    def running(self) -> list[MembershipNode]:
        return [node for name, node in self.nodes.items() if not self._scopes[name].cancel_called]

    def is_converged(self) -> bool:
        """Every running node holds exactly the running nodes as members (alive or suspect).

        A suspect is still a member: under packet loss some probe somewhere always
        fails, so some node always suspects someone for a moment, until the suspect
        refutes. Convergence is about membership; false declarations of death are
        `false_positives`.
        """
        names = {node.name for node in self.running()}
        return all({m.name for m in node.members() if m.is_alive} == names for node in self.running())

    def declared_dead_by_all(self, name: str) -> bool:
        """Every running node holds `name` as DEAD."""
        for node in self.running():
            member = node.member(name)
            if member is None or member.state is not MemberState.DEAD:
                return False
        return True

    def false_positives(self) -> list[tuple[str, str]]:
        """(observer, member) pairs where a running node holds a running one dead."""
        running = {node.name for node in self.running()}
        return [
            (node.name, m.name)
            for node in self.running()
            for m in node.members()
            if m.name in running and m.state in (MemberState.DEAD, MemberState.LEFT)
        ]


async def _now(urls: list[str]) -> list[str]:
    """Seeds that need no resolving: the fake network's names."""
    return urls
