"""Auto-saves of a trainer's jobs on a shared checkpoint root: when they are due, and their commits.

The trainer actor asks `AutosaveStore.interval` when a job opens (the job's
`openrl.autosave_steps`; for LoRA every optim_step unless the job says
otherwise; nothing without a shared root), and, after an optim_step that is
due, queues `take_state` on its engine thread right behind the step: the
engine copies the job's state to host memory there (`snapshot_state`), before
any later op can change it, and the next op runs at once. Writing that copy
into staging, fsyncing it, naming the auto-save, renaming it into place and
pruning the older ones (openrld/autosave.py) happen off the engine thread, in
this module's `Autosaver`, one per trainer, in the trainer's nursery. An engine
that does not copy its state (full fine-tuning: the whole model) writes it with
its own `save_state` into staging on the engine thread instead, as before.

Commits of one job run one at a time, in step order. A state that lands while
its job's last one still commits waits; a newer one replaces it (its staging,
or its copy, is dropped): what matters is the newest state, and no job holds
more than one complete auto-save, one being committed and one waiting.

The auto-saves of jobs that have ended (their session finished) are removed
by the node's maintenance sweep (`AutosaveStore.prune_ended`).

It never imports torch and never decides what a step is; the trainer does.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec
import trio

from openrld import autosave, settings as job_settings
from openrld.engine_types import StateSnapshot, TrainerEngine
from openrld.errors import OpenrldError
from openrld.ids import CheckpointKind
from openrld.store import Store

logger = logging.getLogger(__name__)

# Writes, commits and discards at once across a node's trainers: each writes a state copied to host
# memory (a LoRA job's: megabytes), then renames, fsyncs and removes the one before.
AUTOSAVE_THREADS = 2

# A step's state, taken on the engine thread: a copy in host memory, or a staging dir `save_state` wrote.
TakenState = StateSnapshot | Path


class AutosaveStore:
    """The node's side of auto-saves: the shared root, the runs' rows, and threads for the files.

    One per daemon (`CheckpointWriter.autosaves`), None without a shared root.
    """

    def __init__(self, store: Store) -> None:
        assert store.files.is_shared, "auto-saves are written only to a shared checkpoint root"
        self._files = store.files
        self._runs = store.runs
        self._sessions = store.sessions
        self._adoption = store.adoption
        self._threads = trio.CapacityLimiter(AUTOSAVE_THREADS)

    def interval(self, model_id: str) -> int:
        """Steps between the job's auto-saves; 0: none. From its run's settings (event loop)."""
        run = self._runs.get(model_id)
        return 0 if run is None else job_settings.settings_from_dict(run.settings).autosave_interval

    def staging(self) -> Path:
        """A fresh staging directory on the root's filesystem; on the engine thread, before `save_state`
        (for an engine that does not copy its state)."""
        return self._files.staging_dir()

    def describe(
        self, model_id: str, *, step: int, seq_id: int, sampler_paths: list[str], sampling_sessions: list[str]
    ) -> autosave.AutosaveManifest:
        """The auto-save's manifest, from the run's row (event loop); its files are listed at commit."""
        run = self._adoption.manifest_for(
            model_id, CheckpointKind.WEIGHTS, autosave.step_dir_name(step), size_bytes=None, user_metadata={},
            expires_at=None,
        )
        return autosave.AutosaveManifest(
            format=autosave.AUTOSAVE_FORMAT, model_id=model_id, step=step, seq_id=seq_id, run=run,
            sampler_paths=sampler_paths[-autosave.MAX_SAMPLER_NAMES :],
            sampling_sessions=sampling_sessions[-autosave.MAX_SAMPLER_NAMES :], created_at=run.created_at,
        )

    async def commit(self, state: TakenState, manifest: autosave.AutosaveManifest) -> Path:
        """Write a copied state into staging and commit it (`autosave.commit_snapshot`), or commit a
        staging dir (`autosave.commit_autosave`), in a thread; a staging dir is removed if it fails."""
        if isinstance(state, StateSnapshot):
            return await trio.to_thread.run_sync(
                autosave.commit_snapshot, self._files, state, manifest, limiter=self._threads
            )
        try:
            return await trio.to_thread.run_sync(
                autosave.commit_autosave, self._files, state, manifest, limiter=self._threads
            )
        except BaseException:
            await self.discard(state)
            raise

    async def discard(self, state: TakenState) -> None:
        """Drop a state that will not become an auto-save: a staging dir is removed."""
        if isinstance(state, StateSnapshot):
            return  # host memory, freed with the last reference
        with trio.CancelScope(shield=True):  # else it stays until the next open empties staging
            await trio.to_thread.run_sync(partial(shutil.rmtree, state, ignore_errors=True), limiter=self._threads)


    async def prune_ended(self) -> list[str]:
        """Remove every auto-save of the jobs that have ended: those whose run this node holds and whose
        session it has seen finish (the client closed it; a job on a shared LoRA group stays resident,
        but no client of it is left). Another node's jobs are left to that node. Returns their model ids."""
        listed = await trio.to_thread.run_sync(autosave.job_ids, self._files.root, limiter=self._threads)
        removed = []
        for model_id in listed:
            if not self._has_ended(model_id):
                continue
            try:
                if await trio.to_thread.run_sync(autosave.remove_job, self._files, model_id, limiter=self._threads):
                    removed.append(model_id)
                    logger.info("auto-saves removed model_id=%s: its session has finished", model_id)
            except (OSError, OpenrldError) as error:  # the next sweep tries again
                logger.warning("auto-saves not removed model_id=%s: %s", model_id, error)
        return removed

    def _has_ended(self, model_id: str) -> bool:
        run = self._runs.get(model_id)
        if run is None:  # another node's job (or not a job's directory): not this node's to judge
            return False
        session = self._sessions.get(run.session_id)
        return session is not None and session.is_finished


