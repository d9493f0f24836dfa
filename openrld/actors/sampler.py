"""The sampler actor: one per LoRA group (one base model on one device).

It owns the group's sampling queue, the immutable weight versions it can
serve, and its engines (`gpu.torch_sampler`, `replicas` of them, each run in a
worker thread under the device's capacity limiter).

Scheduling: the engine is a step-level scheduler (continuous batching), and
this actor feeds it step by step. Each engine worker loops: apply the cancels
that arrived, admit waiting requests into its engine (loading their versions
first), run one `engine.step()` in its thread, resolve the requests that
finished. Requests join and leave the running batch between steps, so a new
request waits at most one step, never for a whole other request. With N
replicas, N workers drain the one queue; a worker admits while its engine has
fewer than `MAX_LIVE_PER_ENGINE` requests, so an idle replica takes the next.

Backpressure: the queue counts every request in the sampler, waiting or
running; past `queue_limit` a submission is refused with 429 (TooManyRequests),
which the SDK answers by backing off and resubmitting the same seq_id. A
waiting request's `queue_state` is `paused_capacity` while the queue is full,
else `active`. `cancel` frees a request wherever it is.

Versions: a version is a name (a `tinker://…/sampler_weights/…` or
`…/weights/…` path, or a sampling session id for unnamed saves) bound once to
adapter weights; `None` is the base model. Weights published by the trainer
are held on the host; weights saved on disk are read when first sampled. At
most `MAX_LOADED_VERSIONS` versions live in each engine, least recently used
out first but never one that a live request samples from.

It never imports torch and never reaches into another actor.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Callable

import msgspec
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.batches import LoraSpec, SampleJob
from openrld.errors import BadRequest, Gone, OpenrldError, ServerError, TooManyRequests

logger = logging.getLogger(__name__)

MAX_LOADED_VERSIONS = 32  # adapters resident in one engine at once
MAX_HOST_VERSIONS = 256  # unnamed (in-memory only) versions kept for reloading
MAX_LIVE_PER_ENGINE = 64  # requests one engine holds (the rest wait in the queue for any replica)


class Sample(msgspec.Struct, frozen=True):
    request_id: str
    version: str | None  # None: the base model
    job: SampleJob
    source_dir: str | None = None  # where the version's adapter lies on disk, if it does


class QueueState(enum.Enum):
    """The SDK's TryAgainResponse.queue_state values this server reports."""

    ACTIVE = "active"
    PAUSED_CAPACITY = "paused_capacity"


class SamplerStatistics(msgspec.Struct, frozen=True):
    queue_depth: int  # requests in the sampler: waiting + running
    waiting: int
    running: int
    replicas: int
    loaded_versions: int  # summed over replicas
    host_versions: int
    samples_done: int
    samples_failed: int
    samples_cancelled: int
    samples_refused: int  # submissions answered 429
    busy: bool


# ---------------------------------------------------------------------------
# Pure state


class SampleQueue:
    """Which requests wait, which run, which were cancelled while running. Sync, no I/O.

    `push` refuses past `limit` requests in total (waiting + running).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._waiting: deque[Sample] = deque()
        self._running: set[str] = set()
        self._cancels: set[str] = set()  # running requests cancelled, not yet dropped by their engine
        self.refused = 0
        self.cancelled = 0

    def depth(self) -> int:
        # A cancelled request's place is free at once; its engine drops the work at the next step.
        return len(self._waiting) + len(self._running) - len(self._cancels)

    def is_full(self) -> bool:
        return self.depth() >= self._limit

    def push(self, op: Sample) -> None:
        """Queue `op`, or raise TooManyRequests (429) when the sampler holds `limit` requests."""
        if self.is_full():
            self.refused += 1
            raise TooManyRequests(f"sampler queue is full ({self._limit} requests); retry shortly")
        self._waiting.append(op)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def take(self) -> Sample:
        """The oldest waiting request, now running."""
        op = self._waiting.popleft()
        self._running.add(op.request_id)
        return op

    def done(self, request_id: str) -> None:
        self._running.discard(request_id)
        self._cancels.discard(request_id)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting request now, or mark a running one for its engine; False if unknown."""
        for op in self._waiting:
            if op.request_id == request_id:
                self._waiting.remove(op)
                self.cancelled += 1
                return True
        if request_id in self._running and request_id not in self._cancels:
            self._cancels.add(request_id)
            self.cancelled += 1
            return True
        return False

    def take_cancels(self, live: set[str]) -> list[str]:
        """The cancelled requests among `live` (one engine's), which that engine must now drop."""
        mine = sorted(self._cancels & live)
        for request_id in mine:
            self.done(request_id)
        return mine

    def queue_state(self, request_id: str) -> QueueState:
        if request_id not in self._running and self.is_full():
            return QueueState.PAUSED_CAPACITY
        return QueueState.ACTIVE

    def counts(self) -> tuple[int, int]:
        """(waiting, running), cancelled requests left out."""
        return len(self._waiting), len(self._running) - len(self._cancels)


