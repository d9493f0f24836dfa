"""A request the sampler actor cannot admit fails alone; the actor goes on serving.

A stand-in engine whose `add` raises for one request stands for an engine with a
bug; the future table and the actor are real.
"""

from __future__ import annotations

import logging

import pytest
import trio

from openrld.actors.futures import Completed, Failed, FutureTable
from openrld.actors.sampler import SamplerActor
from openrld.batches import SampleJob
from tests.actors.test_sampler_replicas import OWNER, MemoryLog
from tests.actors.test_sampler_settle import StepsEngine, sample


class AddFailsOnce(StepsEngine):
    """Raises what a bug would (not an OpenrldError, KeyError or ValueError) on admitting "broken"."""

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        if request_id == "broken":
            raise RuntimeError("engine bug")
        super().add(request_id, version, job)


def broken_then_next() -> dict[str, object]:
    """Submit "broken", wait for its outcome, then submit "next"; both outcomes."""

    async def main():
        futures = FutureTable(MemoryLog())
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                actor = SamplerActor(
                    name="stand-in", build_engine=AddFailsOnce, limiter=trio.CapacityLimiter(1), futures=futures,
                    queue_limit=8,
                )
                handle = await nursery.start(actor.run)
                outcomes = {}
                for request_id in ("broken", "next"):
                    futures.create(request_id, model_id="s:sample:0", kind="sample", owner=OWNER)
                    handle.submit_nowait(sample(request_id, 3))
                    outcomes[request_id] = await futures.wait(request_id, owner=OWNER, hold_s=20)
                nursery.cancel_scope.cancel()
        return outcomes

    return trio.run(main)


def test_an_unexpected_error_admitting_a_request_fails_it_as_a_server_error_and_the_next_one_is_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="openrld.actors.sampler"):
        outcomes = broken_then_next()
    assert outcomes["broken"] == Failed(
        detail="sampling request not started: RuntimeError: engine bug", category="server"
    )
    served = outcomes["next"]
    assert isinstance(served, Completed)
    assert served.value.sequences[0].tokens.tolist() == [0, 1, 2]
    [logged] = [r for r in caplog.records if r.getMessage().startswith("sampler admit failed")]
    assert logged.getMessage() == "sampler admit failed group=stand-in request_id=broken"
    assert logged.exc_info is not None and isinstance(logged.exc_info[1], RuntimeError)  # with its traceback
