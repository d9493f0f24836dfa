"""The sampler actor: one per LoRA group (one base model on one device).

It owns the group's sampling queue, the immutable weight versions it can
serve, and its engines (`SamplerEngine`s, `replicas` of them, each run in a
thread of its own (actors/engine_thread.py) under the device's capacity limiter).

Scheduling: the engine is a step-level scheduler (continuous batching), and
this actor feeds it step by step. Each engine worker loops: apply the cancels
that arrived, admit waiting requests into its engine (loading their versions
first), run engine steps in its thread (`run_steps`: back to back until
anything arrives for the actor, the engine runs out of work, or `STEPS_CALL_S`
passes). The requests a step finished are handed to the event loop at once,
which resolves them while the next step runs. Requests join and leave the
running batch between steps, so a new request waits at most one step, never
for a whole other request. With N
replicas, N workers drain the one queue, oldest request first, and `routing`
says which worker takes the next one. "prefix" (the default): the replica most
likely to hold the request's prompt prefix in its engine's prefix cache,
weighed against the requests each holds (actors/prefix_routing.py; an idle
replica still takes work when the preferred one is much busier), so that a
group's samples and an episode's next turn land where their prefix is.
"least_loaded": a worker admits while its engine has fewer than
`MAX_LIVE_PER_ENGINE` requests and none holds fewer, so an idle replica takes
the next request and the load spreads. Each replica is its own
engine instance (`build_engine` is called once per replica), on the group's
device limiter: on one device the replicas' steps take turns. A shared LoRA
group runs the most replicas any of its jobs asked for (`ensure_replicas`
grows it, and it never shrinks while the group lives).

Backpressure: the queue counts every request in the sampler, waiting or
running; past `queue_limit` a submission is refused with 429 (TooManyRequests),
which the SDK answers by backing off and resubmitting the same seq_id. A
waiting request's `queue_state` is `paused_capacity` while the queue is full,
else `active`. `cancel` frees a request wherever it is.

Versions: a version is a name (a `tinker://…/sampler_weights/…` or
`…/weights/…` path, or a sampling session id for unnamed saves) bound once to
adapter weights; `None` is the base model. Weights published by the trainer
are held on the host; weights saved on disk are read by the engine
(`load_checkpoint`) when first sampled. At
most `MAX_LOADED_VERSIONS` versions live in each engine, least recently used
out first but never one that a live request samples from.

Inflight weights: per training model, the newest weights
published by an inflight save are the model's target, numbered 1, 2, ... in the
order the trainer ran the saves (seq_id order); each number's weights are an
immutable version named `<model_id>/inflight/<n>`. Only the newest is held on
the host; older ones stay in engines until evicted. The save that created an
inflight sampling session sets that session's floor (its number). A request of
an inflight session binds at admission to the model's newest number, which is
never below the floor, and every token of it comes from that version.

Stability records: a request with `record_ids` is recorded into the shared
`StabilityRecords` when it finishes, one record per sequence, with the version
it was bound to (actors/stability.py).

Device turns: building engines (loading the weights onto the device, at start
and for each replica `ensure_replicas` adds), admissions, version loads and
steps run while holding the device lease (actors/timeslicer.py), so a replica
added while the sampler is parked waits for the sampler's turn and is parked
with the others after it. Past its turn the sampler admits nothing new and
lets running requests finish: it parks only between requests, since parking
drops the KV cache. When its group ends (`fail_pending`), every request it
holds fails, and the lease is given back as the actor stops.

Host memory: with the node's `HostMemory` ledger (actors/host_memory.py), each
replica's prefix cache holds at most the share the node's budget gives it now
(`bound_prefix_cache`, applied in the engine's thread before its next call and
after each steps call, so a share that shrank while the sampler was idle is
applied at once), and the ledger learns what the caches hold, what a park
copied to host memory, and what the engines hold in host memory on a CPU.

It never imports torch nor anything of `gpu/` (it knows its engines by the
torch-free `engine_types.SamplerEngine`), and never reaches into another actor.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import trio

from openrld.actors.engine_thread import EngineThread, on_cpu
from openrld.actors.futures import Completed, FutureTable
from openrld.actors.host_memory import EngineMemory, HostMemory, park_within_budget
from openrld.actors.prefix_routing import PrefixRouter, prefix_block_hashes
from openrld.actors.stability import StabilityRecord, StabilityRecords
from openrld.actors.timeslicer import DeviceLease, NoLease, Parkable, WorkerLeaseStatistics
from openrld.batches import LoraSpec, SampleJob, SampleResult, SyncStats
from openrld.engine_types import Finished, SamplerEngine, WeightPayload
from openrld.errors import BadRequest, EngineLost, Gone, OpenrldError, ServerError, TooManyRequests

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Adapters resident in one engine at once. An RL loop samples each version once or twice and
# moves on, so past this many the oldest is dropped and its adapter takes the next version
# (a copy, ~10 ms on SmolLM2, where a new peft adapter costs ~0.3 s; gpu/torch_sampler.py).
MAX_LOADED_VERSIONS = 8
MAX_HOST_VERSIONS = 256  # unnamed (in-memory only) versions kept for reloading
MAX_LIVE_PER_ENGINE = 64  # requests one engine holds (the rest wait in the queue for any replica)
# One worker-thread call runs engine steps back to back for at most this long, so that the
# event loop's round trip is paid per call rather than per token; anything that arrives for
# the actor ends the call after the step that runs, so a request still joins within one step.
# The bound is how late a device turn that ended is noticed (turns last seconds:
# `timeslice_quantum_s`), and how long a group's end waits for the call.
STEPS_CALL_S = 0.1
MAX_REPLICAS = 8  # the openrl.sampler_replicas range (settings.py)

# How a replica is picked for the next request: see the module docstring.
Routing = Literal["prefix", "least_loaded"]


class Sample(msgspec.Struct, frozen=True):
    request_id: str
    version: str | None  # None: the base model (ignored when inflight_model is set)
    job: SampleJob
    source_dir: str | None = None  # where the version's adapter lies on disk, if it does
    sampler_id: str = ""  # the sampling session, "<session>:sample:<n>"
    inflight_model: str | None = None  # an inflight session: this training model's newest published weights
    record_ids: tuple[str, ...] | None = None  # record_stability_info: the sequence ids to record under


def inflight_version_name(model_id: str, number: int) -> str:
    """The version name of a training model's `number`-th inflight weights."""
    return f"{model_id}/inflight/{number}"


