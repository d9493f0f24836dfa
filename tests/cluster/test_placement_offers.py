"""A job's offer round: the ranked nodes in turn, each counted while asked, the first taker's answer standing."""

from __future__ import annotations

import pytest

from openrld.cluster.membership.messages import DeviceSlot, JobNote, MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.placement import JobNeeds, OfferRound, Placer, Reply, needs_of_note, needs_of_settings
from openrld.settings import parse_settings

LORA = JobNeeds(base_model="llama", own_group=False, is_exclusive=False)


def member(name: str, free: int) -> Member:
    devices = tuple(DeviceSlot(f"cuda:{i}", "cuda", 80, 80, groups=0 if i < free else 1) for i in range(2))
    return Member(name, f"{name}:7946", 1, MemberState.ALIVE, NodePayload(peer_url=f"http://{name}", devices=devices), 0.0)


MEMBERS = {m.name: m for m in (member("a", free=2), member("b", free=1))}  # "a" has more free devices: first


def test_nodes_are_offered_the_job_in_rank_order_until_one_takes_it():
    offers = OfferRound(Placer(), MEMBERS.values(), LORA)
    asked = []
    while (m := offers.next(MEMBERS.get)) is not None:
        asked.append(m.name)
        if offers.answered(Reply.NO_ROOM if m.name == "a" else Reply.TAKEN):
            break
    assert (asked, offers.refused) == (["a", "b"], 1)


def test_a_failed_answer_stands_and_no_further_node_is_asked():
    offers = OfferRound(Placer(), MEMBERS.values(), LORA)
    assert offers.next(MEMBERS.get).name == "a"  # type: ignore[union-attr]
    assert offers.answered(Reply.FAILED) is True
    assert offers.refused == 0


def test_a_node_gone_since_ranking_is_skipped():
    offers = OfferRound(Placer(), MEMBERS.values(), LORA)
    assert offers.next({"b": MEMBERS["b"]}.get).name == "b"  # type: ignore[union-attr]
    assert offers.answered(Reply.NO_ROOM) is False
    assert offers.next(MEMBERS.get) is None


def test_when_no_node_ranks_the_last_resort_is_asked_alone():
    exclusive = JobNeeds(base_model="llama", own_group=True, is_exclusive=True)
    busy = {m.name: m for m in (member("a", free=0), member("b", free=0))}  # the view shows no free device
    offers = OfferRound(Placer(), busy.values(), exclusive, last_resort="b")
    assert offers.next(busy.get).name == "b"  # type: ignore[union-attr]
    assert offers.answered(Reply.NO_ROOM) is False
    assert offers.next(busy.get) is None


def test_the_last_resort_is_not_asked_when_another_node_ranks():
    exclusive = JobNeeds(base_model="llama", own_group=True, is_exclusive=True)
    view = {m.name: m for m in (member("a", free=2), member("b", free=0))}
    offers = OfferRound(Placer(), view.values(), exclusive, last_resort="b")
    assert offers.next(view.get).name == "a"  # type: ignore[union-attr]
    assert offers.answered(Reply.NO_ROOM) is False
    assert offers.next(view.get) is None  # "a" refused: its refusal stands, "b" is not asked


def test_a_node_counts_while_it_is_asked_and_is_forgotten_once_it_refuses():
    placer = Placer()
    full = JobNeeds(base_model="llama", own_group=True, is_exclusive=False)
    first, second = OfferRound(placer, MEMBERS.values(), full), OfferRound(placer, MEMBERS.values(), full)
    # "a" (2 free) is asked first; while it is, it counts as 1 free, tied with "b", and ties go by name.
    assert [first.next(MEMBERS.get).name, second.next(MEMBERS.get).name] == ["a", "a"]  # type: ignore[union-attr]
    # Both asked at once: "a" counts 0 free, so a third job goes to "b" first.
    assert OfferRound(placer, MEMBERS.values(), full).next(MEMBERS.get).name == "b"  # type: ignore[union-attr]
    assert first.answered(Reply.NO_ROOM) is False
    # The refusal is forgotten: "a" counts 1 free again, and "b" 0 (the third job is being asked there).
    assert OfferRound(placer, MEMBERS.values(), full).next(MEMBERS.get).name == "a"  # type: ignore[union-attr]


def test_answered_before_next_is_a_programming_error():
    with pytest.raises(AssertionError):
        OfferRound(Placer(), MEMBERS.values(), LORA).answered(Reply.TAKEN)


@pytest.mark.parametrize(
    ("tags", "metadata", "expected"),
    [
        ([], {}, JobNeeds("llama", own_group=False, is_exclusive=False, devices=1)),
        (["openrl.fine_tuning_type=full"], {}, JobNeeds("llama", own_group=True, is_exclusive=False, devices=1)),
        ([], {"openrl.exclusive": "true"}, JobNeeds("llama", own_group=True, is_exclusive=True, devices=1)),
        (
            [], {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "2"},
            JobNeeds("llama", own_group=True, is_exclusive=False, devices=2),
        ),
        ([], {"openrl.trainer_backend": "automodel"}, JobNeeds("llama", own_group=True, is_exclusive=False, devices=1)),
    ],
    ids=["lora", "full", "exclusive", "two-gpu-trainer", "one-gpu-automodel"],
)
def test_a_new_jobs_needs_come_from_its_settings(tags, metadata, expected):
    settings, _ = parse_settings(tags, {}, metadata)
    assert needs_of_settings(settings, "llama") == expected


@pytest.mark.parametrize(
    ("note", "expected"),
    [
        (None, JobNeeds("", own_group=False, is_exclusive=False)),
        (JobNote("alice", "llama", "lora", False), JobNeeds("llama", own_group=False, is_exclusive=False)),
        (JobNote("alice", "llama", "full", False), JobNeeds("llama", own_group=True, is_exclusive=False)),
        (JobNote("alice", "llama", "lora", True), JobNeeds("llama", own_group=True, is_exclusive=True)),
    ],
    ids=["no-note", "lora", "full", "exclusive"],
)
def test_a_restored_jobs_needs_come_from_its_lost_homes_note(note, expected):
    assert needs_of_note(note) == expected
