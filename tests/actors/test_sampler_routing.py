"""Prefix-aware routing across sampler replicas, in the actor with real engines (the tiny Llama).

Which replica admitted a request is read from the engines themselves: each records the
request ids it was given. The routing arithmetic is pinned in test_prefix_routing.py;
here, what it does to a real queue drained by two workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.actors.sampler import Routing, Sample, SamplerActor, SamplerStatistics
from openrld.batches import SampleJob, SamplingSpec
from openrld.gpu.torch_sampler import TorchSampler
from tests.actors.test_sampler_replicas import OWNER, MemoryLog

PREFIX_TOKENS = 64  # 4 blocks of 16: a family sticks while its replica holds < 4 requests more than the other


class AdmissionLog(TorchSampler):
    """A real engine that keeps the ids of the requests added to it (what the test observes)."""

    def __init__(self, model_dir: Path, admitted: list[str]) -> None:
        super().__init__(model_dir, torch.device("cpu"))
        self.admitted = admitted

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        super().add(request_id, version, job)
        self.admitted.append(request_id)


def family_prompt(family: int, member: int) -> np.ndarray:
    prefix = [(37 * family + 5 * i) % 380 + 2 for i in range(PREFIX_TOKENS)]
    return np.array(prefix + [300 + family, 10 + member, 20 + member], np.int64)


def sample(request_id: str, prompt: np.ndarray) -> Sample:
    params = SamplingSpec(max_tokens=4, temperature=1.0, seed=7, stop_at_eos=False)
    return Sample(request_id=request_id, version=None, job=SampleJob(prompt=prompt, num_samples=1, params=params),
                  sampler_id="s:sample:0")


def run(model_dir: Path, routing: Routing, ops: list[Sample]) -> tuple[list[list[str]], SamplerStatistics]:
    """Submit `ops` at once to a 2-replica actor; per replica, the request ids it admitted."""
    logs: list[list[str]] = []

    def build() -> TorchSampler:
        logs.append([])
        return AdmissionLog(model_dir, logs[-1])

    async def main() -> SamplerStatistics:
        futures = FutureTable(MemoryLog())
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                actor = SamplerActor(
                    name="tiny-llama", build_engine=build, limiter=trio.CapacityLimiter(1), futures=futures,
                    queue_limit=64, replicas=2, routing=routing,
                )
                handle = await nursery.start(actor.run)
                for op in ops:
                    futures.create(op.request_id, model_id=op.sampler_id, kind="sample", owner=OWNER)
                    handle.submit_nowait(op)
                for op in ops:
                    outcome = await futures.wait(op.request_id, owner=OWNER, hold_s=120)
                    assert isinstance(outcome, Completed), outcome
                nursery.cancel_scope.cancel()
        return handle.statistics()

    stats = trio.run(main)
    return logs, stats


def test_two_prompt_families_stick_to_two_replicas(tiny_llama):
    # Interleaved, as two clients' groups arrive: a0 b0 a1 b1 ... Each head goes where its
    # family went: 64 - 16 * load beats the other replica's 0 - 16 * load while loads are even.
    ops = [sample(f"{family}{member}", family_prompt(index, member))
           for member in range(4) for index, family in enumerate("ab")]
    logs, stats = run(tiny_llama, "prefix", ops)
    assert [sorted(log) for log in logs] == [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]]
    # a0 and b0 found no replica holding their prefix; the other six did, 64 tokens each.
    assert (stats.routing, stats.routed_by_prefix, stats.routed_by_load, stats.routed_prefix_tokens) == (
        "prefix", 6, 2, 6 * PREFIX_TOKENS,
    )
    assert stats.prompt_tokens == 8 * (PREFIX_TOKENS + 3)


def test_one_family_spills_to_the_idle_replica_once_its_own_holds_four_more(tiny_llama):
    # Ten requests of one family at once: replica 0 takes four (64 - 16 * 4 = 0 ties with the
    # idle replica's 0, and the less loaded wins), then replica 1 takes a share too.
    ops = [sample(f"a{member}", family_prompt(0, member)) for member in range(10)]
    logs, stats = run(tiny_llama, "prefix", ops)
    assert logs[0][:4] == ["a0", "a1", "a2", "a3"] and logs[1][0] == "a4"
    assert sorted(logs[0] + logs[1]) == sorted(op.request_id for op in ops)
    assert stats.requests_by_replica[0] >= 4 and stats.requests_by_replica[1] >= 1, stats.requests_by_replica


def test_least_loaded_routing_still_spreads_and_counts_its_lucky_prefix_hits(tiny_llama):
    ops = [sample(f"{family}{member}", family_prompt(index, member))
           for member in range(4) for index, family in enumerate("ab")]
    logs, stats = run(tiny_llama, "least_loaded", ops)
    assert len(logs[0]) >= 1 and len(logs[1]) >= 1 and len(logs[0]) + len(logs[1]) == 8, logs
    assert stats.routing == "least_loaded" and stats.routed_by_prefix + stats.routed_by_load == 8