def take_state(engine: TrainerEngine, model_id: str, make_staging: Callable[[], Path]) -> TakenState:
    """On the engine thread, right behind the optim_step: the job's state with its optimizer, copied
    to host memory (`snapshot_state`), or, from an engine that does not copy it, written by its
    `save_state` into a fresh staging directory (`make_staging`), which is returned."""
    snapshot = engine.snapshot_state(model_id, True)
    if snapshot is not None:
        return snapshot
    staging = make_staging()
    try:
        engine.save_state(model_id, staging, True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


class _Write(msgspec.Struct, frozen=True):
    state: TakenState
    manifest: autosave.AutosaveManifest


class AutosaveSlots:
    """Per job: the write being committed and the newest one waiting. Pure: no I/O, no trio."""

    def __init__(self) -> None:
        self._committing: set[str] = set()
        self._waiting: dict[str, _Write] = {}

    def offer(self, write: _Write) -> tuple[_Write | None, _Write | None]:
        """(the write to commit now, the waiting write it replaced); at most one is not None."""
        model_id = write.manifest.model_id
        if model_id not in self._committing:
            self._committing.add(model_id)
            return write, None
        replaced = self._waiting.pop(model_id, None)
        self._waiting[model_id] = write
        return None, replaced

    def done(self, model_id: str) -> _Write | None:
        """The job's commit ended: its waiting write, to commit next, or None (the job is idle)."""
        following = self._waiting.pop(model_id, None)
        if following is None:
            self._committing.discard(model_id)
        return following


class AutosaverStatistics(msgspec.Struct, frozen=True):
    committed: int  # auto-saves renamed into place
    replaced: int  # writes dropped because a newer one of their job came before their commit
    failed: int  # writes or commits that raised (logged)
    last_steps: dict[str, int]  # model_id -> the step of its newest committed auto-save


class Autosaver:
    """One trainer's commits of its jobs' auto-saves, in tasks of its own nursery (`run`)."""

    def __init__(self, store: AutosaveStore) -> None:
        self.store = store
        self._slots = AutosaveSlots()
        self._nursery: trio.Nursery | None = None
        self._committed = self._replaced = self._failed = 0
        self._last_steps: dict[str, int] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def written(self, state: TakenState, manifest: autosave.AutosaveManifest) -> None:
        """The engine took a step's state (`take_state`): write and commit it (now, or after its job's last one)."""
        start, replaced = self._slots.offer(_Write(state, manifest))
        if replaced is not None:
            self._replaced += 1
            self._spawn(self.store.discard, replaced.state)
        if start is not None:
            self._spawn(self._commits, start)

    def discard(self, state: TakenState) -> None:
        """A state whose step failed: it is the previous step's, already saved."""
        self._spawn(self.store.discard, state)

    def failed(self, model_id: str, error: BaseException) -> None:
        self._failed += 1
        logger.warning("auto-save not written model_id=%s: %s", model_id, error)

    def _spawn(self, fn, *args) -> None:
        assert self._nursery is not None, "started in the trainer's nursery before any op runs"
        self._nursery.start_soon(fn, *args)

    async def _commits(self, write: _Write | None) -> None:
        while write is not None:
            model_id = write.manifest.model_id
            try:
                # Shielded: a trainer that stops mid-commit finishes it, rather than leave staging behind.
                with trio.CancelScope(shield=True):
                    await self.store.commit(write.state, write.manifest)
            except Exception:
                self._failed += 1
                logger.exception("auto-save commit failed model_id=%s step=%d", model_id, write.manifest.step)
            else:
                self._committed += 1
                self._last_steps[model_id] = write.manifest.step
            write = self._slots.done(model_id)

    def statistics(self) -> AutosaverStatistics:
        return AutosaverStatistics(
            committed=self._committed, replaced=self._replaced, failed=self._failed, last_steps=dict(self._last_steps)
        )
