"""Placement of worker groups on a node's devices: free first, exclusive alone, then shared turns."""

from __future__ import annotations

import pytest

from openrld.actors.device_pool import DevicePool, DeviceUse, Placement
from openrld.errors import BadRequest, ServiceUnavailable


def test_a_group_with_two_free_devices_gets_one_for_each_worker():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
    assert pool.place("llama", exclusive=False, label="base model llama") == Placement("llama", "cpu:0", "cpu:1", False)


def test_a_group_with_one_free_device_puts_both_workers_on_it():
    pool = DevicePool(["cpu:0"])
    assert pool.place("llama", exclusive=False, label="llama") == Placement("llama", "cpu:0", "cpu:0", False)


def test_with_no_free_device_a_shared_group_joins_the_least_loaded_one():
    pool = DevicePool(["cpu:0", "cpu:1"])
    pool.place("a", exclusive=False, label="a")  # takes both
    pool.place("b", exclusive=False, label="b")
    pool.place("c", exclusive=False, label="c")
    assert pool.statistics() == [
        DeviceUse("cpu:0", ["a", "b"], False),
        DeviceUse("cpu:1", ["a", "c"], False),
    ]


def test_placing_a_group_again_answers_its_first_placement():
    pool = DevicePool(["cpu:0", "cpu:1"])
    first = pool.place("a", exclusive=False, label="a")
    assert pool.place("a", exclusive=True, label="a") == first


def test_an_exclusive_group_with_no_free_device_is_refused_naming_the_setting():
    pool = DevicePool(["cpu:0"])
    pool.place("llama", exclusive=False, label="llama")
    with pytest.raises(BadRequest) as excinfo:
        pool.place("s:train:0", exclusive=True, label="job s:train:0")
    assert excinfo.value.key == "openrl.exclusive"
    assert excinfo.value.detail == (
        "openrl.exclusive=true: job s:train:0 needs a device of its own, and every device of this node is in use "
        "(cpu:0: llama); drop openrl.exclusive, or wait for a job to end"
    )


def test_no_shared_group_is_ever_placed_on_an_exclusive_device():
    pool = DevicePool(["cpu:0", "cpu:1"])
    pool.place("hero", exclusive=True, label="hero")
    with pytest.raises(ServiceUnavailable, match=r"held by an exclusive job \(cpu:0: hero, cpu:1: hero\)"):
        pool.place("llama", exclusive=False, label="base model llama")


def test_a_released_group_frees_its_devices():
    pool = DevicePool(["cpu:0"])
    pool.place("hero", exclusive=True, label="hero")
    pool.release("hero")
    assert pool.free_devices() == ["cpu:0"]


def test_a_trainer_on_three_devices_takes_three_free_ones_and_its_sampler_the_next():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    assert pool.place("job", exclusive=False, label="job j", trainer_devices=3) == Placement(
        "job", "cpu:0", "cpu:3", False, ("cpu:0", "cpu:1", "cpu:2")
    )
    assert pool.free_devices() == []


def test_a_trainer_on_every_device_shares_its_first_with_its_sampler():
    pool = DevicePool(["cpu:0", "cpu:1"])
    assert pool.place("job", exclusive=True, label="job j", trainer_devices=2) == Placement(
        "job", "cpu:0", "cpu:0", True, ("cpu:0", "cpu:1")
    )


def test_an_exclusive_trainer_on_more_devices_than_are_free_is_refused_naming_the_setting_and_the_free_count():
    pool = DevicePool(["cpu:0", "cpu:1"])
    pool.place("other", exclusive=False, label="base model llama")
    with pytest.raises(BadRequest) as refused:
        pool.place("job", exclusive=True, label="job j", trainer_devices=2)
    assert (refused.value.key, refused.value.detail) == (
        "openrl.trainer_gpus",
        "openrl.trainer_gpus=2: job j needs 2 free devices on one node, and this node has 0 free of 2 "
        "(cpu:0: base model llama, cpu:1: base model llama)",
    )
    assert pool.placement_of("job") is None


def test_a_shared_trainer_with_too_few_free_devices_takes_the_least_loaded_in_device_order():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
    pool.place("a", exclusive=False, label="a")  # cpu:0 and cpu:1
    pool.place("b", exclusive=False, label="b")  # cpu:2
    pool.place("c", exclusive=False, label="c")  # cpu:0 again
    assert pool.place("job", exclusive=False, label="job j", trainer_devices=2) == Placement(
        "job", "cpu:1", "cpu:1", False, ("cpu:1", "cpu:2")
    )


def test_a_shared_trainer_never_takes_a_device_an_exclusive_group_holds():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
    pool.place("hero", exclusive=True, label="job hero")
    pool.place("a", exclusive=False, label="base model a")
    with pytest.raises(BadRequest) as refused:
        pool.place("job", exclusive=False, label="job j", trainer_devices=2)
    assert (refused.value.key, refused.value.detail) == (
        "openrl.trainer_gpus",
        "openrl.trainer_gpus=2: job j needs 2 devices on one node, and this node has 3, 1 held by no exclusive job "
        "(cpu:0: job hero, cpu:1: job hero, cpu:2: base model a)",
    )


def test_two_shared_trainers_on_two_devices_share_both():
    pool = DevicePool(["cpu:0", "cpu:1"])
    pool.place("one", exclusive=False, label="job one", trainer_devices=2)
    pool.place("two", exclusive=False, label="job two", trainer_devices=2)
    assert pool.statistics() == [
        DeviceUse("cpu:0", ["one", "two"], False),
        DeviceUse("cpu:1", ["one", "two"], False),
    ]


def test_a_spread_trainers_devices_are_free_again_once_released():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
    pool.place("job", exclusive=False, label="job j", trainer_devices=2)
    pool.release("job")
    assert pool.free_devices() == ["cpu:0", "cpu:1", "cpu:2"]


def test_devices_held_for_another_nodes_span_are_exclusive_and_have_no_sampler():
    pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
    pool.place("llama", exclusive=False, label="llama")  # cpu:0 and cpu:1
    assert pool.hold("span:j", 1, label="job j") == Placement("span:j", "cpu:2", "cpu:2", True, ("cpu:2",))
    # A shared group now takes turns on cpu:0, never on the held cpu:2.
    assert pool.place("qwen", exclusive=False, label="qwen") == Placement("qwen", "cpu:0", "cpu:0", False)


def test_a_span_hold_larger_than_the_free_devices_is_refused_naming_the_setting():
    pool = DevicePool(["cpu:0", "cpu:1"])
    pool.place("llama", exclusive=True, label="job a")
    with pytest.raises(BadRequest) as refused:
        pool.hold("span:j", 2, label="job j (ranks for node a)")
    assert refused.value.key == "openrl.trainer_gpus"
    assert str(refused.value.detail) == (
        "openrl.trainer_gpus: job j (ranks for node a) needs 2 free devices here, and this node has 0 "
        "(cpu:0: job a, cpu:1: job a)"
    )
