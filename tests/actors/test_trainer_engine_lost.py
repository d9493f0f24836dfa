"""The trainer actor when its engine is lost (a trainer process that died): it builds another,
the jobs the dead one held fail until they load a state, and other jobs train on.

The engine is a stand-in (the edge: a process killed by the kernel); tests/e2e/test_process_workers.py
kills a real trainer process under the real SDK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from openrld.actors.futures import Completed, Failed, FutureTable
from openrld.actors.trainer import CreateAdapter, ForwardBackward, LoadState, OptimStep, TrainerActor
from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec
from openrld.errors import EngineLost
from tests.actors.test_sampler_replicas import MemoryLog
from tests.waits import wait_until

SPEC = LoraSpec(rank=2)
BATCH = ForwardBackwardBatch(data=[], loss_fn="cross_entropy", loss_config={}, forward_only=False)
DIED = "trainer process t died (exit status -9); the weights and optimizer state it held are gone"


class StandInEngine:
    """Adapters by name; `dies` makes its next engine call raise EngineLost, as a killed process's would."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.adapters: set[str] = set()
        self.dies = False
        self.closed = False
        self.calls: list[str] = []
        self.gate: threading.Event | None = None  # set: add_adapter holds the engine until it opens

    def _call(self, method: str) -> None:
        self.calls.append(method)
        if self.dies:
            raise EngineLost(DIED)

    def add_adapter(self, name: str, spec: LoraSpec, optimizer: str) -> None:
        self._call("add_adapter")
        self.adapters.add(name)
        if self.gate is not None:
            self.gate.wait(10)

    def load_state(self, name: str, directory: Any, spec: LoraSpec, with_optimizer: bool, optimizer: str) -> None:
        self._call("load_state")
        self.adapters.add(name)

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> str:
        self._call("forward_backward")
        return f"engine {self.number} stepped {name}"

    def forward_backward_then_step(self, name: str, batches: list, params: Any) -> tuple[list[str], Any]:
        self._call("forward_backward_then_step")
        return [f"engine {self.number} stepped {name}"] * len(batches), None

    def optim_step(self, name: str, params: Any) -> str:
        self._call("optim_step")
        return f"engine {self.number} optimised {name}"

    def close(self) -> None:
        self.closed = True


class Trainer:
    """A TrainerActor on stand-in engines, its futures, and one helper per op."""

    def __init__(self, nursery: trio.Nursery, on_engine_lost: Callable[[EngineLost], None] | None = None) -> None:
        self.engines: list[StandInEngine] = []
        self.futures = FutureTable(MemoryLog())
        self.actor = TrainerActor(
            name="t", build_engine=self._build, limiter=trio.CapacityLimiter(1), futures=self.futures,
            checkpoints=None, sampler=None,  # type: ignore[arg-type]  # no op here saves
            on_engine_lost=on_engine_lost,
        )
        self._nursery = nursery
        self._count = 0
        self.failing_builds = 0  # the next builds that raise
        self._seq: dict[str, int] = {}

    def _build(self) -> StandInEngine:
        if self.failing_builds:
            self.failing_builds -= 1
            raise OSError("out of memory")
        self.engines.append(StandInEngine(len(self.engines) + 1))
        return self.engines[-1]

    async def start(self) -> None:
        self.handle = await self._nursery.start(self.actor.run)

    async def submit(self, model_id: str, make: Any) -> Any:
        """Submit the op `make(request_id, seq_id)` for `model_id`; its outcome."""
        self._count += 1
        request_id = f"r{self._count}"
        seq = self._seq.get(model_id)
        if seq is None:
            self.handle.open_job(model_id)
            seq = 0
        self._seq[model_id] = seq + 1
        self.futures.create(request_id, model_id=model_id, kind="op", owner="u")
        self.handle.submit_nowait(make(request_id, seq))
        outcome = await self.futures.wait(request_id, owner="u", hold_s=10)
        return outcome.value if isinstance(outcome, Completed) else outcome

    async def create(self, model_id: str) -> Any:
        return await self.submit(model_id, lambda r, s: CreateAdapter(model_id, r, SPEC, seq_id=s))

    async def step(self, model_id: str) -> Any:
        return await self.submit(model_id, lambda r, s: ForwardBackward(model_id, s, r, BATCH))

    async def optim(self, model_id: str) -> Any:
        return await self.submit(model_id, lambda r, s: OptimStep(model_id, s, r, AdamParams()))

    async def load(self, model_id: str) -> Any:
        return await self.submit(
            model_id, lambda r, s: LoadState(model_id, r, "/state", "tinker://state", SPEC, True, seq_id=s)
        )


