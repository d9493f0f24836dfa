"""The trainer actor's auto-saves (issue 41): which steps are due, where the state is taken, which land.

The engine is a stand-in that records its calls, copies its state for `snapshot_state` (or
declines, and writes a file for `save_state`); the node's side (`AutosaveStore`) is a stand-in
that records commits. tests/e2e/test_autosave.py
drives the real engine and the real files under the real SDK.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from openrld.actors.autosaves import AutosaveSlots, _Write
from openrld.actors.futures import Completed, FutureTable
from openrld.actors.trainer import CreateAdapter, ForwardBackward, OptimStep, SaveState, TrainerActor
from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec
from openrld.engine_types import SnapshotFile, StateSnapshot
from openrld.errors import Conflict
from tests.actors.test_sampler_replicas import MemoryLog
from tests.waits import wait_until

BATCH = ForwardBackwardBatch(data=[], loss_fn="cross_entropy", loss_config={}, forward_only=False)


class RecordingEngine:
    def __init__(self, failing_steps: set[int] = frozenset(), *, copies_state: bool = True) -> None:
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self._failing = failing_steps  # optim_step calls (0-based) that raise
        self._optim_calls = 0
        self._copies_state = copies_state  # False: snapshot_state declines, as a full fine-tuning trainer's

    def add_adapter(self, name: str, spec: LoraSpec, optimizer: str) -> None:
        self.calls.append("add_adapter")

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> str:
        self.calls.append("forward_backward")
        return "pass"

    def optim_step(self, name: str, params: Any) -> str:
        n, self._optim_calls = self._optim_calls, self._optim_calls + 1
        self.calls.append("optim_step")
        if n in self._failing:
            raise ValueError(f"optim_step {n} failed")
        return "stepped"

    def snapshot_state(self, name: str, with_optimizer: bool) -> StateSnapshot | None:
        self.threads.add(threading.get_ident())
        self.calls.append("snapshot_state")
        return StateSnapshot([SnapshotFile("state.json", str(self._optim_calls).encode())]) if self._copies_state else None

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int:
        self.threads.add(threading.get_ident())
        self.calls.append("save_state")
        (directory / "state.json").write_text(str(self._optim_calls))
        return 1

    def close(self) -> None:
        self.calls.append("close")


class RecordingStore:
    """The node's side of auto-saves: staging dirs under `tmp`, and the commits and discards made."""

    def __init__(self, tmp: Path, interval: int) -> None:
        self._tmp = tmp
        self._interval = interval
        self._made = 0
        self.committed: list[tuple[int, int]] = []  # (step, seq_id)
        self.discarded: list[str] = []  # what the discarded write held: the engine's optim_step count

    def interval(self, model_id: str) -> int:
        return self._interval

    def staging(self) -> Path:
        self._made += 1
        directory = self._tmp / f"staging-{self._made}"
        directory.mkdir()
        return directory

    def describe(self, model_id: str, *, step: int, seq_id: int, sampler_paths: list[str], sampling_sessions: list[str]):
        return SimpleNamespace(model_id=model_id, step=step, seq_id=seq_id)

    async def commit(self, state: StateSnapshot | Path, manifest: Any) -> Path:
        self.committed.append((manifest.step, manifest.seq_id))
        return self._tmp

    async def discard(self, state: StateSnapshot | Path) -> None:
        copied = isinstance(state, StateSnapshot)
        self.discarded.append(state.files[0].head.decode() if copied else (state / "state.json").read_text())


