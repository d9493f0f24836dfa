"""MembershipNode on the in-memory network under trio's fake clock: small clusters, one behaviour each."""

from __future__ import annotations

import random

import pytest
import trio

from openrld.cluster.membership.codec import encode_messages, encode_push_pull, open_datagram, seal_datagram
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.membership.fake_network import FakeNetwork
from openrld.cluster.membership.messages import Alive, Dead, MemberState, NodePayload, Ping, PushPull, Suspect
from openrld.cluster.membership.simulation import SimulatedCluster
from openrld.cluster.membership.transport import PeerUnreachable
from tests.waits import wait_until

LAN = MembershipConfig.lan()
# Gossip spreads a join in well under a second; a join it misses is repaired by the next
# push-pull, at most push_pull_interval_s later (the protocol's convergence bound for these sizes).
CONVERGED_S = 2.0 + LAN.push_pull_interval_s


async def start_cluster(nursery: trio.Nursery, n: int, *, loss: float = 0.0, seed: int = 0) -> SimulatedCluster:
    rng = random.Random(seed)
    network = FakeNetwork(rng, loss=loss)
    nursery.start_soon(network.run)
    cluster = SimulatedCluster(network, LAN, rng)
    for i in range(n):
        await cluster.add(nursery, f"n{i}", [] if i == 0 else ["n0"])
    return cluster


async def test_nodes_joining_through_one_seed_all_see_each_other_alive(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 5)
        # The seed and the joiner gossip the join at once; 2 s is ten gossip rounds.
        await wait_until(cluster.is_converged, within_s=2.0)
        assert [m.name for m in cluster.nodes["n3"].members()] == ["n3", "n0", "n1", "n2", "n4"]
        assert cluster.nodes["n3"].member("n1").peer_url == "fake://n1"  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


async def test_crashed_node_is_declared_dead_by_all_within_the_bound(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 5)
        await wait_until(cluster.is_converged, within_s=CONVERGED_S)
        cluster.crash("n2")
        bound = detection_bound(LAN, 5)
        await wait_until(lambda: cluster.declared_dead_by_all("n2"), within_s=bound.total_s)
        assert cluster.false_positives() == []
        nursery.cancel_scope.cancel()


async def test_suspect_node_refutes_with_higher_incarnation(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 5)
        await wait_until(cluster.is_converged, within_s=CONVERGED_S)
        # Cut n4 off until someone suspects it, then let it hear of it: it must outbid the suspicion.
        cluster.network.partition([["n4"], ["n0", "n1", "n2", "n3"]])
        await wait_until(lambda: any(n.member("n4").state is MemberState.SUSPECT for n in cluster.running()), within_s=10.0)  # type: ignore[union-attr]
        cluster.network.heal()
        n4 = cluster.nodes["n4"]

        def everyone_has_n4_alive_at_its_incarnation() -> bool:
            current = n4.statistics().incarnation
            return all(
                (m.state, m.incarnation) == (MemberState.ALIVE, current)
                for m in (n.member("n4") for n in cluster.running())
                if m is not None
            )

        await wait_until(everyone_has_n4_alive_at_its_incarnation, within_s=5.0)
        assert n4.statistics().refutations >= 1 and n4.statistics().incarnation >= 1
        assert cluster.false_positives() == []
        nursery.cancel_scope.cancel()


async def test_node_that_leaves_is_left_not_dead_to_the_others(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 4)
        await wait_until(cluster.is_converged, within_s=CONVERGED_S)
        await cluster.nodes["n1"].leave()
        cluster.crash("n1")  # after leaving, it stops
        await wait_until(
            lambda: all(n.member("n1").state is MemberState.LEFT for n in cluster.running()), within_s=1.0  # type: ignore[union-attr]
        )
        nursery.cancel_scope.cancel()


