"""Sampler replicas: N real engines drain one queue, and seeded results do not depend on N.

The actor runs real `TorchSampler` engines on the tiny Llama; only the future table's
request log (the store's part) is an in-memory stand-in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.actors.sampler import Sample, SamplerActor, SamplerHandle
from openrld.batches import SampleJob, SamplingSpec
from openrld.gpu.torch_sampler import TorchSampler

REQUESTS = 6
OWNER = "u"


class MemoryLog:
    """The request log the future table writes to (the store, in the daemon)."""

    def record(self, request_id: str, model_id: str, kind: str) -> None:
        pass

    def finish(self, finished: object) -> None:
        pass

    def state(self, request_id: str) -> str | None:
        return None


def job(i: int) -> SampleJob:
    params = SamplingSpec(max_tokens=6, temperature=1.0, seed=100 + i, stop_at_eos=False)
    return SampleJob(prompt=np.array([11, 12, 13 + i], np.int64), num_samples=2, params=params)


async def start(nursery: trio.Nursery, model_dir: Path, futures: FutureTable, replicas: int) -> SamplerHandle:
    actor = SamplerActor(
        name="tiny-llama", build_engine=lambda: TorchSampler(model_dir, torch.device("cpu")),
        limiter=trio.CapacityLimiter(1), futures=futures, queue_limit=64, replicas=replicas,
    )
    return await nursery.start(actor.run)


async def sample_all(handle: SamplerHandle, futures: FutureTable) -> list[list[list[int]]]:
    """Submit every job at once, then collect each one's sampled tokens."""
    for i in range(REQUESTS):
        futures.create(f"r{i}", model_id="s:sample:0", kind="sample", owner=OWNER)
        handle.submit_nowait(Sample(request_id=f"r{i}", version=None, job=job(i), sampler_id="s:sample:0"))
    tokens = []
    for i in range(REQUESTS):
        outcome = await futures.wait(f"r{i}", owner=OWNER, hold_s=120)
        assert isinstance(outcome, Completed), outcome
        tokens.append([s.tokens.tolist() for s in outcome.value.sequences])
    return tokens


def run(model_dir: Path, replicas: int) -> tuple[list[list[list[int]]], tuple[int, ...]]:
    async def main():
        futures = FutureTable(MemoryLog())
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                handle = await start(nursery, model_dir, futures, replicas)
                tokens = await sample_all(handle, futures)
                nursery.cancel_scope.cancel()
        return tokens, handle.statistics().requests_by_replica

    return trio.run(main)


@pytest.fixture(scope="module")
def one_replica(tiny_llama: Path) -> list[list[list[int]]]:
    tokens, per_replica = run(tiny_llama, 1)
    assert per_replica == (REQUESTS,)
    return tokens


def test_two_replicas_both_serve_requests_of_one_queue(tiny_llama):
    _, per_replica = run(tiny_llama, 2)
    assert len(per_replica) == 2 and sum(per_replica) == REQUESTS
    assert min(per_replica) >= 1, per_replica


def test_seeded_tokens_do_not_depend_on_the_replica_count(tiny_llama, one_replica):
    tokens, _ = run(tiny_llama, 3)
    assert tokens == one_replica


def test_ensure_replicas_grows_the_group_and_never_shrinks_it(tiny_llama):
    async def main():
        futures = FutureTable(MemoryLog())
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                handle = await start(nursery, tiny_llama, futures, 1)
                await handle.ensure_replicas(3)
                await handle.ensure_replicas(2)  # another job asking for fewer changes nothing
                grown = handle.statistics().replicas
                await sample_all(handle, futures)
                nursery.cancel_scope.cancel()
        return grown, handle.statistics().requests_by_replica

    grown, per_replica = trio.run(main)
    assert grown == 3
    assert len(per_replica) == 3 and sum(per_replica) == REQUESTS