async def _train(tmp_path: Path, engine: RecordingEngine, interval: int, steps: int) -> RecordingStore:
    """`steps` SFT steps (forward_backward, optim_step: seq_ids 2k+1, 2k+2), each awaited, and every commit."""
    store = RecordingStore(tmp_path, interval)
    futures = FutureTable(MemoryLog())
    actor = TrainerActor(
        name="t", build_engine=lambda: engine, limiter=trio.CapacityLimiter(1), futures=futures,
        checkpoints=None, sampler=None, max_combined_tokens=0, autosaves=store,  # type: ignore[arg-type]
    )
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(actor.run)
        handle.open_job("m")

        async def op(make: Any, seq: int) -> Any:
            request_id = f"r{seq}"
            futures.create(request_id, model_id="m", kind="op", owner="u")
            handle.submit_nowait(make(request_id, seq))
            done = await futures.wait(request_id, owner="u", hold_s=10)
            return done.value if isinstance(done, Completed) else done

        await op(lambda r, s: CreateAdapter("m", r, LoraSpec(rank=2), seq_id=s), 0)
        for k in range(steps):
            await op(lambda r, s: ForwardBackward("m", s, r, BATCH), 2 * k + 1)
            await op(lambda r, s: OptimStep("m", s, r, AdamParams()), 2 * k + 2)
        # Every due state ends committed or discarded; the last one's snapshot_state may still be queued
        # behind its step when that step's future resolves, so count the due states, not the calls made.
        due = steps // interval if interval else 0
        await wait_until(lambda: len(store.committed) + len(store.discarded) == due, within_s=10)
        nursery.cancel_scope.cancel()
    return store


async def test_a_lora_job_is_saved_after_every_step_with_the_steps_seq_id(tmp_path: Path):
    engine = RecordingEngine()
    store = await _train(tmp_path, engine, interval=1, steps=3)
    assert store.committed == [(1, 2), (2, 4), (3, 6)]


async def test_the_state_is_copied_on_the_engine_thread_right_behind_its_step(tmp_path: Path):
    engine = RecordingEngine()
    await _train(tmp_path, engine, interval=1, steps=2)
    assert engine.calls == [
        "add_adapter", "forward_backward", "optim_step", "snapshot_state", "forward_backward", "optim_step",
        "snapshot_state", "close",
    ]
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads


async def test_an_engine_that_does_not_copy_its_state_writes_it_with_save_state_behind_its_step(tmp_path: Path):
    engine = RecordingEngine(copies_state=False)
    store = await _train(tmp_path, engine, interval=1, steps=2)
    assert engine.calls == [
        "add_adapter", "forward_backward", "optim_step", "snapshot_state", "save_state", "forward_backward",
        "optim_step", "snapshot_state", "save_state", "close",
    ]
    assert store.committed == [(1, 2), (2, 4)]


async def test_an_interval_of_2_saves_at_steps_2_and_4(tmp_path: Path):
    engine = RecordingEngine()
    store = await _train(tmp_path, engine, interval=2, steps=5)
    assert store.committed == [(2, 4), (4, 8)]
    assert engine.calls.count("snapshot_state") == 2


async def test_an_interval_of_0_saves_nothing(tmp_path: Path):
    engine = RecordingEngine()
    store = await _train(tmp_path, engine, interval=0, steps=2)
    assert (store.committed, engine.calls.count("snapshot_state")) == ([], 0)


async def test_a_failed_step_is_not_saved_and_the_next_is_named_for_the_steps_taken(tmp_path: Path):
    engine = RecordingEngine(failing_steps={1})  # the second optim_step (seq_id 4) fails
    store = await _train(tmp_path, engine, interval=1, steps=3)
    # The state taken behind the failed step was the first step's; the third optim_step is the job's second.
    assert (store.committed, store.discarded) == ([(1, 2), (2, 6)], ["2"])


def _write(model_id: str, step: int) -> _Write:
    return _Write(Path(f"/staging/{model_id}-{step}"), SimpleNamespace(model_id=model_id, step=step))  # type: ignore[arg-type]


