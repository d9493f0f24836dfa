"""The trainer actor's engine thread: every engine call on one thread, and the next run of
forward_backward/optim_step queued there before the run ahead of it is settled.

The engine is a stand-in whose calls wait on gates, so that a test can hold the event loop
while the engine moves on; tests/e2e drive the real engine under the real SDK.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
import trio.testing

from openrld.actors.engine_thread import EngineThread
from openrld.actors.futures import Completed, Failed, FutureTable
from openrld.actors.trainer import CreateAdapter, ForwardBackward, OptimStep, TrainerActor
from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec
from tests.actors.test_sampler_replicas import MemoryLog

BATCH = ForwardBackwardBatch(data=[], loss_fn="cross_entropy", loss_config={}, forward_only=False)


class GatedEngine:
    """forward_backward number n announces itself on `started[n]` and waits for `release[n]`."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.calls: list[str] = []
        self.started = [threading.Event() for _ in range(4)]
        self.release = [threading.Event() for _ in range(4)]
        self.failing: set[int] = set()  # forward_backward numbers that raise
        self._passes = 0

    def _note(self, call: str) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(call)

    def add_adapter(self, name: str, spec: LoraSpec, optimizer: str) -> None:
        self._note("add_adapter")

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> str:
        n = self._passes
        self._passes += 1
        self._note(f"forward_backward {n}")
        self.started[n].set()
        assert self.release[n].wait(10), "a test never released its gate"
        if n in self.failing:
            raise ValueError(f"pass {n} failed")
        return f"pass {n}"

    def forward_backward_then_step(self, name: str, batches: list, params: Any) -> tuple[list[str], Any]:
        raise AssertionError("each run here is one op")

    def optim_step(self, name: str, params: Any) -> str:
        self._note("optim_step")
        return "stepped"

    def park(self) -> None:
        self._note("park")

    def close(self) -> None:
        self._note("close")


class Trainer:
    def __init__(self, nursery: trio.Nursery, engine: GatedEngine) -> None:
        self.engine = engine
        self.futures = FutureTable(MemoryLog())
        self.actor = TrainerActor(
            name="t", build_engine=self._build, limiter=trio.CapacityLimiter(1), futures=self.futures,
            checkpoints=None, sampler=None,  # type: ignore[arg-type]  # no op here saves
        )
        self._nursery = nursery
        self._seq = 0

    def _build(self) -> GatedEngine:
        self.engine.threads.add(threading.get_ident())
        return self.engine

    async def start(self) -> None:
        self.handle = await self._nursery.start(self.actor.run)
        self.handle.open_job("m")

    def submit(self, make: Any) -> str:
        """Submit `make(request_id, seq_id)`; its request id."""
        request_id, seq = f"r{self._seq}", self._seq
        self._seq += 1
        self.futures.create(request_id, model_id="m", kind="op", owner="u")
        self.handle.submit_nowait(make(request_id, seq))
        return request_id

    async def outcome(self, request_id: str) -> Any:
        done = await self.futures.wait(request_id, owner="u", hold_s=10)
        return done.value if isinstance(done, Completed) else done

    def step(self) -> str:
        return self.submit(lambda r, s: ForwardBackward("m", s, r, BATCH))


async def _wait_for(event: threading.Event) -> None:
    with trio.fail_after(10):
        while not event.is_set():
            await trio.sleep(0.005)


async def test_the_next_step_starts_while_the_event_loop_is_held():
    async with trio.open_nursery() as nursery:
        trainer = Trainer(nursery, GatedEngine())
        await trainer.start()
        await trainer.outcome(trainer.submit(lambda r, s: CreateAdapter("m", r, LoraSpec(rank=2), seq_id=s)))
        first = trainer.step()
        await _wait_for(trainer.engine.started[0])
        second = trainer.step()  # arrives while the first runs: queued behind it on the engine thread
        await trio.testing.wait_all_tasks_blocked()
        trainer.engine.release[0].set()
        # The event loop is held here (a blocking wait in its only thread), so nothing can settle
        # the first pass or hand the engine the second: the engine thread goes on by itself.
        assert trainer.engine.started[1].wait(5)
        trainer.engine.release[1].set()
        assert [await trainer.outcome(first), await trainer.outcome(second)] == ["pass 0", "pass 1"]
        nursery.cancel_scope.cancel()


async def test_every_engine_call_runs_on_one_thread():
    engine = GatedEngine()
    engine.release[0].set()
    async with trio.open_nursery() as nursery:
        trainer = Trainer(nursery, engine)
        await trainer.start()
        await trainer.outcome(trainer.submit(lambda r, s: CreateAdapter("m", r, LoraSpec(rank=2), seq_id=s)))
        await trainer.outcome(trainer.step())
        await trainer.outcome(trainer.submit(lambda r, s: OptimStep("m", s, r, AdamParams())))
        nursery.cancel_scope.cancel()
    assert engine.calls == ["add_adapter", "forward_backward 0", "optim_step", "close"]
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


async def test_a_failed_pass_fails_its_own_request_and_the_one_queued_behind_it_still_runs():
    engine = GatedEngine()
    engine.failing = {0}
    async with trio.open_nursery() as nursery:
        trainer = Trainer(nursery, engine)
        await trainer.start()
        await trainer.outcome(trainer.submit(lambda r, s: CreateAdapter("m", r, LoraSpec(rank=2), seq_id=s)))
        first = trainer.step()
        await _wait_for(engine.started[0])
        second = trainer.step()
        await trio.testing.wait_all_tasks_blocked()
        engine.release[0].set()
        engine.release[1].set()
        failed, passed = await trainer.outcome(first), await trainer.outcome(second)
        nursery.cancel_scope.cancel()
    assert failed == Failed(detail="ValueError: pass 0 failed", category="server")
    assert passed == "pass 1"


async def test_an_engine_thread_runs_calls_in_the_order_queued_and_raises_a_calls_error():
    thread = EngineThread("test")
    order: list[int] = []
    first = thread.submit(order.append, 1)
    failing = thread.submit(int, "not a number")
    last = thread.submit(order.append, 2)
    assert await first.wait() is None
    with pytest.raises(ValueError, match="invalid literal"):
        await failing.wait()
    assert await last.wait() is None
    assert order == [1, 2]
    thread.stop()


async def test_waiting_on_an_engine_call_outlasts_a_cancel_until_the_call_returns():
    thread = EngineThread("test")
    release = threading.Event()
    pending = thread.submit(release.wait, 10)
    with trio.move_on_after(0.05) as scope:
        scope.cancel()
        trio.lowlevel.current_trio_token().run_sync_soon(release.set)
        assert await pending.wait() is True
    assert pending.done
    thread.stop()
