"""Placement across nodes: join a resident LoRA group, else free devices, else time-slice; exclusive takes free only."""

from __future__ import annotations

from openrld.cluster.membership.messages import DeviceSlot, GroupLoad, MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.placement import GROUP_ROOM, Candidate, JobNeeds, Placer, candidate, rank, too_large

LORA_LLAMA = JobNeeds(base_model="llama", own_group=False, is_exclusive=False)
EXCLUSIVE = JobNeeds(base_model="llama", own_group=True, is_exclusive=True)
FULL = JobNeeds(base_model="llama", own_group=True, is_exclusive=False)


def node(name: str, free: int, shared: int | None = None, groups_on_shared: int = 0, groups=()) -> Candidate:
    return Candidate(name, free, free if shared is None else shared, groups_on_shared, tuple(groups))


def member(name: str, devices: list[DeviceSlot], incarnation: int = 1, state=MemberState.ALIVE, groups=()) -> Member:
    payload = NodePayload(peer_url=f"http://{name}", devices=tuple(devices), groups=tuple(groups))
    return Member(name, f"{name}:7946", incarnation, state, payload, 0.0)


def test_a_lora_job_joins_the_resident_group_for_its_base_model_before_a_free_node():
    nodes = [node("a", free=2), node("b", free=0, shared=1, groups_on_shared=1, groups=[GroupLoad("llama", 3, 0)])]
    assert rank(nodes, LORA_LLAMA) == ["b", "a"]


def test_a_resident_group_that_is_full_is_passed_over_for_a_free_device():
    full = GroupLoad("llama", GROUP_ROOM, 0)
    nodes = [node("a", free=1), node("b", free=0, shared=1, groups_on_shared=1, groups=[full])]
    assert rank(nodes, LORA_LLAMA) == ["a", "b"]


def test_resident_groups_are_ranked_by_adapters_plus_queue_depth():
    nodes = [
        node("a", free=0, shared=1, groups_on_shared=1, groups=[GroupLoad("llama", 2, 5)]),
        node("b", free=0, shared=1, groups_on_shared=1, groups=[GroupLoad("llama", 4, 0)]),
    ]
    assert rank(nodes, LORA_LLAMA) == ["b", "a"]


def test_a_new_group_goes_to_the_node_with_the_most_free_devices():
    assert rank([node("a", free=1), node("b", free=3), node("c", free=2)], FULL) == ["b", "c", "a"]


def test_with_no_free_device_the_least_crowded_shareable_device_is_time_sliced():
    nodes = [node("a", free=0, shared=2, groups_on_shared=6), node("b", free=0, shared=1, groups_on_shared=2)]
    assert rank(nodes, FULL) == ["b", "a"]


def test_an_exclusive_job_goes_only_to_nodes_with_a_free_device():
    nodes = [node("a", free=0, shared=1, groups_on_shared=1), node("b", free=1), node("c", free=0, shared=0)]
    assert rank(nodes, EXCLUSIVE) == ["b"]


def test_a_job_needing_two_devices_skips_a_node_with_one_free():
    needs = JobNeeds(base_model="llama", own_group=True, is_exclusive=True, devices=2)
    assert rank([node("a", free=1), node("b", free=2)], needs) == ["b"]


def test_a_shared_job_needing_two_devices_is_time_sliced_only_where_two_are_shareable():
    needs = JobNeeds(base_model="llama", own_group=True, is_exclusive=False, devices=2)
    nodes = [node("a", free=0, shared=1, groups_on_shared=1), node("b", free=1, shared=2, groups_on_shared=3)]
    assert rank(nodes, needs) == ["b"]


def test_a_node_held_wholly_by_exclusive_jobs_is_not_time_sliced():
    assert rank([node("a", free=0, shared=0)], FULL) == []


def test_candidate_counts_free_and_shareable_devices_from_the_payload():
    devices = [
        DeviceSlot("cuda:0", "cuda", 80, 80, groups=0),
        DeviceSlot("cuda:1", "cuda", 80, 10, groups=2),
        DeviceSlot("cuda:2", "cuda", 80, 10, groups=1, is_exclusive=True),
    ]
    assert candidate(member("a", devices)) == Candidate("a", 1, 2, 2, ())


def test_the_placer_leaves_out_dead_members_and_members_without_devices():
    free = [DeviceSlot("cpu", "cpu", 1, 1)]
    members = [member("a", free, state=MemberState.DEAD), member("b", []), member("c", free)]
    assert Placer().rank(members, FULL) == ["c"]


def test_the_placer_counts_its_own_placement_until_the_node_publishes_a_newer_payload():
    placer = Placer()
    one_free = [DeviceSlot("cpu", "cpu", 1, 1)]
    b, c = member("b", one_free, incarnation=4), member("c", one_free, incarnation=9)
    placer.placed(b, FULL)
    assert placer.rank([b, c], FULL) == ["c", "b"]  # b's one device is taken, by what we sent it
    newer_b = member("b", one_free, incarnation=5)  # its payload now speaks for itself
    assert placer.rank([newer_b, c], FULL) == ["b", "c"]


def test_a_refused_placement_is_forgotten_at_once():
    placer = Placer()
    one_free = [DeviceSlot("cpu", "cpu", 1, 1)]
    b, c = member("b", one_free), member("c", one_free)
    placer.forget(placer.placed(b, FULL))
    assert placer.rank([b, c], FULL) == ["b", "c"]


def test_a_lora_job_placed_on_a_node_counts_as_a_resident_group_there():
    placer = Placer()
    two_free = [DeviceSlot("cpu:0", "cpu", 1, 1), DeviceSlot("cpu:1", "cpu", 1, 1)]
    b, c = member("b", two_free), member("c", two_free)
    placer.placed(c, LORA_LLAMA)
    assert placer.rank([b, c], LORA_LLAMA) == ["c", "b"]


def test_a_trainer_wider_than_the_free_devices_of_the_cluster_is_refused_naming_it():
    members = [member("a", [DeviceSlot("cuda:0", "cuda", 80, 80)] * 2), member("b", [DeviceSlot("cuda:0", "cuda", 80, 80)] * 4)]
    needs = JobNeeds(base_model="llama", own_group=True, is_exclusive=True, devices=8)
    assert too_large(members, needs) == (
        "openrl.trainer_gpus=8: no node has 8 devices, and a trainer that spans nodes takes free ones only; "
        "the cluster has 6 free (a: 2, b: 4); lower openrl.trainer_gpus, or wait for jobs to end"
    )


def test_a_trainer_that_fits_the_largest_node_is_not_too_large_even_when_its_devices_are_busy():
    busy = DeviceSlot("cuda:0", "cuda", 80, 10, groups=1)
    needs = JobNeeds(base_model="llama", own_group=True, is_exclusive=True, devices=2)
    assert too_large([member("a", [busy, busy])], needs) is None


def test_a_lora_job_never_joins_a_group_on_a_node_whose_every_device_is_exclusive():
    # The group there is an exclusive job's own (gossip names its base model like a LoRA group's).
    nodes = [node("a", free=0, shared=0, groups=[GroupLoad("llama", 1, 0)]), node("c", free=1)]
    assert rank(nodes, LORA_LLAMA) == ["c"]
