"""The sampler actor's pure state: SampleQueue (limit, cancel, queue_state) and VersionCache (pinning)."""

from __future__ import annotations

import numpy as np
import pytest

from openrld.actors.sampler import QueueState, Sample, SampleQueue, VersionCache
from openrld.batches import SampleJob, SamplingSpec
from openrld.errors import TooManyRequests


def op(request_id: str) -> Sample:
    job = SampleJob(prompt=np.array([1, 2], dtype=np.int64), num_samples=1, params=SamplingSpec(max_tokens=1))
    return Sample(request_id=request_id, version=None, job=job)


def test_push_past_the_limit_is_429_and_counted() -> None:
    queue = SampleQueue(limit=2)
    queue.push(op("a"))
    queue.take()  # running requests count toward the limit too
    queue.push(op("b"))
    with pytest.raises(TooManyRequests, match="queue is full"):
        queue.push(op("c"))
    assert queue.refused == 1 and queue.depth() == 2


def test_waiting_request_is_paused_while_the_queue_is_full() -> None:
    queue = SampleQueue(limit=2)
    queue.push(op("running"))
    queue.take()
    queue.push(op("waiting"))
    assert queue.queue_state("waiting") is QueueState.PAUSED_CAPACITY
    assert queue.queue_state("running") is QueueState.ACTIVE
    queue.done("running")
    assert queue.queue_state("waiting") is QueueState.ACTIVE


def test_cancelled_waiting_request_is_never_taken() -> None:
    queue = SampleQueue(limit=4)
    queue.push(op("a"))
    queue.push(op("b"))
    assert queue.cancel("a") is True
    assert queue.take().request_id == "b" and not queue.has_waiting()


def test_cancelled_running_request_frees_its_place_and_goes_to_its_engine_once() -> None:
    queue = SampleQueue(limit=1)
    queue.push(op("a"))
    queue.take()
    assert queue.cancel("a") is True
    assert queue.cancel("a") is False  # already cancelled
    queue.push(op("b"))  # a's place is free before its engine has dropped it
    assert queue.take_cancels({"x"}) == []  # another engine's requests
    assert queue.take_cancels({"a"}) == ["a"]
    assert queue.take_cancels({"a"}) == []


def test_cancel_of_an_unknown_request_is_false() -> None:
    assert SampleQueue(limit=1).cancel("nope") is False


def test_eviction_takes_the_least_recent_unpinned_version() -> None:
    cache = VersionCache(max_loaded=2)
    assert cache.admit("v1", pinned=set()) == []
    assert cache.admit("v2", pinned=set()) == []
    assert cache.admit("v3", pinned={"v1"}) == ["v2"]
    assert list(cache.loaded) == ["v1", "v3"]


def test_eviction_waits_while_every_old_version_is_pinned() -> None:
    cache = VersionCache(max_loaded=1)
    cache.admit("v1", pinned=set())
    assert cache.admit("v2", pinned={"v1"}) == []  # over the limit until v1's requests finish
    assert cache.admit("v3", pinned=set()) == ["v1", "v2"]