class _InflightTarget(msgspec.Struct, frozen=True):
    number: int
    version: str
    tensors: WeightPayload
    spec: LoraSpec


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
    requests_by_replica: tuple[int, ...] = ()  # requests each replica's engine finished
    inflight_targets: int = 0  # training models with published inflight weights
    device: str = ""  # the device the sampler runs on ("" when it has no device lease)
    lease: WorkerLeaseStatistics | None = None  # its turns on that device (time-slicer)
    last_sync: SyncStats | None = None  # full fine-tuning: the last sync that landed, with its apply time
    syncs: int = 0  # weight syncs that landed in this sampler
    sync_bytes: int = 0  # bytes those syncs moved (delta indices + values, or whole tensors)
    routing: str = "prefix"  # how a replica is picked: "prefix" or "least_loaded"
    routed_by_prefix: int = 0  # requests sent to a replica that had served a prefix of their prompt
    routed_by_load: int = 0  # the other requests
    routed_prefix_tokens: int = 0  # prompt tokens those replicas had served (the router's guess of the hits)
    prompt_tokens: int = 0  # prompt tokens of the requests taken into engines
    prompt_cache_hit_tokens: int = 0  # of those, the tokens the engines reported reused from a cache
    memory: EngineMemory = EngineMemory()  # its host memory by part (actors/host_memory.py)


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

    def peek(self) -> Sample:
        """The oldest waiting request, left waiting."""
        return self._waiting[0]

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

    def waiting(self) -> list[Sample]:
        """The requests waiting, oldest first."""
        return list(self._waiting)

    def request_ids(self) -> list[str]:
        """Every request still here, waiting or running."""
        return [op.request_id for op in self._waiting] + sorted(self._running)

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
        self.held: OrderedDict[str, tuple[WeightPayload, LoraSpec | None]] = OrderedDict()

    def remember(self, version: str, tensors: WeightPayload, spec: LoraSpec | None) -> None:
        self.held[version] = (tensors, spec)
        self.held.move_to_end(version)
        while len(self.held) > self._max_host:
            self.held.popitem(last=False)


# ---------------------------------------------------------------------------
# Handle