@pytest.mark.parametrize("other_job_first", [False, True], ids=["alone", "beside-another-job"])
def test_a_newer_write_replaces_the_one_waiting_for_its_jobs_commit(other_job_first: bool):
    slots = AutosaveSlots()
    if other_job_first:
        assert slots.offer(_write("n", 1)) == (_write("n", 1), None)
    assert slots.offer(_write("m", 1)) == (_write("m", 1), None)  # committed at once
    assert slots.offer(_write("m", 2)) == (None, None)  # waits for step 1's commit
    assert slots.offer(_write("m", 3)) == (None, _write("m", 2))  # replaces step 2, which is dropped
    assert slots.done("m") == _write("m", 3)
    assert slots.done("m") is None
    assert slots.offer(_write("m", 4)) == (_write("m", 4), None)  # the job was idle again


class RecordingCheckpoints:
    """The node's checkpoints as a save sees them: the names held, refusing one that exists without overwrite."""

    def __init__(self, tmp: Path, held: set[str]) -> None:
        self._tmp = tmp
        self.held = set(held)
        self.overwrites: list[tuple[str, bool]] = []

    async def prepare(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[Path, Path]:
        if name in self.held and not overwrite:
            raise Conflict(f"checkpoint tinker://{model_id}/{kind}/{name} already exists; pass overwrite=True")
        self.overwrites.append((name, overwrite))
        staging = self._tmp / f"staging-{len(self.overwrites)}"
        staging.mkdir()
        return staging, self._tmp / name

    def describe(self, model_id: str, kind: str, name: str, **_: Any) -> Any:
        return SimpleNamespace(name=name)

    async def commit(self, staging: Path, final: Path, overwrite: bool, manifest: Any) -> None:
        self.held.add(manifest.name)

    async def record(self, manifest: Any) -> str:
        return f"tinker://m/weights/{manifest.name}"


async def _saves(
    tmp_path: Path, held: set[str], rewritten: set[tuple[str, str]], names: list[str]
) -> tuple[list[Any], RecordingCheckpoints]:
    """Named save_states of job "m", opened with `rewritten`, one after the other: each one's outcome."""
    checkpoints = RecordingCheckpoints(tmp_path, held)
    futures = FutureTable(MemoryLog())
    actor = TrainerActor(
        name="t", build_engine=lambda: RecordingEngine(), limiter=trio.CapacityLimiter(1), futures=futures,
        checkpoints=checkpoints, sampler=None, max_combined_tokens=0,  # type: ignore[arg-type]
    )
    outcomes = []
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(actor.run)
        handle.open_job("m", next_seq=7, rewritten=rewritten)
        for seq, name in enumerate(names, start=7):
            futures.create(f"r{seq}", model_id="m", kind="op", owner="u")
            handle.submit_nowait(SaveState("m", seq, f"r{seq}", "weights", name))
            done = await futures.wait(f"r{seq}", owner="u", hold_s=10)
            outcomes.append(done.value.path if isinstance(done, Completed) else done.detail)
        nursery.cancel_scope.cancel()
    return outcomes, checkpoints


async def test_an_adopted_jobs_replayed_save_writes_again_a_checkpoint_its_dead_home_wrote_past_the_auto_save(tmp_path: Path):
    outcomes, checkpoints = await _saves(tmp_path, {"step-8"}, {("weights", "step-8")}, ["step-8"])
    assert (outcomes, checkpoints.overwrites) == (["tinker://m/weights/step-8"], [("step-8", True)])


async def test_a_checkpoint_written_before_the_auto_save_is_still_refused_without_overwrite(tmp_path: Path):
    outcomes, _ = await _saves(tmp_path, {"step-2", "step-8"}, {("weights", "step-8")}, ["step-2"])
    assert outcomes == ["checkpoint tinker://m/weights/step-2 already exists; pass overwrite=True"]


async def test_a_rewritten_checkpoint_is_written_again_once_and_a_later_save_of_its_name_is_refused(tmp_path: Path):
    outcomes, _ = await _saves(tmp_path, {"step-8"}, {("weights", "step-8")}, ["step-8", "step-8"])
    assert outcomes == ["tinker://m/weights/step-8", "checkpoint tinker://m/weights/step-8 already exists; pass overwrite=True"]
