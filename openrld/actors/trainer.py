"""The trainer actor: one per LoRA group (one base model on one device).

It owns the group's training queues and its engine (a `TrainerEngine`, LoRA or
full fine-tuning, run in a worker thread under the device's capacity limiter).
Messages are the training ops below, each carrying its job's `model_id`, `seq_id`
and the request id whose future it resolves.

Ordering guarantees:
- one job's ops run strictly in `seq_id` order; an op whose predecessor has not
  arrived waits (the SDK sends the chunks of one call concurrently, the first
  one last), and nothing deadlocks on out-of-order arrival;
- jobs take fair turns: round-robin over the jobs whose next op is ready;
- a job's consecutive forward_backward ops that are all here (the chunks of one SDK
  call, or calls pipelined before an optim_step) run as one engine pass, up to
  `MAX_COMBINED_TOKENS`: fewer, fuller micro-batches, and the same result; an
  optim_step already here right after them runs in the same engine call.

Every engine call runs on the actor's one engine thread (actors/engine_thread.py).
forward_backward and optim_step runs are queued on it before the run ahead of them
is settled (`PIPELINE_DEPTH`), so a pipelining client's next step starts the moment
the last one ends, without a round trip through the event loop between them.

A failure inside an op fails that op's future and consumes its `seq_id`, so the
job's later ops still run. The actor never imports torch, nor anything of `gpu/`:
it knows its engine by the torch-free `engine_types.TrainerEngine`, and the weights
it hands the sampler are an opaque `WeightPayload`.

Device turns: each run of ops holds the device lease (actors/timeslicer.py; a
trainer over several devices holds all of theirs, actors/group_lease.py),
and so does building the engine (loading the weights onto the device): the
actor takes its lease first and builds in its first turn. The time-slicer
parks and resumes the engine through `park`/`resume` here, between runs, in
the actor's worker thread. When its group ends (`fail_pending`), every op it
still holds fails, and the lease is given back as the actor stops.

A lost engine (`EngineLost`: a trainer in a process of its own that died) is
replaced by a new one at once, so that the group trains on. The jobs whose
adapters it held are lost with it: their ops fail with that error until the job
loads a state (`load_state`) or the client creates a new model. A trainer that
serves one job's group of its own (`on_engine_lost` given) is not rebuilt: the
job is over, so the lost engine is closed (its processes stopped and reaped) and
the callback ends the group, which frees its devices.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import trio

from openrld.actors.autosaves import Autosaver, AutosaveStore, TakenState, take_state
from openrld.actors.engine_thread import EngineThread, Pending, on_cpu
from openrld.actors.futures import Completed, FutureTable
from openrld.actors.group_lease import GroupLease
from openrld.actors.host_memory import EngineMemory, HostMemory, park_within_budget
from openrld.actors.mailbox import Mailbox
from openrld.actors.timeslicer import DeviceLease, NoLease, Parkable, WorkerLeaseStatistics
from openrld.autosave import MAX_SAMPLER_NAMES
from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, SyncStats
from openrld.checkpoint_manifest import CheckpointManifest
from openrld.engine_types import TrainerEngine, WeightPayload
from openrld.errors import BadRequest, Conflict, EngineLost, OpenrldError, ServerError

logger = logging.getLogger(__name__)

MAILBOX_CAPACITY = 4096  # ops in flight per group; past it the API answers 429
# Model-input tokens that consecutive forward_backward ops of one job may share in one
# engine pass. It bounds how long one job holds its turn; the engine still splits the
# pass into micro-batches of its own token budget.
MAX_COMBINED_TOKENS = 65536
# Runs of engine ops queued on the engine thread at once: the one it runs and the next, so that
# the next is there when the engine is free, and a failure is settled before more pile up.
PIPELINE_DEPTH = 2

_T = TypeVar("_T")


# ---------------------------------------------------------------- messages


class CreateAdapter(msgspec.Struct, frozen=True):
    model_id: str
    request_id: str
    spec: LoraSpec | None  # None: full fine-tuning (no adapter)
    seq_id: int = 0
    optimizer: str = "adamw"  # the family, fixed for the job's life


class ForwardBackward(msgspec.Struct, frozen=True):
    model_id: str
    seq_id: int
    request_id: str
    batch: ForwardBackwardBatch


class OptimStep(msgspec.Struct, frozen=True):
    model_id: str
    seq_id: int
    request_id: str
    params: AdamParams | DimuonParams  # a family other than the job's fails in the engine, gradient kept


class SaveState(msgspec.Struct, frozen=True):
    """save_weights (state, with optimizer) or a named save_weights_for_sampler."""

    model_id: str
    seq_id: int
    request_id: str
    kind: str  # "weights", "sampler_weights" or "external_weights" (PEFT format, for use elsewhere)
    name: str
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] = {}
    base_model: str = ""  # named in an external checkpoint's adapter_config.json


class SaveForSampler(msgspec.Struct, frozen=True):
    """An unnamed save: the weights become a sampling session, in memory only.

    `inflight`: the weights are published as the model's new inflight target
    instead of a version of the session's own.
    """

    model_id: str
    seq_id: int
    request_id: str
    sampling_session_id: str
    inflight: bool = False


class LoadState(msgspec.Struct, frozen=True):
    model_id: str
    request_id: str
    source_dir: str
    source_uri: str
    spec: LoraSpec | None  # None: full fine-tuning
    with_optimizer: bool
    seq_id: int = 0
    optimizer: str = "adamw"  # the family the job has after the load
    optim_steps: int = 0  # the job's step count from here on: an adopted job keeps its own (cluster/adoption.py)


class Rejected(msgspec.Struct, frozen=True):
    """A request refused after its seq_id was known: it fails in its turn and frees the seq_id.

    Failing it at the door instead would leave a gap that every later op of the
    job waits behind forever (the SDK has already sent them).
    """

    model_id: str
    seq_id: int
    request_id: str
    detail: str


TrainOp = CreateAdapter | ForwardBackward | OptimStep | SaveState | SaveForSampler | LoadState | Rejected


# ---------------------------------------------------------------- results


class Created(msgspec.Struct, frozen=True):
    model_id: str


class Saved(msgspec.Struct, frozen=True):
    path: str | None = None
    sampling_session_id: str | None = None


class Loaded(msgspec.Struct, frozen=True):
    model_id: str
    path: str


# ---------------------------------------------------------------- state


class JobQueueStats(msgspec.Struct, frozen=True):
    model_id: str
    next_seq_id: int
    waiting: int


class TrainerStatistics(msgspec.Struct, frozen=True):
    jobs: list[JobQueueStats]
    ops_done: int
    ops_failed: int
    ops_combined: int  # ops that ran in a pass shared with the next ops of their job
    busy: bool
    device: str = ""  # the device the trainer runs on ("" when it has no device lease)
    lease: WorkerLeaseStatistics | None = None  # its turns on that device (time-slicer)
    progress: list[JobProgress] = []  # per job, for the model status API
    last_sync: SyncStats | None = None  # full fine-tuning: the trainer side of the last sync
    running_job: str | None = None  # the job whose ops run now, or wait for the device to run
    # Jobs whose state the engine holds now (LoRA: an adapter each, with its gradients and optimizer
    # state; full fine-tuning: the one job); a job's state leaves with `end_job`.
    adapters_loaded: int = 0
    memory: EngineMemory = EngineMemory()  # its host memory by part (actors/host_memory.py)


class JobProgress(msgspec.Struct, frozen=True):
    """One job's progress on this trainer, for the model status API."""

    model_id: str
    optim_steps: int  # optim_step ops that succeeded
    sampler_version: str | None  # the newest weights it published for sampling (a session id or a path)
    last_error: str | None  # the detail of its newest failed op


