"""MemberTable: the incarnation rules, pure."""

from __future__ import annotations

import random

from openrld.cluster.membership.messages import Alive, Dead, MemberState, NodePayload, Suspect
from openrld.cluster.membership.table import MemberTable, Outcome

P = NodePayload(peer_url="http://a")


def table_with_b(incarnation: int = 3) -> MemberTable:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    assert table.apply_alive(Alive("b", incarnation, "b:1", NodePayload()), 1.0) is Outcome.APPLIED
    return table


def test_alive_with_a_newer_incarnation_replaces_and_an_older_one_is_ignored() -> None:
    table = table_with_b(3)
    assert table.apply_alive(Alive("b", 3, "b:1", NodePayload(jobs=("m",))), 2.0) is Outcome.IGNORED
    assert table.apply_alive(Alive("b", 4, "b:2", NodePayload(jobs=("m",))), 2.0) is Outcome.APPLIED
    b = table.get("b")
    assert b is not None and (b.incarnation, b.addr, b.payload.jobs) == (4, "b:2", ("m",))


def test_suspect_at_the_current_incarnation_starts_a_suspicion_then_confirms_it() -> None:
    table = table_with_b(3)
    assert table.apply_suspect(Suspect("b", 2, "c"), 2.0) is Outcome.IGNORED
    assert table.apply_suspect(Suspect("b", 3, "c"), 2.0) is Outcome.NEW_SUSPICION
    assert table.apply_suspect(Suspect("b", 3, "d"), 3.0) is Outcome.CONFIRMATION
    b = table.get("b")
    assert b is not None and (b.state, b.state_since_s) == (MemberState.SUSPECT, 2.0)


def test_alive_with_a_higher_incarnation_clears_a_suspicion() -> None:
    table = table_with_b(3)
    table.apply_suspect(Suspect("b", 3, "c"), 2.0)
    assert table.apply_alive(Alive("b", 3, "b:1", NodePayload()), 3.0) is Outcome.IGNORED
    assert table.apply_alive(Alive("b", 4, "b:1", NodePayload()), 3.0) is Outcome.APPLIED
    assert table.get("b").state is MemberState.ALIVE  # type: ignore[union-attr]


def test_dead_stays_dead_until_a_higher_incarnation() -> None:
    table = table_with_b(3)
    assert table.apply_dead(Dead("b", 3, "c"), 2.0) is Outcome.APPLIED
    assert table.apply_suspect(Suspect("b", 3, "d"), 3.0) is Outcome.IGNORED
    assert table.apply_alive(Alive("b", 3, "b:1", NodePayload()), 3.0) is Outcome.IGNORED
    assert table.live_count() == 1
    assert table.apply_alive(Alive("b", 4, "b:1", NodePayload()), 4.0) is Outcome.APPLIED
    assert table.live_count() == 2


def test_dead_from_the_member_itself_means_it_left() -> None:
    table = table_with_b(3)
    table.apply_dead(Dead("b", 3, "b"), 2.0)
    assert table.get("b").state is MemberState.LEFT  # type: ignore[union-attr]


def test_suspect_node_refutes_with_higher_incarnation() -> None:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    assert table.apply_suspect(Suspect("a", 0, "b"), 1.0) is Outcome.REFUTE
    alive = table.refute(0, 1.0)
    assert (alive.name, alive.incarnation) == ("a", 1)
    assert table.apply_suspect(Suspect("a", 0, "b"), 1.0) is Outcome.IGNORED  # an old accusation, now stale


def test_dead_about_this_node_is_refuted_above_its_incarnation() -> None:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    assert table.apply_dead(Dead("a", 7, "b"), 1.0) is Outcome.REFUTE  # an earlier life of this node died at 7
    assert table.refute(7, 1.0).incarnation == 8


def test_alive_about_this_node_saying_something_else_is_refuted() -> None:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    assert table.apply_alive(Alive("a", 0, "a:1", P), 1.0) is Outcome.IGNORED
    assert table.apply_alive(Alive("a", 0, "elsewhere:1", P), 1.0) is Outcome.REFUTE


def test_new_payload_raises_the_incarnation_only_when_it_changes() -> None:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    assert table.set_local_payload(P, 1.0) is None
    alive = table.set_local_payload(NodePayload(peer_url="http://a", jobs=("m1",)), 1.0)
    assert alive is not None and (alive.incarnation, alive.payload.jobs) == (1, ("m1",))


def test_reap_forgets_only_members_dead_long_enough() -> None:
    table = table_with_b(3)
    table.apply_alive(Alive("c", 1, "c:1", NodePayload()), 1.0)
    table.apply_dead(Dead("b", 3, "c"), 10.0)
    assert table.reap(15.0, dead_reclaim_s=10.0) == []
    assert table.reap(20.0, dead_reclaim_s=10.0) == ["b"]
    assert [m.name for m in table.members()] == ["a", "c"]


def test_sample_others_returns_distinct_accepted_members() -> None:
    table = MemberTable("a", "a:1", P, now_s=0.0)
    for i in range(20):
        table.apply_alive(Alive(f"m{i}", 1, f"m{i}:1", NodePayload()), 0.0)
    for i in range(0, 20, 2):
        table.apply_dead(Dead(f"m{i}", 1, "a"), 1.0)
    chosen = table.sample_others(random.Random(0), 5, lambda m: m.is_alive)
    assert len({m.name for m in chosen}) == 5 and all(int(m.name[1:]) % 2 == 1 for m in chosen)
    assert len(table.sample_others(random.Random(0), 50, lambda m: m.is_alive)) == 10
