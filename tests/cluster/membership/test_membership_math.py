"""Membership timer math (config.py), suspicion decay, awareness and the broadcast queue: pure functions."""

from __future__ import annotations

import math

import pytest

from openrld.cluster.membership.awareness import Awareness
from openrld.cluster.membership.broadcasts import BroadcastQueue
from openrld.cluster.membership.config import (
    MembershipConfig,
    detection_bound,
    expected_confirmations,
    push_pull_interval_s,
    retransmit_limit,
    suspicion_max_s,
    suspicion_min_s,
    suspicion_timeout_s,
)
from openrld.cluster.membership.messages import Alive, Dead, NodePayload, Suspect
from openrld.cluster.membership.suspicion import Suspicion

LAN = MembershipConfig.lan()


@pytest.mark.parametrize(
    ("n", "limit"), [(1, 4), (9, 4), (10, 8), (99, 8), (100, 12), (200, 12), (1000, 16)],
    ids=["1", "9", "10", "99", "100", "200", "1000"],
)
def test_retransmit_limit_is_mult_times_ceil_log10_of_n_plus_one(n: int, limit: int) -> None:
    assert retransmit_limit(4, n) == limit


def test_suspicion_minimum_is_mult_log10_n_probe_intervals_and_never_under_one_log() -> None:
    assert suspicion_min_s(LAN, 3) == 4.0  # log10(3) < 1, so the floor of 1 applies
    assert suspicion_min_s(LAN, 1000) == pytest.approx(12.0, abs=1e-12)  # 4 * 3 * 1 s
    assert suspicion_max_s(LAN, 1000) == pytest.approx(72.0, abs=1e-12)


def test_expected_confirmations_drop_to_zero_when_too_few_members_exist() -> None:
    assert expected_confirmations(LAN, 4) == 2  # suspicion_mult 4 - 2
    assert expected_confirmations(LAN, 3) == 0  # only one other member could confirm


@pytest.mark.parametrize(
    ("confirmations", "timeout"), [(0, 60.0), (1, 60.0 - 50.0 * math.log(2) / math.log(3)), (2, 10.0), (5, 10.0)],
    ids=["none", "one", "all-expected", "more-than-expected"],
)
def test_suspicion_timeout_decays_with_log_of_confirmations(confirmations: int, timeout: float) -> None:
    assert suspicion_timeout_s(10.0, 60.0, confirmations, 2) == pytest.approx(timeout, abs=1e-9)


def test_suspicion_counts_each_accuser_once_and_not_the_first() -> None:
    suspicion = Suspicion(accuser="a", started_s=100.0, minimum_s=10.0, maximum_s=60.0, expected=2)
    assert suspicion.deadline_s == 160.0
    assert suspicion.confirm("a") is False
    assert suspicion.confirm("b") is True
    assert suspicion.confirm("b") is False
    assert suspicion.confirm("c") is True
    assert suspicion.confirm("d") is False  # already at the minimum: more news changes nothing
    assert (suspicion.confirmations, suspicion.deadline_s) == (2, 110.0)


def test_awareness_multiplier_stays_between_one_and_the_maximum() -> None:
    awareness = Awareness(max_multiplier=8)
    awareness.apply(-3)
    assert awareness.multiplier == 1
    awareness.apply(3)
    assert awareness.scale(0.5) == 2.0
    awareness.apply(100)
    assert awareness.multiplier == 8


def test_push_pull_interval_stretches_beyond_32_members() -> None:
    assert [push_pull_interval_s(LAN, n) for n in (32, 33, 64, 65, 1000)] == [30.0, 60.0, 60.0, 90.0, 180.0]


def test_detection_bound_sums_its_terms() -> None:
    # n=200: first probe min(2*199-1, ceil(ln 1e6)=14) = 14 rounds; suspicion max 6 * 4 * log10(200);
    # dissemination 12 retransmits * 0.2 s.
    bound = detection_bound(LAN, 200)
    assert (bound.first_probe_s, bound.probe_s, bound.dissemination_s) == (14.0, 1.0, pytest.approx(2.4, abs=1e-12))
    assert bound.suspicion_s == pytest.approx(24.0 * math.log10(200), abs=1e-9)
    assert bound.total_s == pytest.approx(17.4 + 24.0 * math.log10(200), abs=1e-9)


def test_detection_bound_of_three_members_uses_round_robin_and_the_shortest_suspicion() -> None:
    bound = detection_bound(MembershipConfig.local(), 3)
    # 2*(3-1)-1 = 3 rounds of 0.2 s; 4 * 1 * 0.2 s suspicion (nobody can confirm); 4 * 1 * 0.05 s.
    assert (bound.first_probe_s, bound.suspicion_s) == (pytest.approx(0.6), pytest.approx(0.8))
    assert bound.total_s == pytest.approx(0.6 + 0.2 + 0.8 + 0.2, abs=1e-12)


def alive(name: str, incarnation: int = 1) -> Alive:
    return Alive(name, incarnation, f"{name}:1", NodePayload())


def test_newer_update_about_a_member_replaces_the_queued_one() -> None:
    queue = BroadcastQueue()
    queue.queue(alive("a"))
    queue.queue(Suspect("a", 1, "b"))
    queue.queue(Dead("a", 1, "b"))
    assert queue.take(1400, limit=3) == [Dead("a", 1, "b")]


def test_update_leaves_the_queue_after_the_retransmit_limit() -> None:
    queue = BroadcastQueue()
    queue.queue(alive("a"))
    assert [len(queue.take(1400, limit=2)) for _ in range(3)] == [1, 1, 0]


def test_least_sent_update_goes_first_and_the_budget_is_kept() -> None:
    queue = BroadcastQueue()
    queue.queue(alive("old"))
    queue.take(1400, limit=10)  # "old" has been sent once
    queue.queue(alive("new"))
    taken = queue.take(30, limit=10)  # room for one 18-byte Alive after the 3-byte array header
    assert [m.name for m in taken] == ["new"]


def test_oversized_update_goes_alone_only_when_asked() -> None:
    queue = BroadcastQueue()
    queue.queue(Alive("big", 1, "big:1", NodePayload(jobs=tuple(f"job-{i}" for i in range(200)))))
    assert queue.take(1400, limit=3) == []
    assert [m.name for m in queue.take(1400, limit=3, at_least_one=True)] == ["big"]