class _JobQueue:
    __slots__ = ("next_seq", "waiting")

    def __init__(self, next_seq: int) -> None:
        self.next_seq = next_seq
        self.waiting: dict[int, TrainOp] = {}


class TrainerQueues:
    """Per-job seq_id ordering and fair turns across jobs. Pure: no I/O, no trio."""

    def __init__(self) -> None:
        self._jobs: dict[str, _JobQueue] = {}
        self._turns: deque[str] = deque()

    def open_job(self, model_id: str, next_seq: int = 0) -> None:
        if model_id not in self._jobs:
            self._jobs[model_id] = _JobQueue(next_seq)
            self._turns.append(model_id)

    def close_job(self, model_id: str) -> list[TrainOp]:
        """Forget a job; return the ops that were still waiting, so their futures can fail."""
        job = self._jobs.pop(model_id, None)
        if model_id in self._turns:
            self._turns.remove(model_id)
        return list(job.waiting.values()) if job else []

    def push(self, op: TrainOp) -> None:
        job = self._jobs.get(op.model_id)
        if job is None:
            raise Conflict(f"model {op.model_id} is not open on this trainer")
        if op.seq_id < job.next_seq or op.seq_id in job.waiting:
            raise Conflict(f"model {op.model_id}: seq_id {op.seq_id} was already submitted")
        job.waiting[op.seq_id] = op

    def pop_ready(self, max_combined_tokens: int = 0, accept: Callable[[TrainOp], bool] | None = None) -> list[TrainOp]:
        """The next ops to run, all of one job, in seq_id order; empty when none is ready.

        It takes the first job in turn order whose next seq_id is here. When that op is a
        ForwardBackward, the job's following ops join it while they are here, are
        ForwardBackward with the same `forward_only`, and keep the model-input tokens of
        the run within `max_combined_tokens` (0: never combine). The engine runs such a
        run as one pass, which is what seq_id order would give anyway: nothing between
        them changes the weights. When combining, an OptimStep that is the job's next op
        ends the run (it runs after the pass, in seq_id order).

        With `accept`, the run is taken only when `accept` takes its first op; otherwise
        nothing is taken and that job keeps its turn.
        """
        for _ in range(len(self._turns)):
            model_id = self._turns[0]
            job = self._jobs[model_id]
            op = job.waiting.get(job.next_seq)
            if op is None:
                self._turns.rotate(-1)
                continue
            if accept is not None and not accept(op):
                return []
            self._turns.rotate(-1)
            del job.waiting[job.next_seq]
            job.next_seq += 1
            run = [op]
            if isinstance(op, ForwardBackward):
                tokens = _model_tokens(op)
                while True:
                    following = job.waiting.get(job.next_seq)
                    if not (
                        isinstance(following, ForwardBackward)
                        and following.batch.forward_only == op.batch.forward_only
                        and tokens + _model_tokens(following) <= max_combined_tokens
                    ):
                        break
                    tokens += _model_tokens(following)
                    run.append(job.waiting.pop(job.next_seq))
                    job.next_seq += 1
                if max_combined_tokens > 0 and isinstance(job.waiting.get(job.next_seq), OptimStep):
                    run.append(job.waiting.pop(job.next_seq))
                    job.next_seq += 1
            return run
        return []

    def has_ready(self) -> bool:
        """Whether some job's next op is here (pop_ready would answer something)."""
        return any(job.next_seq in job.waiting for job in self._jobs.values())

    def has_job(self, model_id: str) -> bool:
        return model_id in self._jobs

    def statistics(self) -> list[JobQueueStats]:
        return [
            JobQueueStats(model_id=m, next_seq_id=j.next_seq, waiting=len(j.waiting))
            for m, j in self._jobs.items()
        ]