async def test_new_payload_reaches_every_member(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 4)
        await wait_until(cluster.is_converged, within_s=CONVERGED_S)
        cluster.nodes["n2"].set_payload(NodePayload(peer_url="fake://n2", jobs=("model-1",)))
        await wait_until(
            lambda: all(n.member("n2").payload.jobs == ("model-1",) for n in cluster.running()), within_s=1.0  # type: ignore[union-attr]
        )
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("accused", "observer"), [("n1", "n0"), ("n1", "n1")], ids=["of-another", "of-itself"])
@pytest.mark.parametrize("accusation", [Suspect, Dead])
async def test_a_stale_accusation_is_answered_with_the_newer_alive_straight_to_its_sender(
    autojump_clock, accusation, accused: str, observer: str
) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 2)
        await wait_until(cluster.is_converged, within_s=2.0)
        old = cluster.nodes[accused].member(accused).incarnation  # type: ignore[union-attr]
        payload = NodePayload(peer_url=f"fake://{accused}", jobs=("model-1",))
        cluster.nodes[accused].set_payload(payload)
        await wait_until(lambda: cluster.nodes[observer].member(accused).incarnation == old + 1, within_s=2.0)  # type: ignore[union-attr]
        behind = cluster.network.new_transport("behind")  # a member that missed the refutation
        cluster.network.send("behind", observer, seal_datagram(cluster.key, encode_messages([accusation(accused, old, "behind")])))
        with trio.fail_after(1.0):
            answer = await behind.receive()
        # A node's address on the fake network is its name.
        assert open_datagram(cluster.key, answer.frame) == [Alive(accused, old + 1, accused, payload)]
        assert cluster.nodes[observer].statistics().stale_accusations_answered == 1
        assert cluster.nodes[observer].member(accused).state is MemberState.ALIVE  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


async def test_datagram_without_the_cluster_secret_is_dropped_and_counted(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 2)
        forged = seal_datagram(b"not-the-secret", encode_messages([Ping(1, "n0", "mallory")]))
        cluster.network.send("mallory", "n0", forged)
        await wait_until(lambda: cluster.nodes["n0"].statistics().packets_received >= 1, within_s=0.1, poll_s=0.001)
        assert cluster.nodes["n0"].statistics().dropped == {"bad_tag": 1}
        nursery.cancel_scope.cancel()


async def test_push_pull_without_the_cluster_secret_is_refused(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 1)
        body, tag = encode_push_pull(b"not-the-secret", PushPull("mallory", True, ()))
        with pytest.raises(PeerUnreachable, match="refused"):
            await cluster.network.exchange("mallory", "fake://n0", body, tag)
        assert [m.name for m in cluster.nodes["n0"].members()] == ["n0"]
        assert cluster.nodes["n0"].statistics().dropped == {"bad_tag": 1}
        nursery.cancel_scope.cancel()


async def test_node_joining_before_its_seed_starts_joins_once_the_seed_is_up(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        rng = random.Random(0)
        network = FakeNetwork(rng)
        nursery.start_soon(network.run)
        cluster = SimulatedCluster(network, LAN, rng)
        early = await cluster.add(nursery, "early", ["late"])  # nobody answers yet
        assert early.statistics().push_pulls_failed == 1
        await cluster.add(nursery, "late")
        # The early node retries its seeds every push-pull round while it is alone.
        await wait_until(cluster.is_converged, within_s=LAN.push_pull_interval_s)
        nursery.cancel_scope.cancel()


async def test_restarted_node_outbids_its_own_death(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        cluster = await start_cluster(nursery, 4)
        await wait_until(cluster.is_converged, within_s=CONVERGED_S)
        cluster.crash("n3")
        await wait_until(lambda: cluster.declared_dead_by_all("n3"), within_s=detection_bound(LAN, 4).total_s)
        reborn = await cluster.add(nursery, "n3", ["n0"])  # same name, incarnation 0 again
        await wait_until(cluster.is_converged, within_s=2.0)
        assert reborn.statistics().incarnation >= 1
        nursery.cancel_scope.cancel()


async def test_a_seed_name_that_resolves_late_is_resolved_again_until_the_node_joins(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        rng = random.Random(0)
        network = FakeNetwork(rng)
        nursery.start_soon(network.run)
        cluster = SimulatedCluster(network, LAN, rng)
        await cluster.add(nursery, "first")
        lookups: list[float] = []

        async def late_dns() -> list[str]:
            # A headless Service publishes a pod's record only once the pod is ready.
            lookups.append(trio.current_time())
            return [FakeNetwork.url("first")] if len(lookups) > 3 else []

        joiner = await cluster.add(nursery, "joiner")
        assert await joiner.join(late_dns) == (0, 0)
        await wait_until(cluster.is_converged, within_s=5 * LAN.push_pull_interval_s)
        assert len(lookups) == 4  # resolved at every attempt while alone, and not once after
        nursery.cancel_scope.cancel()