class VersionCache:
    """Which versions one engine holds, in LRU order. Pure: no I/O."""

    def __init__(self, max_loaded: int) -> None:
        self._max_loaded = max_loaded
        self.loaded: OrderedDict[str, None] = OrderedDict()

    def touch(self, version: str) -> bool:
        """Mark `version` used; True if the engine already holds it."""
        if version in self.loaded:
            self.loaded.move_to_end(version)
            return True
        return False

    def admit(self, version: str, pinned: set[str]) -> list[str]:
        """Record that the engine now holds `version`; return versions to drop, never a pinned one."""
        self.loaded[version] = None
        evicted: list[str] = []
        for old in list(self.loaded):
            if len(self.loaded) <= self._max_loaded:
                break
            if old != version and old not in pinned:
                del self.loaded[old]
                evicted.append(old)
        return evicted


class HostVersions:
    """Adapter tensors published by the trainer, kept on the host for (re)loading. Pure."""

    def __init__(self, max_host: int) -> None:
        self._max_host = max_host
        self.held: OrderedDict[str, tuple[Any, LoraSpec]] = OrderedDict()

    def remember(self, version: str, tensors: Any, spec: LoraSpec) -> None:
        self.held[version] = (tensors, spec)
        self.held.move_to_end(version)
        while len(self.held) > self._max_host:
            self.held.popitem(last=False)


# ---------------------------------------------------------------------------
# Handle


class SamplerHandle:
    def __init__(self, actor: "SamplerActor") -> None:
        self._actor = actor

    def submit_nowait(self, op: Sample) -> None:
        """Queue a sample or raise TooManyRequests (429); never waits."""
        self._actor.submit_nowait(op)

    def cancel(self, request_id: str) -> bool:
        """Free a request's queued or running work; False if this sampler does not hold it."""
        return self._actor.cancel(request_id)

    async def publish_version(self, version: str, tensors: Any, spec: LoraSpec) -> None:
        self._actor.host.remember(version, tensors, spec)

    def statistics(self) -> SamplerStatistics:
        return self._actor.statistics()


# ---------------------------------------------------------------------------
# Actor


