"""Whole clusters on the in-memory network under the fake clock: convergence, false positives, detection, partitions.

Wall time is the cost here (every datagram is real work; only waiting is free),
so sizes are chosen to keep each test within about 20 s on a loaded 2-core machine.
"""

from __future__ import annotations

import random

import trio

from openrld.cluster.membership.config import MembershipConfig, detection_bound, push_pull_interval_s, retransmit_limit
from openrld.cluster.membership.fake_network import FakeNetwork
from openrld.cluster.membership.simulation import SimulatedCluster
from tests.waits import wait_until

LAN = MembershipConfig.lan()
POLL_S = 1.0  # sim seconds between checks of a 200-node predicate: convergence takes tens of them


def convergence_bound_s(config: MembershipConfig, n: int) -> float:
    """Gossip carries a join to nearly everyone within its retransmit limit in gossip rounds;
    a pair it misses is repaired by push-pull, each member exchanging once per (scaled) interval."""
    return retransmit_limit(config.retransmit_mult, n) * config.gossip_interval_s + push_pull_interval_s(config, n)


async def grow(nursery: trio.Nursery, n: int, loss: float, seed: int, *, joins_per_s: float = 40.0) -> SimulatedCluster:
    """n nodes, each joining through a random earlier one, `joins_per_s` a (fake) second."""
    rng = random.Random(seed)
    network = FakeNetwork(rng, loss=loss, min_delay_s=0.0, max_delay_s=0.0)
    cluster = SimulatedCluster(network, LAN, rng)
    for i in range(n):
        await cluster.add(nursery, f"n{i}", [] if i == 0 else [f"n{rng.randrange(i)}"])
        await trio.sleep(1.0 / joins_per_s)
    return cluster


async def test_200_nodes_with_10_percent_loss_converge_within_the_bound(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await grow(nursery, 200, loss=0.10, seed=1)
        await wait_until(cluster.is_converged, within_s=convergence_bound_s(LAN, 200), poll_s=POLL_S)
        assert cluster.false_positives() == []
        nursery.cancel_scope.cancel()


async def test_no_false_positives_over_a_long_lossy_run(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await grow(nursery, 40, loss=0.10, seed=2)
        await wait_until(cluster.is_converged, within_s=convergence_bound_s(LAN, 40), poll_s=POLL_S)
        periods = 150
        for _ in range(periods):
            await trio.sleep(LAN.probe_interval_s)
            assert cluster.false_positives() == []
        # The loss did make members suspect each other; every suspicion was refuted in time.
        assert sum(node.statistics().refutations for node in cluster.running()) > 0
        assert cluster.is_converged()
        nursery.cancel_scope.cancel()


async def test_crashed_node_is_declared_dead_by_all_within_the_bound_under_loss(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await grow(nursery, 50, loss=0.10, seed=3)
        await wait_until(cluster.is_converged, within_s=convergence_bound_s(LAN, 50), poll_s=POLL_S)
        cluster.crash("n17")
        bound = detection_bound(LAN, 50)
        took_s = await wait_until(lambda: cluster.declared_dead_by_all("n17"), within_s=bound.total_s, poll_s=0.1)
        assert took_s <= bound.total_s and cluster.false_positives() == []
        nursery.cancel_scope.cancel()


async def test_partition_heals_into_one_cluster(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await grow(nursery, 20, loss=0.0, seed=4)
        await wait_until(cluster.is_converged, within_s=convergence_bound_s(LAN, 20), poll_s=POLL_S)
        left = [f"n{i}" for i in range(10)]
        right = [f"n{i}" for i in range(10, 20)]
        cluster.network.partition([left, right])
        bound = detection_bound(LAN, 20)
        await wait_until(
            lambda: all(cluster.nodes["n0"].member(name).state.name == "DEAD" for name in right)  # type: ignore[union-attr]
            and all(cluster.nodes["n19"].member(name).state.name == "DEAD" for name in left),  # type: ignore[union-attr]
            within_s=bound.total_s, poll_s=POLL_S,
        )
        cluster.network.heal()
        # Each member push-pulls with one member it holds dead every push-pull round; the first such
        # exchange across the cut makes both sides refute, and gossip carries the refutations.
        await wait_until(cluster.is_converged, within_s=2 * push_pull_interval_s(LAN, 20) + bound.total_s, poll_s=POLL_S)
        assert cluster.false_positives() == []
        nursery.cancel_scope.cancel()