class SamplerHandle:
    def __init__(self, actor: SamplerActor) -> None:
        self._actor = actor

    def submit_nowait(self, op: Sample) -> None:
        """Queue a sample or raise TooManyRequests (429); never waits."""
        self._actor.submit_nowait(op)

    def cancel(self, request_id: str) -> bool:
        """Free a request's queued or running work; False if this sampler does not hold it."""
        return self._actor.cancel(request_id)

    async def publish_version(self, version: str, tensors: WeightPayload, spec: LoraSpec | None) -> None:
        self._actor.publish_version(version, tensors, spec)

    async def publish_inflight(self, model_id: str, sampler_id: str, tensors: WeightPayload, spec: LoraSpec) -> int:
        """Make `tensors` `model_id`'s inflight target and `sampler_id`'s floor; returns its number."""
        return self._actor.publish_inflight(model_id, sampler_id, tensors, spec)

    async def ensure_replicas(self, replicas: int) -> None:
        """Run at least `replicas` engines (at most MAX_REPLICAS); returns once they serve."""
        await self._actor.ensure_replicas(replicas)

    def fail_pending(self, error: OpenrldError) -> None:
        """Fail every request the sampler still holds with `error` (its group ended)."""
        self._actor.fail_pending(error)

    def end_job(self, model_id: str, sampler_ids: Collection[str]) -> None:
        """Training job `model_id` ended while the group serves on: the versions only it published go,
        `sampler_ids` being the sampling sessions it saved unnamed or inflight weights for. Never waits."""
        self._actor.end_job(model_id, sampler_ids)

    def statistics(self) -> SamplerStatistics:
        return self._actor.statistics()


# ---------------------------------------------------------------------------
# Actor


class _Worker:
    """One engine and the versions it holds."""

    def __init__(
        self, engine: SamplerEngine, thread: EngineThread, index: int, max_loaded: int = MAX_LOADED_VERSIONS
    ) -> None:
        self.engine = engine
        self.thread = thread  # the engine's own thread: every call that computes runs on it, in order
        self.index = index  # its place among the actor's replicas, and in the router's records
        self.versions = VersionCache(max_loaded)
        # Versions to load before anything else, in publish order (eager_versions only).
        self.deliveries: deque[tuple[str, WeightPayload, LoraSpec | None]] = deque()
        self.live: set[str] = set()  # request ids inside the engine
        self.taking = 0  # requests taken from the queue and being admitted (their versions loading)
        self.busy = False
        self.requests_done = 0
        self.prefix_bound: int | None = None  # the prefix cache bound applied to its engine last
        self.state_bytes = 0  # its engine's state in host memory (a CPU device), measured last
        self.most_versions = 0  # the most versions its engine has held: past it, adapters are reused
        self.parked_bytes = 0  # what its engine's last park copied into host memory
        # Versions of ended jobs to drop from its engine in its next turn, each once no live request samples it
        self.doomed: set[str] = set()
        self.wake = trio.Event()  # set when there may be work for it