class _Worker:
    """One engine and the versions it holds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.versions = VersionCache(MAX_LOADED_VERSIONS)
        self.live: set[str] = set()  # request ids inside the engine
        self.busy = False
        self.wake = trio.Event()  # set when there may be work for it


class SamplerActor:
    def __init__(
        self,
        *,
        name: str,
        build_engine: Callable[[], Any],
        limiter: trio.CapacityLimiter,
        futures: FutureTable,
        queue_limit: int,
        replicas: int = 1,
    ) -> None:
        assert replicas >= 1, f"replicas must be >= 1, got {replicas}"
        self.name = name
        self.queue = SampleQueue(queue_limit)
        self.host = HostVersions(MAX_HOST_VERSIONS)
        self._build_engine = build_engine
        self._limiter = limiter
        self._futures = futures
        self._replicas = replicas
        self._workers: list[_Worker] = []
        self._done = 0
        self._failed = 0

    # -- called from the API's event loop ----------------------------------

    def submit_nowait(self, op: Sample) -> None:
        self.queue.push(op)
        self._futures.watch_queue(op.request_id, lambda: self.queue.queue_state(op.request_id).value)
        self._wake_all()

    def cancel(self, request_id: str) -> bool:
        """The caller fails the request's future; this frees the work."""
        if not self.queue.cancel(request_id):
            return False
        self._wake_all()
        return True

    def _wake_all(self) -> None:
        for worker in self._workers:
            worker.wake.set()

    # -- the loops ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[SamplerHandle] = trio.TASK_STATUS_IGNORED) -> None:
        for _ in range(self._replicas):
            engine = await trio.to_thread.run_sync(self._build_engine, limiter=self._limiter)
            self._workers.append(_Worker(engine))
        logger.info("sampler ready group=%s replicas=%d", self.name, self._replicas)
        async with trio.open_nursery() as nursery:
            for worker in self._workers:
                nursery.start_soon(self._work, worker)
            task_status.started(SamplerHandle(self))

    async def _work(self, worker: _Worker) -> None:
        """Input, then step: apply cancels, admit, run one engine step, resolve what finished."""
        while True:
            for request_id in self.queue.take_cancels(worker.live):
                worker.engine.cancel(request_id)
                worker.live.discard(request_id)
            while self.queue.has_waiting() and len(worker.live) < MAX_LIVE_PER_ENGINE:
                await self._admit(worker, self.queue.take())
            if not worker.engine.has_work():
                await worker.wake.wait()
                worker.wake = trio.Event()
                continue
            worker.busy = True
            try:
                finished = await trio.to_thread.run_sync(worker.engine.step, limiter=self._limiter)
            except Exception as error:  # a failed step fails its batch; the engine starts empty again
                logger.exception("sampler step failed group=%s", self.name)
                self._fail_all(worker, ServerError(f"sampling step failed: {type(error).__name__}: {error}"))
                continue
            finally:
                worker.busy = False
            for done in finished:
                worker.live.discard(done.request_id)
                self.queue.done(done.request_id)
                self._done += 1
                self._futures.resolve(done.request_id, Completed(done.result))

    async def _admit(self, worker: _Worker, op: Sample) -> None:
        try:
            if op.version is not None:
                await self._ensure_loaded(worker, op.version, op.source_dir)
            # Validation and per-sample RNG set-up only: cheap enough for the event loop,
            # and the engine is idle between steps.
            worker.engine.add(op.request_id, op.version, op.job)
        except (OpenrldError, KeyError, ValueError) as error:
            self.queue.done(op.request_id)
            self._failed += 1
            if not isinstance(error, OpenrldError):
                error = BadRequest(str(error))
            self._futures.fail(op.request_id, error)
            return
        worker.live.add(op.request_id)

    async def _ensure_loaded(self, worker: _Worker, version: str, source_dir: str | None) -> None:
        if worker.versions.touch(version):
            return
        if version in self.host.held:
            tensors, spec = self.host.held[version]
        elif source_dir is not None:
            tensors, spec = await trio.to_thread.run_sync(_load_adapter, Path(source_dir))
        else:
            raise Gone(f"sampler weights {version} are no longer held; save them again")
        await trio.to_thread.run_sync(worker.engine.load_version, version, tensors, spec, limiter=self._limiter)
        for old in worker.versions.admit(version, pinned=worker.engine.versions_in_use()):
            await trio.to_thread.run_sync(worker.engine.drop_version, old, limiter=self._limiter)

    def _fail_all(self, worker: _Worker, error: OpenrldError) -> None:
        for request_id in sorted(worker.live):
            worker.engine.cancel(request_id)
            self.queue.done(request_id)
            self._failed += 1
            self._futures.fail(request_id, error)
        worker.live.clear()

    def statistics(self) -> SamplerStatistics:
        waiting, running = self.queue.counts()
        return SamplerStatistics(
            queue_depth=waiting + running,
            waiting=waiting,
            running=running,
            replicas=self._replicas,
            loaded_versions=sum(len(w.versions.loaded) for w in self._workers),
            host_versions=len(self.host.held),
            samples_done=self._done,
            samples_failed=self._failed,
            samples_cancelled=self.queue.cancelled,
            samples_refused=self.queue.refused,
            busy=any(w.busy for w in self._workers),
        )


def _load_adapter(directory: Path) -> tuple[Any, LoraSpec]:
    # Imported in the worker thread, so this module never imports torch.
    from openrld.gpu.lora_io import load_adapter

    return load_adapter(directory)