async def lose_engine(trainer: Trainer, *jobs: str) -> Any:
    """Create `jobs` (default "a") on the first engine, kill it, and let the first job's step
    meet it; that step's outcome."""
    jobs = jobs or ("a",)
    for job in jobs:
        await trainer.create(job)
    trainer.engines[0].dies = True
    return await trainer.step(jobs[0])


def with_trainer(body: Any, on_engine_lost: Callable[[EngineLost], None] | None = None) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                trainer = Trainer(nursery, on_engine_lost)
                await trainer.start()
                await body(trainer)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_op_that_meets_the_dead_engine_fails_with_its_error():
    async def body(trainer: Trainer) -> None:
        assert await lose_engine(trainer) == Failed(detail=DIED, category="server")

    with_trainer(body)


def test_a_new_engine_replaces_the_dead_one_and_the_old_one_is_closed():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer)
        await trainer.create("b")  # runs after the replacement
        assert [e.number for e in trainer.engines] == [1, 2]
        assert trainer.engines[0].closed is True
        assert trainer.engines[1].closed is False

    with_trainer(body)


def test_the_lost_jobs_later_ops_fail_with_the_same_detail():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer)
        assert await trainer.optim("a") == Failed(detail=DIED, category="server")
        assert await trainer.step("a") == Failed(detail=DIED, category="server")
        assert len(trainer.engines) == 2

    with_trainer(body)


def test_a_trainer_of_one_jobs_own_group_is_not_rebuilt_its_engine_is_closed_and_the_loss_reported():
    reported: list[str] = []

    async def body(trainer: Trainer) -> None:
        assert await lose_engine(trainer) == Failed(detail=DIED, category="server")
        await wait_until(lambda: bool(reported), within_s=10)  # the op fails first, then the engine is closed
        assert ([e.number for e in trainer.engines], trainer.engines[0].closed, reported) == ([1], True, [DIED])

    with_trainer(body, on_engine_lost=lambda error: reported.append(error.detail))


def test_a_job_created_after_the_loss_trains_on_the_new_engine():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer)
        await trainer.create("b")
        assert await trainer.step("b") == "engine 2 stepped b"

    with_trainer(body)


def test_a_lost_job_that_loads_a_state_trains_again():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer)
        await trainer.load("a")
        assert await trainer.step("a") == "engine 2 stepped a"

    with_trainer(body)


def test_every_job_the_dead_engine_held_is_lost():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer, "a", "b")
        assert await trainer.step("b") == Failed(detail=DIED, category="server")

    with_trainer(body)


async def step_and_optim_queued_together(
    trainer: Trainer, model_id: str, before_release: Callable[[], None] = lambda: None
) -> list[Any]:
    """A forward_backward and an optim_step submitted while the engine is busy with another job's
    op, so that both are queued when the actor next takes work, as a pipelining client's are (they
    then run as one engine call); `before_release` runs just before the engine is free. Their outcomes."""
    engine = trainer.engines[-1]
    engine.gate = threading.Event()
    outcomes: list[Any] = [None, None]

    async def record(index: int, call: Any) -> None:
        outcomes[index] = await call(model_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer.create, "busy")
        await trio.sleep(0.05)  # the engine holds "busy"'s op
        nursery.start_soon(record, 0, trainer.step)
        await trio.lowlevel.checkpoint()  # the step takes its seq_id first
        nursery.start_soon(record, 1, trainer.optim)
        await trio.sleep(0.05)  # both are queued behind it
        before_release()
        engine.gate.set()
    return outcomes


def test_a_pass_and_step_that_meet_the_dead_engine_both_fail():
    async def body(trainer: Trainer) -> None:
        await trainer.create("a")
        first = trainer.engines[0]
        outcomes = await step_and_optim_queued_together(trainer, "a", lambda: setattr(first, "dies", True))
        failed = Failed(detail=DIED, category="server")
        assert outcomes == [failed, failed]
        assert first.calls == ["add_adapter", "add_adapter", "forward_backward_then_step"]

    with_trainer(body)


def test_a_lost_jobs_pipelined_pass_and_step_both_fail():
    async def body(trainer: Trainer) -> None:
        await lose_engine(trainer)
        failed = Failed(detail=DIED, category="server")
        assert await step_and_optim_queued_together(trainer, "a") == [failed, failed]

    with_trainer(body)


def test_a_failed_rebuild_fails_the_next_op_which_tries_again():
    async def body(trainer: Trainer) -> None:
        trainer.failing_builds = 1
        await lose_engine(trainer)
        unbuilt = "the trainer of t could not be rebuilt after its engine was lost"
        assert await trainer.create("b") == Failed(detail=unbuilt, category="server")
        await trainer.create("c")
        assert await trainer.step("c") == "engine 2 stepped c"

    with_trainer(body)