def _model_tokens(op: ForwardBackward) -> int:
    return sum(len(datum.tokens) for datum in op.batch.data)


# ---------------------------------------------------------------- collaborators


class CheckpointSink(Protocol):
    """What the trainer needs of the store to publish a checkpoint atomically.

    `describe` and `record` touch the database and run on the event loop;
    `prepare` checks the row there and makes the staging dir in a thread;
    `commit` writes the manifest, fsyncs and renames, in a thread.
    `autosaves`: the node's auto-saves to a shared checkpoint root; None without one.
    """

    autosaves: AutosaveStore | None

    async def prepare(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[Path, Path]: ...
    def describe(
        self, model_id: str, kind: str, name: str, *, size_bytes: int, ttl_seconds: int | None,
        user_metadata: dict[str, str],
    ) -> CheckpointManifest: ...
    async def commit(self, staging: Path, final: Path, overwrite: bool, manifest: CheckpointManifest) -> None: ...
    async def record(self, manifest: CheckpointManifest) -> str: ...


class SamplerFeed(Protocol):
    """Where new sampler weights go: the group's sampler actor."""

    async def publish_version(self, version: str, tensors: WeightPayload, spec: LoraSpec | None) -> None: ...
    async def publish_inflight(self, model_id: str, sampler_id: str, tensors: WeightPayload, spec: LoraSpec) -> int: ...


# ---------------------------------------------------------------- handle


class TrainerHandle:
    """What other modules hold: submit ops, read statistics. No access to state."""

    def __init__(self, actor: TrainerActor) -> None:
        self._actor = actor

    def open_job(self, model_id: str, next_seq: int = 0, rewritten: Collection[tuple[str, str]] = ()) -> None:
        """`rewritten`: (kind, name) of checkpoints an adopted job's dead home wrote past the auto-save it
        resumes from; the replay of each save writes it again, as if with overwrite=True."""
        self._actor.queues.open_job(model_id, next_seq)
        if rewritten:
            self._actor.rewritten[model_id] = set(rewritten)

    def fail_pending(self, error: OpenrldError) -> None:
        """Fail every op the trainer still holds with `error` (its group ended)."""
        self._actor.fail_pending(error)

    def end_job(self, model_id: str, error: OpenrldError) -> None:
        """Job `model_id` ended while its group serves on: its queued ops fail with `error` now, and its
        adapter, gradients and optimizer state leave the engine in the actor's order, once any op of
        it already running is done. Never waits."""
        self._actor.end_job(model_id, error)

    def submit_nowait(self, op: TrainOp) -> None:
        self._actor.mailbox.post(op)

    def statistics(self) -> TrainerStatistics:
        return self._actor.statistics()


# ---------------------------------------------------------------- actor


class TrainerActor:
    """The async shell around one trainer engine: input loop plus step loop."""

    def __init__(
        self,
        *,
        name: str,
        build_engine: Callable[[], TrainerEngine],
        limiter: trio.CapacityLimiter,
        futures: FutureTable,
        checkpoints: CheckpointSink,
        sampler: SamplerFeed,
        specs: dict[str, LoraSpec] | None = None,
        max_combined_tokens: int = MAX_COMBINED_TOKENS,
        lease_from: Callable[[Parkable], DeviceLease | GroupLease] | None = None,
        on_engine_lost: Callable[[EngineLost], None] | None = None,
        autosaves: AutosaveStore | None = None,
        host_memory: HostMemory | None = None,
    ) -> None:
        self.name = name
        # The node's host-memory ledger: told what a park copied to the host and, on a CPU, what the
        # engine holds (weights, adapters, grads, optimizer state), measured at build and after a job's first step.
        self._memory = host_memory
        self._memory_key = ("trainer", name)
        self._on_engine_lost = on_engine_lost  # set: one job's own group, ended (not rebuilt) when its engine is lost
        self.queues = TrainerQueues()
        self.mailbox: Mailbox[TrainOp] = Mailbox(f"trainer {name}", MAILBOX_CAPACITY)
        self._build_engine = build_engine
        self._limiter = limiter
        self._futures = futures
        self._checkpoints = checkpoints
        self._sampler = sampler
        self._specs: dict[str, LoraSpec | None] = dict(specs or {})
        self._wake = trio.Event()
        self._engine: TrainerEngine | None = None
        self._thread: EngineThread | None = None  # every engine call runs on it; made in `run`
        self._busy = False
        self._max_combined_tokens = max_combined_tokens
        self._done = 0
        self._failed = 0
        self._combined = 0
        self._last_sync: SyncStats | None = None
        # The device lease, taken once the engine exists (the time-slicer parks it through this actor).
        self._lease_from = lease_from
        self._lease: DeviceLease | GroupLease | NoLease = NoLease()
        self._progress: dict[str, JobProgress] = {}
        self._running_job: str | None = None  # whose ops run (or wait for the device) now
        self._in_hand: list[TrainOp] = []  # the run of ops taken from the queues, until it is done
        self._lost: dict[str, EngineLost] = {}  # model_id -> the loss of the engine that held its adapter
        # Auto-saves to a shared checkpoint root (actors/autosaves.py); None: the node has none.
        self._autosaver = Autosaver(autosaves) if autosaves is not None else None
        self._autosave_every: dict[str, int] = {}  # model_id -> optim_steps between its auto-saves; 0: none
        # model_id -> the names it last published sampler weights under: (tinker:// paths, sampling session ids)
        self._published: dict[str, tuple[deque[str], deque[str]]] = {}
        # model_id -> (kind, name) of checkpoints its next saves write again (an adopted job's recomputed steps)
        self.rewritten: dict[str, set[tuple[str, str]]] = {}
        self._ended: dict[str, OpenrldError] = {}  # model_id -> why: ended jobs, whose late ops fail with it
        self._drops: deque[str] = deque()  # ended jobs whose state the step loop drops next, in end order

    async def run(self, *, task_status: trio.TaskStatus[TrainerHandle] = trio.TASK_STATUS_IGNORED) -> None:
        if self._lease_from is not None:
            self._lease = self._lease_from(self)
        self._thread = EngineThread(f"trainer {self.name}", release_when_idle=on_cpu(self._lease.device))
        try:
            # Loading the weights onto the device is a turn: another party on the device parks first.
            async with self._lease.hold(has_more=lambda: False):
                self._engine = await self._in_thread(self._build_engine)
            await self._measure_state()
            logger.info("trainer ready group=%s", self.name)
            async with trio.open_nursery() as nursery:
                if self._autosaver is not None:
                    await nursery.start(self._autosaver.run)
                nursery.start_soon(self._input_loop)
                task_status.started(TrainerHandle(self))
                await self._step_loop()
        finally:
            self._lease.close()  # a stopped worker takes no more turns
            if self._memory is not None:
                self._memory.forget(self._memory_key)
            await self._close_engine(self._engine)
            self._thread.stop()

    async def _close_engine(self, engine: TrainerEngine | None) -> None:
        # An engine in a process of its own stops that process; the others free what they hold.
        if engine is not None and self._thread is not None:
            with trio.CancelScope(shield=True):
                await self._thread.call(engine.close)

    async def _input_loop(self) -> None:
        async for op in self.mailbox.receive:
            ended = self._ended.get(op.model_id)
            if ended is not None and not self.queues.has_job(op.model_id):  # posted just before its job ended
                self._futures.fail(op.request_id, ended)
                continue
            try:
                self.queues.push(op)
            except OpenrldError as error:
                self._futures.fail(op.request_id, error)
                continue
            self._wake.set()

    async def _step_loop(self) -> None:
        while True:
            if self._drops:  # between runs: an ended job's last op has settled, and nothing else runs
                await self._drop_job(self._drops.popleft())
                continue
            run = self.queues.pop_ready(self._max_combined_tokens)
            if not run:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._busy, self._running_job, self._in_hand = True, run[0].model_id, run
            try:
                async with self._lease.hold(has_more=self.queues.has_ready):
                    if self._engine is not None and self._is_engine_op(run[0]):
                        await self._run_engine_ops(run)
                        if self._is_first_step(run[-1]):  # a job's first step makes its optimizer's state
                            await self._measure_state()
                        continue
                    for op in run:
                        await self._run_one(op)
            finally:
                self._busy, self._running_job, self._in_hand = False, None, []

    def _is_engine_op(self, op: TrainOp) -> bool:
        """Whether `op` is engine work alone, with nothing for the event loop around it."""
        return isinstance(op, (ForwardBackward, OptimStep)) and op.model_id not in self._lost

    async def _run_engine_ops(self, run: list[TrainOp]) -> None:
        """`run`, and the runs of engine ops that are ready behind it, queued on the engine thread
        before the run ahead is settled: the engine goes from one to the next without the event loop.

        Queueing stops when the device's turn is due (the queued runs finish first) and after an
        engine is lost (every run queued on it fails with the loss, and the engine is replaced).

        An optim_step whose auto-save is due has the write queued right behind its run, as an
        entry of its own (no ops, the step beside it), settled in its turn: once the step's own
        future has resolved, and before the device's turn ends.
        """
        assert self._engine is not None and self._thread is not None
        engine, thread, lost, stepped = self._engine, self._thread, None, False
        queued: deque[tuple[list[TrainOp], Pending[Any], OptimStep | None]] = deque()
        async with self._limiter:  # the device's turn, for every call queued below
            while run or queued:
                if run:
                    queued.append((run, thread.submit(run_engine_ops, engine, run, on_done=self._poke), None))
                    if (step := self._autosave_due(run, queued)) is not None:
                        assert self._autosaver is not None, "due only with an autosaver"
                        write = thread.submit(
                            take_state, engine, step.model_id, self._autosaver.store.staging, on_done=self._poke
                        )
                        queued.append(([], write, step))
                    self._in_hand = [op for ops, *_ in queued for op in ops]
                    run = []
                if lost is None and len(queued) < PIPELINE_DEPTH and not self._lease.is_due():
                    run = self.queues.pop_ready(self._max_combined_tokens, accept=self._is_engine_op)
                    if run:
                        continue
                ops, pending, step = queued[0]
                if not pending.done:  # wait for it, or for an op that could be queued behind it
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                queued.popleft()
                if step is not None:  # the auto-save written behind the run just settled
                    lost = await self._settle_autosave(step, pending, stepped) or lost
                    continue
                outcomes, combined = await pending.wait()
                lost = self._settle_run(ops, outcomes, combined) or lost
                stepped = isinstance(ops[-1], OptimStep) and not isinstance(outcomes[-1], Exception)
                self._in_hand = [op for ops, *_ in queued for op in ops]
                self._running_job = self._in_hand[0].model_id if self._in_hand else None
        if lost is not None:
            await self._replace_engine(lost)

    def _poke(self) -> None:
        self._wake.set()

    def _autosave_due(self, run: list[TrainOp], queued: deque[tuple[list[TrainOp], Any, Any]]) -> OptimStep | None:
        """The run's optim_step if its job's auto-save falls due with it; `queued` holds the run already."""
        step = run[-1]
        if not isinstance(step, OptimStep):
            return None
        every = self._autosave_every.get(step.model_id, 0)
        if every == 0:
            return None
        progress = self._progress.get(step.model_id)
        # The job's step count once every step queued so far has run; a failed one makes it one less,
        # so that a save lands one step off its interval, and is named for the count it really has.
        unsettled = sum(1 for ops, *_ in queued for op in ops if isinstance(op, OptimStep) and op.model_id == step.model_id)
        count = (progress.optim_steps if progress is not None else 0) + unsettled
        return step if count % every == 0 else None

    async def _settle_autosave(self, step: OptimStep, write: Pending[TakenState], stepped: bool) -> EngineLost | None:
        """Hand the state taken behind `step` to the autosaver, named for the job's step count;
        dropped if the step failed (the state is the previous step's). The engine's loss, if it was lost."""
        assert self._autosaver is not None, "a write is queued only with an autosaver"
        try:
            state = await write.wait()
        except Exception as error:
            self._autosaver.failed(step.model_id, error)
            return error if isinstance(error, EngineLost) else None
        if not stepped:
            self._autosaver.discard(state)
            return None
        paths, sessions = self._published.get(step.model_id, ((), ()))
        try:
            manifest = self._autosaver.store.describe(
                step.model_id, step=self._progress[step.model_id].optim_steps, seq_id=step.seq_id,
                sampler_paths=list(paths), sampling_sessions=list(sessions),
            )
        except OpenrldError as error:  # its run's row is gone: the job was deleted meanwhile
            self._autosaver.failed(step.model_id, error)
            self._autosaver.discard(state)
            return None
        self._autosaver.written(state, manifest)
        return None

    def _settle_run(self, run: list[TrainOp], outcomes: list[Any], combined: bool) -> EngineLost | None:
        """Resolve each op of an engine run with its value or its error; the engine's loss, if it was lost."""
        lost = None
        if combined:
            self._combined += sum(1 for op in run if isinstance(op, ForwardBackward))
        for op, value in zip(run, outcomes, strict=True):
            if isinstance(value, Exception):
                self._settle_failed(op, value)
                lost = value if isinstance(value, EngineLost) else lost
            else:
                self._settle(op, value)
        return lost

    def end_job(self, model_id: str, error: OpenrldError) -> None:
        """Job `model_id` ended (the group serves on): fail its queued ops, and drop its state next."""
        self._ended[model_id] = error
        for op in self.queues.close_job(model_id):
            self._futures.fail(op.request_id, error)
        self._drops.append(model_id)
        self._wake.set()

    async def _drop_job(self, model_id: str) -> None:
        """Drop an ended job's adapter (with its gradients and optimizer state) from the engine, in the
        device's turn, and forget what this actor kept of it."""
        self._ended.pop(model_id, None)  # a late op of it now fails as one for a job not open here
        if self.queues.has_job(model_id):  # opened again meanwhile (adopted back): its state is the job's again
            return
        held = model_id in self._specs and model_id not in self._lost  # else the engine never had it, or lost it
        for kept in (self._lost, self._progress, self._published, self._autosave_every, self.rewritten):
            kept.pop(model_id, None)
        if not held or self._engine is None:
            self._specs.pop(model_id, None)
            return
        try:
            async with self._lease.hold(has_more=self.queues.has_ready):
                await self._in_thread(self._engine.drop_adapter, model_id)
                self._specs.pop(model_id)
                await self._measure_state()  # the ledger sees the memory it freed
        except EngineLost as error:  # the other jobs' adapters went with it: replaced as after an op
            self._specs.pop(model_id, None)
            await self._replace_engine(error)
            return
        except Exception:  # the job is over either way; the group serves on, its statistics counting the adapter
            logger.exception("trainer could not drop an ended job's adapter group=%s model_id=%s", self.name, model_id)
            return
        logger.info("trainer dropped an ended job's adapter group=%s model_id=%s", self.name, model_id)

    def fail_pending(self, error: OpenrldError) -> None:
        """The group ended: fail every op still here (queued, in the mailbox, or cut short)."""
        ops = list(self._in_hand)
        for job in self.queues.statistics():
            ops += self.queues.close_job(job.model_id)
        while True:
            try:
                ops.append(self.mailbox.receive.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        for op in ops:
            self._futures.fail(op.request_id, error)  # a no-op for one that already resolved

    # The time-slicer's calls (Parkable): the engine moves in this actor's worker thread.
    async def park(self) -> bool:
        if self._engine is not None:  # None: its first turn, the load, has not come yet
            report = await self._in_thread(self._engine.park)
            if self._memory is not None:  # past the node's budget, its host copies go to disk
                spill = getattr(self._engine, "spill_parked", None)  # None: an engine that cannot spill
                await park_within_budget(
                    self._memory, self._memory_key, report.bytes_moved,
                    None if spill is None else partial(self._in_thread, spill),
                )
        return True  # the trainer parks between ops, when nothing is in flight

    async def resume(self) -> None:
        if self._engine is not None:  # None: nothing to bring back; the engine is built in this turn
            await self._in_thread(self._engine.resume)
            if self._memory is not None:
                self._memory.parked(self._memory_key, 0)

    def _is_first_step(self, op: TrainOp) -> bool:
        progress = self._progress.get(op.model_id) if isinstance(op, OptimStep) else None
        return progress is not None and progress.optim_steps == 1

    async def _measure_state(self) -> None:
        """Tell the ledger what the engine holds in host memory (on a CPU device; 0 elsewhere)."""
        measure = getattr(self._engine, "host_state_bytes", None)  # None: a worker in another process
        if self._memory is not None and measure is not None:
            self._memory.state(self._memory_key, await self._in_thread(measure))

    async def _run_one(self, op: TrainOp) -> None:
        try:
            value = await self._execute(op)
        except EngineLost as error:
            self._settle_failed(op, error)
            await self._replace_engine(error)
        except Exception as error:
            self._settle_failed(op, error)
        else:
            self._settle(op, value)

    async def _replace_engine(self, error: EngineLost) -> None:
        """The engine died with every adapter it held: build another, and mark those jobs lost."""
        for model_id in self._specs:
            self._lost.setdefault(model_id, error)
        logger.error("trainer engine lost group=%s jobs=%d: %s", self.name, len(self._specs), error.detail)
        lost, self._engine = self._engine, None
        await self._close_engine(lost)
        if self._on_engine_lost is not None:
            self._on_engine_lost(error)
            return
        try:
            self._engine = await self._in_thread(self._build_engine)
        except Exception:  # the next op finds no engine, fails, and this is tried again
            logger.exception("trainer engine rebuild failed group=%s", self.name)
            return
        logger.info("trainer engine rebuilt group=%s", self.name)

    def _settle(self, op: TrainOp, value: Any) -> None:
        self._done += 1
        self._note_progress(op, value=value)
        self._futures.resolve(op.request_id, Completed(value))

    def _settle_failed(self, op: TrainOp, error: Exception) -> None:
        self._failed += 1
        if not isinstance(error, OpenrldError):  # the op's failure is its own; the group keeps serving
            logger.error(
                "trainer op failed group=%s model_id=%s seq_id=%s", self.name, op.model_id, op.seq_id, exc_info=error
            )
            error = ServerError(f"{type(error).__name__}: {error}")
        self._note_progress(op, error=error.detail)
        self._futures.fail(op.request_id, error)

    def _note_progress(self, op: TrainOp, *, value: Any = None, error: str | None = None) -> None:
        old = self._progress.get(op.model_id) or JobProgress(op.model_id, 0, None, None)
        steps, version = old.optim_steps, old.sampler_version
        if error is None and isinstance(op, OptimStep):
            steps += 1
        elif error is None and isinstance(op, SaveForSampler):
            version = op.sampling_session_id
            self._published_of(op.model_id)[1].append(version)
        elif error is None and isinstance(op, SaveState) and op.kind == "sampler_weights":
            version = value.path
            self._published_of(op.model_id)[0].append(version)
        self._progress[op.model_id] = JobProgress(op.model_id, steps, version, error or old.last_error)

    def _published_of(self, model_id: str) -> tuple[deque[str], deque[str]]:
        if model_id not in self._published:
            self._published[model_id] = (deque(maxlen=MAX_SAMPLER_NAMES), deque(maxlen=MAX_SAMPLER_NAMES))
        return self._published[model_id]

    def _open_autosaves(self, model_id: str) -> None:
        """A job opened here (created or loaded): how often its state is auto-saved, from its run's settings."""
        self._autosave_every[model_id] = self._autosaver.store.interval(model_id) if self._autosaver is not None else 0

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the engine thread, in the device's turn."""
        assert self._thread is not None, "made first thing in `run`"
        async with self._limiter:
            return await self._thread.call(fn, *args)

    async def _execute(self, op: TrainOp) -> Any:
        engine = self._engine
        lost = self._lost.get(op.model_id)
        if lost is not None and not isinstance(op, (CreateAdapter, LoadState)):
            raise ServerError(lost.detail)  # not EngineLost: the engine now in place is alive
        if engine is None:
            raise EngineLost(f"the trainer of {self.name} could not be rebuilt after its engine was lost")
        match op:  # forward_backward and optim_step run in `_run_engine_ops`
            case CreateAdapter():
                await self._in_thread(engine.add_adapter, op.model_id, op.spec, op.optimizer)
                self._specs[op.model_id] = op.spec
                self._lost.pop(op.model_id, None)
                self._open_autosaves(op.model_id)
                return Created(model_id=op.model_id)
            case LoadState():
                await self._in_thread(
                    engine.load_state, op.model_id, Path(op.source_dir), op.spec, op.with_optimizer, op.optimizer
                )
                self._specs[op.model_id] = op.spec
                self._lost.pop(op.model_id, None)
                if op.optim_steps:  # its auto-saves go on being named for the job's own steps
                    self._progress[op.model_id] = JobProgress(op.model_id, op.optim_steps, None, None)
                self._open_autosaves(op.model_id)
                return Loaded(model_id=op.model_id, path=op.source_uri)
            case SaveState():
                return await self._save_state(op)
            case Rejected():
                raise BadRequest(op.detail)
            case SaveForSampler():
                if op.inflight:
                    spec = self._specs[op.model_id]
                    # A full fine-tuning job's inflight save is refused before it is queued (jobs.py).
                    assert spec is not None, f"inflight weights of full fine-tuning job {op.model_id}"
                    tensors = await self._in_thread(engine.adapter_tensors, op.model_id)
                    await self._sampler.publish_inflight(op.model_id, op.sampling_session_id, tensors, spec)
                else:
                    # LoRA: the adapter tensors; full fine-tuning: a weight-sync payload (gpu/delta.py)
                    # that chains on the previous one, so publishes keep seq_id order (they do: one op at a time).
                    payload = await self._in_thread(engine.sampler_payload, op.model_id, op.sampling_session_id)
                    await self._sampler.publish_version(op.sampling_session_id, payload, self._specs[op.model_id])
                    # A full trainer records the sync it made; a LoRA one has none to record.
                    self._last_sync = engine.last_sync
                return Saved(sampling_session_id=op.sampling_session_id)
        raise AssertionError(f"unhandled op {type(op).__name__}")

    async def _save_state(self, op: SaveState) -> Saved:
        """Write into a staging directory, then rename into place: a crash leaves no half checkpoint."""
        engine = self._engine
        assert engine is not None, "_execute checks the engine first"
        overwrite = op.overwrite or self._rewrites(op)
        staging, final = await self._checkpoints.prepare(op.model_id, op.kind, op.name, overwrite)
        if op.kind == "weights":
            size = await self._in_thread(engine.save_state, op.model_id, staging, True)
        elif op.kind == "external_weights":
            size = await self._in_thread(engine.export_adapter, op.model_id, staging, op.base_model)
        else:
            # The engine writes what its sampler loads: a LoRA adapter or full-model weights.
            size = await self._in_thread(engine.sampler_checkpoint, op.model_id, staging)
        manifest = self._checkpoints.describe(
            op.model_id, op.kind, op.name, size_bytes=size, ttl_seconds=op.ttl_seconds, user_metadata=op.user_metadata
        )
        # Shielded: once the files are written, the rename and the row land together or not at all.
        with trio.CancelScope(shield=True):
            await self._checkpoints.commit(staging, final, overwrite, manifest)
            uri = await self._checkpoints.record(manifest)
        return Saved(path=uri)

    def _rewrites(self, op: SaveState) -> bool:
        """Whether `op` writes again a checkpoint its job's dead home wrote in a step recomputed here (once)."""
        names = self.rewritten.get(op.model_id)
        if names is None or (op.kind, op.name) not in names:
            return False
        names.discard((op.kind, op.name))
        return True

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            jobs=self.queues.statistics(), ops_done=self._done, ops_failed=self._failed,
            ops_combined=self._combined, busy=self._busy, device=self._lease.device,
            lease=self._lease.statistics() if not isinstance(self._lease, NoLease) else None,
            progress=list(self._progress.values()), running_job=self._running_job,
            last_sync=self._last_sync, adapters_loaded=sum(1 for m in self._specs if m not in self._lost),
            memory=self._memory.of(self._memory_key) if self._memory is not None else EngineMemory(),
        )


def run_engine_ops(engine: TrainerEngine, run: list[TrainOp]) -> tuple[list[Any], bool]:
    """A run of one job's forward_backward ops and optim_step, on the engine thread (never on
    the event loop): each op's value or exception, in order, and whether the run shared one pass.

    A run of several ops is one engine call (`forward_backward_then_step`). When that call
    fails as a whole (it added nothing), the ops run again one by one, so that each failure
    lands on its own request. A lost engine fails the rest of the run with the loss.
    """
    step = run[-1] if isinstance(run[-1], OptimStep) else None
    passes = [op for op in run if isinstance(op, ForwardBackward)]
    if len(run) > 1:
        try:
            results, stepped = engine.forward_backward_then_step(
                run[0].model_id, [op.batch for op in passes], step.params if step is not None else None
            )
        except EngineLost as error:
            return [error] * len(run), False
        except OpenrldError:
            pass
        except Exception:
            logger.exception("combined forward_backward failed model_id=%s", run[0].model_id)
        else:
            return [*results, *([stepped] if step is not None else [])], True
    outcomes: list[Any] = []
    for op in run:
        try:
            if isinstance(op, ForwardBackward):
                outcomes.append(engine.forward_backward(op.model_id, op.batch))
            else:
                assert isinstance(op, OptimStep), "only forward_backward and optim_step are engine runs"
                outcomes.append(engine.optim_step(op.model_id, op.params))
        except EngineLost as error:
            return outcomes + [error] * (len(run) - len(outcomes)), False
        except Exception as error:
            outcomes.append(error)
    return outcomes, False
