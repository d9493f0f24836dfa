"""The sampler actor resolves a finished request while its engine steps on.

A stand-in engine (each request runs for its max_tokens steps) stands for the
torch engine; the future table and the actor are real.
"""

from __future__ import annotations

import threading

import numpy as np
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.actors.sampler import Sample, SamplerActor
from openrld.batches import SampledSequence, SampleJob, SampleResult, SamplingSpec
from openrld.engine_types import Finished
from tests.actors.test_sampler_replicas import OWNER, MemoryLog


class StepsEngine:
    """Every live request gains one token a step and finishes after max_tokens of them."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.made: dict[str, int] = {}
        self.steps = 0

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        self.left[request_id] = self.made[request_id] = job.params.max_tokens

    def has_work(self) -> bool:
        return bool(self.left)

    def cancel(self, request_id: str) -> bool:
        return self.left.pop(request_id, None) is not None

    def close(self) -> None:
        pass  # holds nothing; the actor closes its engines as it stops

    def step(self) -> list[Finished]:
        self.steps += 1
        finished = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            if self.left[request_id] == 0:
                del self.left[request_id]
                tokens = np.arange(self.made[request_id], dtype=np.int32)
                logprobs = np.zeros(len(tokens), np.float32)
                sequence = SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason="length")
                finished.append(Finished(request_id=request_id, result=SampleResult(sequences=[sequence])))
        return finished


class CountingLimiter:
    """A capacity limiter of 1 that counts engine-thread calls: the actor takes its limiter
    once per call."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self.calls = 0

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.calls += 1
        await self._limiter.acquire_on_behalf_of(borrower)

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)

    async def __aenter__(self) -> None:
        await self.acquire_on_behalf_of(trio.lowlevel.current_task())

    async def __aexit__(self, *exc_info: object) -> None:
        self.release_on_behalf_of(trio.lowlevel.current_task())


def sample(request_id: str, max_tokens: int) -> Sample:
    job = SampleJob(prompt=np.array([1, 2], np.int64), num_samples=1, params=SamplingSpec(max_tokens=max_tokens))
    return Sample(request_id=request_id, version=None, job=job, sampler_id="s:sample:0")


def run_short_and_long(engine: StepsEngine, limiter: CountingLimiter, during_long=None) -> dict[str, object]:
    """Submit a 3-step and a 40-step request together; returns both outcomes and the
    limiter's call count once both resolved. `during_long(futures)` runs in the test's
    task between the short one resolving and the long one's."""

    async def main():
        futures = FutureTable(MemoryLog())
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                actor = SamplerActor(
                    name="stand-in", build_engine=lambda: engine, limiter=limiter, futures=futures,
                    queue_limit=8,
                )
                handle = await nursery.start(actor.run)
                calls_before = limiter.calls  # building the engine is a worker-thread call too
                for request_id, max_tokens in (("short", 3), ("long", 40)):
                    futures.create(request_id, model_id="s:sample:0", kind="sample", owner=OWNER)
                    handle.submit_nowait(sample(request_id, max_tokens))
                short = await futures.wait("short", owner=OWNER, hold_s=20)
                if during_long is not None:
                    during_long()
                long = await futures.wait("long", owner=OWNER, hold_s=20)
                nursery.cancel_scope.cancel()
        return {"short": short, "long": long, "calls": limiter.calls - calls_before}

    return trio.run(main)


def test_a_request_that_finishes_does_not_end_the_engines_run_of_steps() -> None:
    outcomes = run_short_and_long(StepsEngine(), CountingLimiter())
    assert outcomes["calls"] == 1  # one worker-thread call for all 40 steps


def test_each_request_gets_its_own_result() -> None:
    outcomes = run_short_and_long(StepsEngine(), CountingLimiter())
    for request_id, length in (("short", 3), ("long", 40)):
        outcome = outcomes[request_id]
        assert isinstance(outcome, Completed)
        assert outcome.value.sequences[0].tokens.tolist() == list(range(length))


def test_a_finished_request_resolves_while_the_worker_thread_is_still_in_its_call() -> None:
    """The step after the short request's last one waits in the worker thread until the test
    has seen the short request resolve: its result cannot wait for the call to return."""
    engine, seen_short = StepsEngine(), threading.Event()
    engine_step = engine.step

    def step() -> list[Finished]:
        if engine.steps == 3:  # the short request finished in step 3
            assert seen_short.wait(10)
        return engine_step()

    engine.step = step  # type: ignore[method-assign]
    outcomes = run_short_and_long(engine, CountingLimiter(), during_long=seen_short.set)
    assert isinstance(outcomes["long"], Completed)
    assert outcomes["calls"] == 1


def test_every_step_runs_on_the_replicas_one_engine_thread() -> None:
    engine, threads = StepsEngine(), set()
    engine_step = engine.step

    def step() -> list[Finished]:
        threads.add(threading.get_ident())
        return engine_step()

    engine.step = step  # type: ignore[method-assign]
    run_short_and_long(engine, CountingLimiter())
    assert engine.steps == 40 and len(threads) == 1 and threading.get_ident() not in threads
