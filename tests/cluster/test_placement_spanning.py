"""A trainer wider than any node: which nodes it spans, whole nodes first, one segment where known."""

from __future__ import annotations

import pytest

from openrld.cluster.membership.messages import DeviceSlot, MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.placement import JobNeeds, Placer, too_large
from openrld.cluster.placement.spanning import SpanNode, SpanPart, SpanPlan, plan_span, span_nodes

SPAN = JobNeeds(base_model="llama", own_group=True, is_exclusive=True, devices=4)


def plan(*parts: tuple[str, int]) -> SpanPlan:
    return SpanPlan(tuple(SpanPart(name, devices) for name, devices in parts))


def member(name: str, free: int, busy: int = 0, segment: str = "", state=MemberState.ALIVE) -> Member:
    devices = [DeviceSlot(f"cpu:{i}", "cpu", 1, 1) for i in range(free)]
    devices += [DeviceSlot(f"cpu:{free + i}", "cpu", 1, 1, groups=1, is_exclusive=True) for i in range(busy)]
    payload = NodePayload(peer_url=f"http://{name}", devices=tuple(devices), segment=segment)
    return Member(name, f"{name}:7946", 1, state, payload, 0.0)


@pytest.mark.parametrize(
    ("free", "devices", "expected"),
    [
        ({"a": 8, "b": 8, "c": 5, "d": 5, "e": 6}, 16, plan(("a", 8), ("b", 8))),
        ({"a": 8, "b": 8, "c": 5, "d": 6}, 13, plan(("a", 8), ("c", 5))),
        ({"a": 2, "b": 2, "c": 2}, 4, plan(("a", 2), ("b", 2))),
        ({"a": 1, "b": 2, "c": 2}, 3, plan(("b", 2), ("a", 1))),
        ({"a": 2, "b": 1}, 4, None),
    ],
    ids=["two-whole-nodes", "the-rest-on-the-smallest-it-fills", "ties-by-name", "home-is-the-largest-part", "too-few"],
)
def test_a_span_takes_whole_nodes_first(free: dict[str, int], devices: int, expected: SpanPlan | None):
    assert plan_span([SpanNode(n, f) for n, f in free.items()], devices) == expected


def test_a_span_keeps_to_one_segment_when_one_holds_it():
    nodes = [SpanNode("a", 2, "zone-1"), SpanNode("b", 2, "zone-2"), SpanNode("c", 2, "zone-2")]
    assert plan_span(nodes, 4) == plan(("b", 2), ("c", 2))


def test_a_span_crosses_segments_when_no_segment_holds_it():
    nodes = [SpanNode("a", 2, "zone-1"), SpanNode("b", 2, "zone-2")]
    assert plan_span(nodes, 4) == plan(("a", 2), ("b", 2))


def test_a_given_home_holds_rank_0_and_its_free_devices_first():
    nodes = [SpanNode("a", 2), SpanNode("b", 2), SpanNode("c", 1)]
    assert plan_span(nodes, 3, home="c") == plan(("c", 1), ("a", 2))


def test_only_free_devices_of_live_nodes_count():
    members = [member("a", 1, busy=1), member("b", 2), member("c", 2, state=MemberState.DEAD)]
    assert span_nodes(members) == [SpanNode("a", 1), SpanNode("b", 2)]


def test_the_placer_offers_a_spanning_job_to_its_home_then_the_other_nodes():
    assert Placer().rank([member("a", 1), member("b", 2), member("c", 2)], SPAN) == ["b", "c"]


def test_a_spanning_job_that_fits_the_free_devices_is_not_too_large():
    assert too_large([member("a", 2), member("b", 2)], SPAN) is None


def test_a_span_larger_than_the_free_devices_is_refused_naming_the_setting_and_the_free_devices():
    members = [member("a", 2), member("b", 1, busy=1)]
    assert too_large(members, SPAN) == (
        "openrl.trainer_gpus=4: no node has 4 devices, and a trainer that spans nodes takes free ones only; "
        "the cluster has 3 free (a: 2, b: 1); lower openrl.trainer_gpus, or wait for jobs to end"
    )
