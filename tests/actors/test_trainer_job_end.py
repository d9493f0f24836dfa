"""The trainer actor ending one job of a group that serves on (`TrainerHandle.end_job`): its queued
ops fail at once, and its adapter leaves the engine in the actor's order, after its running op.

The engine is tests/actors/test_trainer_pipeline.py's gated stand-in; tests/e2e/test_job_end.py
drives the real engine under the real SDK.
"""

from __future__ import annotations

import trio
import trio.testing

from openrld.actors.futures import Failed
from openrld.actors.trainer import CreateAdapter, Rejected
from openrld.batches import LoraSpec
from openrld.errors import Gone
from tests.actors.test_trainer_pipeline import GatedEngine, Trainer, _wait_for


class DroppingEngine(GatedEngine):
    def drop_adapter(self, name: str) -> None:
        self._note(f"drop_adapter {name}")


async def test_an_ended_jobs_adapter_is_dropped_after_its_running_op_and_its_queued_op_fails():
    engine = DroppingEngine()
    async with trio.open_nursery() as nursery:
        trainer = Trainer(nursery, engine)
        await trainer.start()
        await trainer.outcome(trainer.submit(lambda r, s: CreateAdapter("m", r, LoraSpec(rank=2), seq_id=s)))
        running = trainer.step()
        await _wait_for(engine.started[0])
        # Waits behind the running pass in the job's queue (a forward_backward would be queued on the
        # engine thread already, behind the pass: running, as far as the job's end is concerned).
        queued = trainer.submit(lambda r, s: Rejected("m", s, r, "never runs"))
        await trio.testing.wait_all_tasks_blocked()
        trainer.handle.end_job("m", Gone("model m has stopped: its session has finished"))
        assert await trainer.outcome(queued) == Failed(
            detail="model m has stopped: its session has finished", category="user"
        )
        await trio.testing.wait_all_tasks_blocked()
        assert "drop_adapter m" not in engine.calls  # the pass still runs on the engine thread
        assert trainer.handle.statistics().adapters_loaded == 1
        engine.release[0].set()
        assert await trainer.outcome(running) == "pass 0"
        # Another job's first op runs after the drop: the step loop takes drops first.
        trainer.handle.open_job("n")
        await trainer.outcome(trainer.submit(lambda r, s: CreateAdapter("n", r, LoraSpec(rank=2), seq_id=0)))
        assert trainer.handle.statistics().adapters_loaded == 1
        nursery.cancel_scope.cancel()
    assert engine.calls == ["add_adapter", "forward_backward 0", "drop_adapter m", "add_adapter", "close"]