class SamplerActor:
    def __init__(
        self,
        *,
        name: str,
        build_engine: Callable[[], SamplerEngine],
        limiter: trio.CapacityLimiter,
        futures: FutureTable,
        queue_limit: int,
        replicas: int = 1,
        stability: StabilityRecords | None = None,
        max_loaded_versions: int = MAX_LOADED_VERSIONS,
        max_host_versions: int = MAX_HOST_VERSIONS,
        eager_versions: bool = False,
        lease_from: Callable[[Parkable], DeviceLease] | None = None,
        routing: Routing = "prefix",
        host_memory: HostMemory | None = None,
    ) -> None:
        assert 1 <= replicas <= MAX_REPLICAS, f"replicas must be in 1..{MAX_REPLICAS}, got {replicas}"
        assert routing in ("prefix", "least_loaded"), f"routing must be 'prefix' or 'least_loaded', got {routing!r}"
        self.name = name
        self.queue = SampleQueue(queue_limit)
        self.host = HostVersions(max_host_versions)
        self._max_loaded = max_loaded_versions
        # Full fine-tuning: each published version goes into every engine at once, in order,
        # because its payload may be a delta from the one before (gpu/delta.py).
        self._eager_versions = eager_versions
        self._last_sync: SyncStats | None = None
        self._syncs = 0
        self._sync_bytes = 0
        self.stability = stability if stability is not None else StabilityRecords()
        self._inflight: dict[str, _InflightTarget] = {}  # training model id -> its newest inflight weights
        self._inflight_floor: dict[str, int] = {}  # inflight sampling session id -> the number its save made
        self._recording: dict[str, tuple[Sample, str | None]] = {}  # request id -> (op, bound version)
        self._nursery: trio.Nursery | None = None
        self._growing: trio.Lock | None = None
        self._build_engine = build_engine
        self._limiter = limiter
        self._futures = futures
        self._replicas = replicas
        self._workers: list[_Worker] = []
        self._done = 0
        self._failed = 0
        # The device lease, taken once the engines exist (the time-slicer parks them through this actor).
        self._lease_from = lease_from
        self._lease: DeviceLease | NoLease = NoLease()
        self._parked_workers: list[_Worker] = []  # replicas whose engines are parked, in park order
        self._arrivals = 0  # submissions, cancels and deliveries so far
        self._routing = routing
        # Which prefixes each replica served. Recorded under both policies, so that their statistics compare.
        self._router = PrefixRouter(0)
        # ((request id, version), block hashes) of the last request routed: the queue's head.
        self._head_blocks: tuple[tuple[str, str | None], tuple[bytes, ...]] | None = None
        self._prompt_tokens = 0
        self._prompt_cache_hit_tokens = 0
        # The node's budget; None: the engines keep the prefix cache bound they were built with.
        self._memory = host_memory
        self._memory_key = ("sampler", name)

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
        self._arrivals += 1  # read by the worker threads' `run_steps`: a plain int, set only here
        for worker in self._workers:
            worker.wake.set()

    def publish_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        self.host.remember(version, payload, spec)
        if self._eager_versions:
            for worker in self._workers:
                worker.deliveries.append((version, payload, spec))
            self._wake_all()

    def publish_inflight(self, model_id: str, sampler_id: str, tensors: WeightPayload, spec: LoraSpec) -> int:
        previous = self._inflight.get(model_id)
        number = 1 if previous is None else previous.number + 1
        self._inflight[model_id] = _InflightTarget(number, inflight_version_name(model_id, number), tensors, spec)
        self._inflight_floor[sampler_id] = number
        logger.info("inflight weights published group=%s model_id=%s number=%d", self.name, model_id, number)
        return number

    async def ensure_replicas(self, replicas: int) -> None:
        assert self._growing is not None and self._nursery is not None, "ensure_replicas before run"
        async with self._growing:
            while len(self._workers) < min(replicas, MAX_REPLICAS):
                # In the sampler's turn: while it is parked, another party holds the device.
                async with self._lease.hold(has_more=lambda: False):
                    worker = await self._add_worker()
                self._nursery.start_soon(self._work, worker)
                logger.info("sampler replica added group=%s replicas=%d", self.name, len(self._workers))

    async def _add_worker(self) -> _Worker:
        """A replica: its engine thread, and the engine built on it."""
        thread = EngineThread(f"sampler {self.name} {len(self._workers)}", release_when_idle=on_cpu(self._lease.device))
        try:
            async with self._limiter:
                engine = await thread.call(self._build_engine)
        except BaseException:
            thread.stop()
            raise
        worker = _Worker(engine, thread, self._router.add_replica(), self._max_loaded)
        assert worker.index == len(self._workers), (worker.index, len(self._workers))
        self._workers.append(worker)
        if self._memory is not None:
            self._memory.set_prefix_caches(self._memory_key, len(self._workers), self._wake_all)
            await self._measure_state(worker)
            await self._bound_prefix_cache(worker)
        return worker

    async def _measure_state(self, worker: _Worker) -> None:
        """Tell the ledger what the engines hold in host memory (on a CPU device; 0 elsewhere), with
        `worker`'s measured anew: when it was built, and when its engine made an adapter for a version."""
        assert self._memory is not None
        measure = getattr(worker.engine, "host_state_bytes", None)  # None: a worker in another process
        if measure is not None:
            worker.state_bytes = await worker.thread.call(measure)
        self._memory.state(self._memory_key, sum(w.state_bytes for w in self._workers))

    async def _bound_prefix_cache(self, worker: _Worker) -> None:
        """Apply the node's current prefix cache share to `worker`'s engine, in its thread."""
        assert self._memory is not None
        share = self._memory.prefix_cache_share()
        bound = getattr(worker.engine, "bound_prefix_cache", None)  # None: an engine with no prefix cache
        worker.prefix_bound = share
        if bound is not None:
            self._memory.prefix_cache_held(self._memory_key, worker.index, await worker.thread.call(bound, share))

    def _bound_is_stale(self, worker: _Worker) -> bool:
        return self._memory is not None and worker.prefix_bound != self._memory.prefix_cache_share()

    async def _in_thread(self, worker: _Worker, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the worker's engine thread, in the device's turn."""
        async with self._limiter:
            return await worker.thread.call(fn, *args)

    # -- the loops ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[SamplerHandle] = trio.TASK_STATUS_IGNORED) -> None:
        if self._lease_from is not None:
            self._lease = self._lease_from(self)
        try:
            # Loading the weights onto the device is a turn: another party on the device parks first.
            async with self._lease.hold(has_more=lambda: False):
                for _ in range(self._replicas):
                    await self._add_worker()
            logger.info("sampler ready group=%s replicas=%d", self.name, self._replicas)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._growing = trio.Lock()
                for worker in self._workers:
                    nursery.start_soon(self._work, worker)
                task_status.started(SamplerHandle(self))
        finally:
            self._lease.close()  # a stopped worker takes no more turns
            if self._memory is not None:
                self._memory.forget(self._memory_key)
            # Shielded: a stopping group still frees what its engines hold (vLLM's engine process).
            with trio.CancelScope(shield=True):
                for worker in self._workers:
                    await worker.thread.call(worker.engine.close)
                    worker.thread.stop()

    def end_job(self, model_id: str, sampler_ids: Collection[str]) -> None:
        """Forget the versions that belong to ended job `model_id` alone: its unnamed ones (named by
        `sampler_ids`) and its inflight ones, held on the host, and those and its checkpoints' versions
        (`tinker://<model_id>/…`) in the engines. A checkpoint's version loads again from its files for a
        sampling client made from its path; a version that a waiting request names stays on the host, and
        one that a running request samples leaves its engine once that request is done (`_drop_doomed`)."""
        sampler_ids = set(sampler_ids)
        waiting = {(op.version, op.inflight_model) for op in self.queue.waiting()}
        for version in sampler_ids:
            if (version, None) not in waiting:
                self.host.held.pop(version, None)
            self._inflight_floor.pop(version, None)
        if all(inflight != model_id for _, inflight in waiting):
            self._inflight.pop(model_id, None)
        prefixes = (f"{model_id}/inflight/", f"tinker://{model_id}/")
        for worker in self._workers:
            worker.doomed |= {v for v in worker.versions.loaded if v in sampler_ids or v.startswith(prefixes)}
        self._wake_all()

    async def _drop_doomed(self, worker: _Worker) -> None:
        """Drop the ended jobs' versions that `worker`'s engine holds and no live request samples (its thread is idle)."""
        pinned = worker.engine.versions_in_use()
        for version in sorted(worker.doomed - pinned):
            worker.doomed.discard(version)
            if version in worker.versions.loaded:
                del worker.versions.loaded[version]
                await self._in_thread(worker, worker.engine.drop_version, version)
                logger.info("sampler dropped an ended job's version group=%s version=%s", self.name, version)

    def fail_pending(self, error: OpenrldError) -> None:
        for request_id in self.queue.request_ids():
            self._recording.pop(request_id, None)
            self._futures.fail(request_id, error)  # a no-op for one that already resolved

    async def _work(self, worker: _Worker) -> None:
        """Input, then step: apply cancels, admit, run one engine step, resolve what finished.

        Everything that touches the engine's device runs while holding the device
        lease; past its turn (`is_due`) the worker admits nothing new and lets the
        requests it runs finish, so that it can park between requests.
        """
        while True:
            for request_id in self.queue.take_cancels(worker.live):
                worker.engine.cancel(request_id)
                worker.live.discard(request_id)
                self._recording.pop(request_id, None)
            if self._bound_is_stale(worker):  # the node's share changed: evict now, not at the next request
                await self._bound_prefix_cache(worker)
            if not self._wants_device(worker):
                await worker.wake.wait()
                worker.wake = trio.Event()
                continue
            async with self._lease.hold(has_more=lambda: self._wants_device(worker)):
                await self._turn(worker)

    def _can_admit(self, worker: _Worker) -> bool:
        if not self.queue.has_waiting() or len(worker.live) >= MAX_LIVE_PER_ENGINE:
            return False
        if self._routing == "least_loaded":
            return self._least_loaded(worker)
        return self._routed_to(self.queue.peek()) is worker

    def _wants_device(self, worker: _Worker) -> bool:
        # A doomed version is pinned only by a live request, and then the engine has work: no idle spin.
        return bool(worker.deliveries) or bool(worker.doomed) or self._can_admit(worker) or worker.engine.has_work()

    async def _turn(self, worker: _Worker) -> None:
        """One step of `worker`'s engine, with the versions and requests it takes first."""
        while worker.deliveries:
            await self._deliver(worker, *worker.deliveries.popleft())
        if worker.doomed:
            await self._drop_doomed(worker)
        admitted = False
        while self._can_admit(worker) and not self._lease.is_due():
            op = self.queue.take()
            self._router.assign(worker.index, self._blocks_of(op))
            self._prompt_tokens += len(op.job.prompt)
            worker.taking += 1
            try:
                await self._admit(worker, op)
            finally:
                worker.taking -= 1
            admitted = True
        if admitted and self._routing == "prefix" and len(self._workers) > 1 and self.queue.has_waiting():
            # The new head may be another replica's; it must look now, not after its running call.
            self._wake_all()
        if not worker.engine.has_work():
            return
        worker.busy = True
        seen = self._arrivals
        token = trio.lowlevel.current_trio_token()
        # From the worker thread, without waiting: the callbacks run in order, before the
        # call's own return (trio reports a thread's result through the same queue).
        settle = lambda finished: token.run_sync_soon(self._settle, worker, finished)  # noqa: E731
        share = self._memory.prefix_cache_share() if self._memory is not None else None
        try:
            held = await self._in_thread(
                worker, run_steps, worker.engine, lambda: self._arrivals != seen, settle, STEPS_CALL_S, share
            )
            if self._memory is not None and held is not None:  # the steps may have cached prefixes
                worker.prefix_bound = share
                self._memory.prefix_cache_held(self._memory_key, worker.index, held)
        except EngineLost as error:  # a worker that died or broke the protocol: its requests fail, another takes over
            self._fail_all(worker, error)
            await self._replace_engine(worker, error)
        except Exception as error:  # a failed step fails its batch; the engine starts empty again
            logger.exception("sampler step failed group=%s", self.name)
            self._fail_all(worker, ServerError(f"sampling step failed: {type(error).__name__}: {error}"))
            return
        finally:
            worker.busy = False

    async def _replace_engine(self, worker: _Worker, error: EngineLost) -> None:
        """The worker's engine is gone: build another in its place, holding no versions yet.

        Versions held on the host load into it again when sampled; a full fine-tuning
        group's delta chain does not, so its later versions fail until the job saves anew.
        """
        logger.error("sampler engine lost group=%s: %s", self.name, error.detail)
        lost = worker.engine
        await worker.thread.call(lost.close)
        try:
            worker.engine = await self._in_thread(worker, self._build_engine)
        except Exception:  # its next step fails again, and this is tried again then
            logger.exception("sampler engine rebuild failed group=%s", self.name)
            return
        worker.versions = VersionCache(self._max_loaded)
        worker.prefix_bound = None  # the new engine has the bound it was built with until told the node's share
        worker.most_versions = 0
        if self._memory is not None:
            await self._measure_state(worker)
        self._router.forget(worker.index)
        if worker in self._parked_workers:  # the new engine is resident
            self._parked_workers.remove(worker)
        logger.info("sampler engine rebuilt group=%s", self.name)

    def _settle(self, worker: _Worker, finished: list[Finished]) -> None:
        """Resolve the requests one engine step finished (a callback of the event loop's, run
        while the worker's next step may already be running; it must not raise)."""
        for done in finished:
            worker.live.discard(done.request_id)
            self.queue.done(done.request_id)
            if done.error is not None or done.result is None:
                self._failed += 1
                self._recording.pop(done.request_id, None)
                self._futures.fail(done.request_id, done.error or ServerError("the sampler returned no result"))
                continue
            self._done += 1
            worker.requests_done += 1
            self._prompt_cache_hit_tokens += done.result.prompt_cache_hit_tokens
            try:
                self._record(done.request_id, done.result)
            except Exception:  # a record is bookkeeping; the caller still gets its result
                logger.exception("stability record failed request=%s", done.request_id)
            self._futures.resolve(done.request_id, Completed(done.result))

    # The time-slicer's calls (Parkable): every replica's engine moves in its worker thread.
    async def park(self) -> bool:
        if any(worker.live for worker in self._workers):
            return False  # requests mid-decode would lose their KV cache; they finish first
        for worker in self._workers:
            if worker not in self._parked_workers:
                worker.parked_bytes = (await self._in_thread(worker, worker.engine.park)).bytes_moved
                self._parked_workers.append(worker)
                self._router.forget(worker.index)  # parking drops the engine's caches, its prefix cache too
                if self._memory is not None:
                    self._memory.prefix_cache_held(self._memory_key, worker.index, 0)
        if self._memory is not None:
            parked = sum(w.parked_bytes for w in self._parked_workers)
            await park_within_budget(self._memory, self._memory_key, parked, self._spill_parked)
        return True

    async def _spill_parked(self, directory: str) -> int:
        """Past the node's budget: every parked engine's host copies to disk (`spill_parked`); the bytes."""
        moved = 0
        for worker in self._parked_workers:
            spill = getattr(worker.engine, "spill_parked", None)  # None: an engine that cannot spill
            if spill is not None:
                moved += await self._in_thread(worker, spill, directory)
        return moved

    async def resume(self) -> None:
        # Only the engines it parked: a replica added meanwhile was built on the device.
        while self._parked_workers:
            worker = self._parked_workers[0]
            await self._in_thread(worker, worker.engine.resume)
            self._parked_workers.pop(0)
        if self._memory is not None:
            self._memory.parked(self._memory_key, 0)

    def _least_loaded(self, worker: _Worker) -> bool:
        # Spread requests over replicas: only a worker holding no more than any other admits.
        return len(worker.live) <= min(len(w.live) for w in self._workers)

    def _routed_to(self, op: Sample) -> _Worker | None:
        """The replica the prefix router picks for `op` now; None when every replica is full."""
        loads = [len(w.live) + w.taking for w in self._workers]
        choice = self._router.choose(self._blocks_of(op), loads, [load < MAX_LIVE_PER_ENGINE for load in loads])
        return None if choice is None else self._workers[choice.replica]

    def _blocks_of(self, op: Sample) -> tuple[bytes, ...]:
        """`op`'s prompt block hashes under the version it would sample from now (kept for the
        queue's head, which every worker asks about in turn)."""
        version = op.version
        if op.inflight_model is not None:
            target = self._inflight.get(op.inflight_model)
            version = None if target is None else target.version
        key = (op.request_id, version)
        if self._head_blocks is None or self._head_blocks[0] != key:
            blocks = prefix_block_hashes(version, op.job.prompt, self._router.block_tokens)
            self._head_blocks = (key, blocks)
        return self._head_blocks[1]

    async def _admit(self, worker: _Worker, op: Sample) -> None:
        try:
            version = self._bind(op)
            if version is not None:
                await self._ensure_loaded(worker, version, op.source_dir)
            # Validation and per-sample RNG set-up only: cheap enough for the event loop,
            # and the engine is idle between steps.
            worker.engine.add(op.request_id, version, op.job)
        except EngineLost as error:  # its version could not load: the worker is gone
            self.queue.done(op.request_id)
            self._failed += 1
            self._futures.fail(op.request_id, error)
            await self._replace_engine(worker, error)
            return
        except (OpenrldError, KeyError, ValueError) as error:
            self.queue.done(op.request_id)
            self._failed += 1
            if not isinstance(error, OpenrldError):
                error = BadRequest(str(error))
            self._futures.fail(op.request_id, error)
            return
        except Exception as error:  # a bug met by one request fails that request; the sampler and daemon serve on
            logger.exception("sampler admit failed group=%s request_id=%s", self.name, op.request_id)
            self.queue.done(op.request_id)
            self._failed += 1
            detail = f"sampling request not started: {type(error).__name__}: {error}"
            self._futures.fail(op.request_id, ServerError(detail))
            return
        worker.live.add(op.request_id)
        if op.record_ids is not None:
            self._recording[op.request_id] = (op, version)

    def _bind(self, op: Sample) -> str | None:
        """The version `op` samples from: its own, or (inflight) its model's newest published one."""
        if op.inflight_model is None:
            return op.version
        target = self._inflight.get(op.inflight_model)
        floor = self._inflight_floor.get(op.sampler_id)
        if target is None or floor is None or target.number < floor:
            raise Gone(
                f"inflight sampling session {op.sampler_id}: its weights are not published on this sampler "
                "(the daemon restarted?); save them again with save_weights_and_get_sampling_client"
            )
        return target.version

    def _record(self, request_id: str, result: SampleResult) -> None:
        """Keep the stability records of a finished request that asked for them."""
        entry = self._recording.pop(request_id, None)
        if entry is None:
            return
        op, version = entry
        assert op.record_ids is not None and len(op.record_ids) == len(result.sequences)
        now = trio.current_time()
        params = op.job.params
        for sequence_id, sequence in zip(op.record_ids, result.sequences):
            self.stability.add(
                StabilityRecord(
                    sequence_id=sequence_id, session_id=op.sampler_id.split(":", 1)[0], sampler_id=op.sampler_id,
                    base_model=self.name, version=version, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p, prompt=op.job.prompt, tokens=sequence.tokens, logprobs=sequence.logprobs,
                ),
                now,
            )

    async def _ensure_loaded(self, worker: _Worker, version: str, source_dir: str | None) -> None:
        worker.doomed.discard(version)  # sampled again (a checkpoint's, by its path): it stays
        if worker.versions.touch(version):
            return
        held = self.host.held.get(version)
        for target in self._inflight.values():
            if held is None and target.version == version:
                held = (target.tensors, target.spec)
        if held is not None:
            await self._in_thread(worker, worker.engine.load_version, version, *held)
        elif source_dir is not None:
            # The engine reads its own checkpoint files: a LoRA adapter, or full-model weights.
            await self._in_thread(worker, worker.engine.load_checkpoint, version, Path(source_dir))
        else:
            raise Gone(f"sampler weights {version} are no longer held; save them again")
        for old in worker.versions.admit(version, pinned=worker.engine.versions_in_use()):
            await self._in_thread(worker, worker.engine.drop_version, old)
        if self._memory is not None and len(worker.versions.loaded) > worker.most_versions:
            worker.most_versions = len(worker.versions.loaded)  # a new adapter; later versions reuse them
            await self._measure_state(worker)

    async def _deliver(self, worker: _Worker, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        """Load a just-published version into the worker's engine (eager_versions).

        Evictions come first, so that a version on its way out is not copied aside by an
        engine that patches its weights in place. A failed load (a weight-sync digest
        mismatch among them) is logged with its traceback; requests for the version then
        fail when they try to load it.
        """
        for old in worker.versions.admit(version, pinned=worker.engine.versions_in_use()):
            await self._in_thread(worker, worker.engine.drop_version, old)
        try:
            await self._in_thread(worker, worker.engine.load_version, version, payload, spec)
        except Exception:  # the sync's failure is the version's; the sampler keeps serving others
            logger.exception("weight version delivery failed group=%s version=%s", self.name, version)
            worker.versions.loaded.pop(version, None)
            return
        sync = worker.engine.last_sync  # a full sampler records it; a LoRA one has none
        # A version loaded from a checkpoint leaves the engine's last sync as it was: count it once.
        if sync is not None and sync is not self._last_sync:
            self._last_sync = sync
            self._syncs += 1
            self._sync_bytes += sync.bytes_moved

    def _fail_all(self, worker: _Worker, error: OpenrldError) -> None:
        for request_id in sorted(worker.live):
            worker.engine.cancel(request_id)
            self._recording.pop(request_id, None)
            self.queue.done(request_id)
            self._failed += 1
            self._futures.fail(request_id, error)
        worker.live.clear()

    def statistics(self) -> SamplerStatistics:
        waiting, running = self.queue.counts()
        routes = self._router.statistics()
        return SamplerStatistics(
            queue_depth=waiting + running,
            waiting=waiting,
            running=running,
            replicas=len(self._workers),
            loaded_versions=sum(len(w.versions.loaded) for w in self._workers),
            host_versions=len(self.host.held),
            samples_done=self._done,
            samples_failed=self._failed,
            samples_cancelled=self.queue.cancelled,
            samples_refused=self.queue.refused,
            busy=any(w.busy for w in self._workers),
            requests_by_replica=tuple(w.requests_done for w in self._workers),
            inflight_targets=len(self._inflight),
            device=self._lease.device,
            lease=self._lease.statistics() if isinstance(self._lease, DeviceLease) else None,
            last_sync=self._last_sync,
            syncs=self._syncs,
            sync_bytes=self._sync_bytes,
            routing=self._routing,
            routed_by_prefix=routes.routed_by_prefix,
            routed_by_load=routes.routed_by_load,
            routed_prefix_tokens=routes.routed_prefix_tokens,
            prompt_tokens=self._prompt_tokens,
            prompt_cache_hit_tokens=self._prompt_cache_hit_tokens,
            memory=self._memory.of(self._memory_key) if self._memory is not None else EngineMemory(),
        )


def run_steps(
    engine: SamplerEngine,
    interrupted: Callable[[], bool],
    settle: Callable[[list[Finished]], None],
    seconds: float = STEPS_CALL_S,
    prefix_bound: int | None = None,
) -> int | None:
    """Engine steps back to back in one worker-thread call (never in the event loop).

    What a step finished goes to `settle` at once, and the steps go on: the batch
    does not stand still while the event loop resolves a finished request. Stops when
    the engine ran out of work, `interrupted()` turned true (something arrived that
    the actor must hand the engine between steps), or `seconds` passed.

    Returns:
        With `prefix_bound` (the node's share) and an engine with a prefix cache: the bytes
        its cache holds once held to that bound, in this same call; else None.
    """
    deadline = time.monotonic() + seconds
    while True:
        finished = engine.step()
        if finished:
            settle(finished)
        if not engine.has_work() or interrupted() or time.monotonic() >= deadline:
            break
    bound = getattr(engine, "bound_prefix_cache", None) if prefix_bound is not None else None
    return bound(prefix_bound) if bound is not None else None

