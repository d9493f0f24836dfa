"""Worker groups: one trainer and one sampler per base model on this node.

Every LoRA job on a base model shares its group (many adapters, one resident
model); a full fine-tuning run gets a group of its own, keyed by its run id, which
also serves sampling from that run's checkpoints. A group starts on first use;
concurrent first users wait for the same start, and a failed start is reported to
each of them and retried by the next.
Each group's actors run in a cancel scope of their own, in the table's nursery.
A job's own group ends with the job (`end`: its session finished, or its creation
failed): its actors stop, the requests they hold fail, their device leases are
given back, and once they have stopped its devices are free for the next job.
A LoRA group shared by a base model's jobs lives as long as the table; a job of
it that ends leaves it (`end_shared_job`): the job's adapter and the weight
versions it alone published are dropped, so the group holds only live jobs.

Devices: a group's trainer and sampler are placed on the node's devices by
`actors/device_pool.py` when the group starts (or, for an `openrl.exclusive`
job, when the job is created: `reserve`), and each takes a lease from its
device's time-slicer. A LoRA group's two workers share one party (they fit
together and never park for each other); a full fine-tuning job's trainer and
sampler are two parties, so on one device they take turns, one parked.

An Automodel job (openrl.trainer_backend=automodel) has a group of its own whose
trainer is NeMo Automodel's, a torchrun group with one rank per device it was
placed on (openrl.trainer_gpus); its sampler is the kind its fine-tuning type
samples with. To the actors the whole torchrun group is one engine: it holds the
lease of every device it spans while it runs (`actors/group_lease.py`), and a park
or resume reaches every rank at once (rank 0 broadcasts each call,
`worker/ranks.py`). Unless the job is exclusive its devices are shared: other
groups take turns with it on each of them.

An Automodel trainer wider than this node spans nodes (`attach_spans`): `reserve`
plans it from the cluster view (`cluster/placement/spanning.py`, this node the home)
and books this node's part, exclusive; when the group starts, each member node is
asked to hold its devices and start its ranks (`actors/span_members.py`), then this
node's torchrun hosts the rendezvous (`[workers] rendezvous_port`) and rank 0. The job
is lost (`on_lost`) when a member's ranks end or a member node is declared dead; when
its group ends, every member is told to stop its ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from functools import partial
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import msgspec
import trio

from openrld.actors.device_pool import NodeDevices, Placement
from openrld.actors.futures import FutureTable
from openrld.actors.group_lease import GroupLease
from openrld.actors.host_memory import HostMemory
from openrld.actors.job_registry import NO_IMAGES, Automodel, Images
from openrld.actors.sampler import (
    MAX_HOST_VERSIONS,
    MAX_LOADED_VERSIONS,
    Routing,
    SamplerActor,
    SamplerHandle,
    SamplerStatistics,
)
from openrld.actors.span_members import SpanOrder
from openrld.actors.stability import StabilityRecords
from openrld.actors.timeslicer import DeviceLease, Parkable
from openrld.actors.trainer import CheckpointSink, TrainerActor, TrainerHandle, TrainerStatistics
from openrld.engine_types import SamplerEngine, TrainerEngine
from openrld.errors import Gone, OpenrldError, ServerError
from openrld.model_catalog import ModelEntry
from openrld.worker.launchers.torchrun import SpanRendezvous

if TYPE_CHECKING:
    from openrld.cluster.placement.span_peers import SpanPeers
    from openrld.cluster.placement.spanning import SpanPlan

logger = logging.getLogger(__name__)


class EngineFactory(Protocol):
    """Builds engines for a model; called in a worker thread. Lives outside actors/ (it imports torch)."""

    # `image`: the job's own image for that worker (openrl.trainer_backend, sampler_backend); `job` names it.
    def trainer(
        self, model: ModelEntry, image: str | None = None, job: str | None = None
    ) -> Callable[[], TrainerEngine]: ...
    def sampler(
        self, model: ModelEntry, image: str | None = None, job: str | None = None
    ) -> Callable[[], SamplerEngine]: ...
    def full_trainer(
        self, model: ModelEntry, weight_sync: str, image: str | None = None, job: str | None = None
    ) -> Callable[[], TrainerEngine]: ...
    def full_sampler(
        self, model: ModelEntry, image: str | None = None, job: str | None = None
    ) -> Callable[[], SamplerEngine]: ...
    def automodel_trainer(
        self, model: ModelEntry, *, devices: tuple[str, ...], fine_tuning: str, weight_sync: str, cp: int,
        job: str | None = None, span: SpanRendezvous | None = None,
    ) -> Callable[[], TrainerEngine]: ...
    def on(self, device: str) -> EngineFactory: ...


# A full fine-tuning group's sampler holds whole copies of the weights per version, so it
# keeps few: the newest versions are what an RL loop samples; older unnamed ones answer 410.
FULL_LOADED_VERSIONS = 2
SPAN_WATCH_S = 0.5  # how often a span's members are looked up in the cluster view (which lags gossip by less)
SPAN_STOP_S = 40.0  # how long a span's end waits for its members to stop their ranks
FULL_HOST_VERSIONS = 4


class Group(msgspec.Struct, frozen=True):
    model: ModelEntry
    trainer: TrainerHandle
    sampler: SamplerHandle
    job: str | None = None  # the full fine-tuning run it serves alone; None: the base model's LoRA group


class OwnGroup(msgspec.Struct, frozen=True):
    """A job's own group, booked at the job's creation."""

    job: str
    full_sync: str | None  # full fine-tuning's weight_sync; None: a LoRA group of its own (exclusive, image)
    is_exclusive: bool
    images: Images = NO_IMAGES  # openrl.trainer_backend / sampler_backend=<image>: its workers run from them
    automodel: Automodel | None = None  # openrl.trainer_backend=automodel: its trainer's ranks and cp
    # Called with the error's detail when its trainer engine is lost (a process or a rank died); the
    # job is over, and the caller ends the group. None: the trainer is rebuilt, as a shared group's is.
    on_lost: Callable[[str], None] | None = None


# The lease a seat's worker takes turns with: a trainer's may span several devices, a sampler's never does.
Lease = TypeVar("Lease", bound=DeviceLease | GroupLease)


class _Seat(msgspec.Struct, Generic[Lease], frozen=True):
    """Where one worker of a group runs."""

    engines: EngineFactory  # building on the worker's device
    limiter: trio.CapacityLimiter
    lease_from: Callable[[Parkable], Lease] | None  # None: the node has no time-slicers
    devices: tuple[str, ...] = ()  # a torchrun trainer's, one per rank; (): the node has no device pool


class GroupStatistics(msgspec.Struct, frozen=True):
    base_model: str
    trainer: TrainerStatistics
    sampler: SamplerStatistics


class GroupTable:
    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        engines: EngineFactory,
        limiter: trio.CapacityLimiter,
        futures: FutureTable,
        checkpoints: CheckpointSink,
        sample_queue_limit: int,
        devices: NodeDevices | None = None,
        sampler_routing: Routing = "prefix",
        rendezvous_port: int = 29400,
        host_memory: HostMemory | None = None,
    ) -> None:
        self._nursery = nursery
        # The node's host-memory budget, which every group's sampler and trainer report to and the
        # samplers' prefix caches keep within (actors/host_memory.py); None: no budget, no accounting.
        self.host_memory = host_memory
        # The node's devices: placement, time-slicers, a limiter each. None: one device, `limiter`, no turns.
        self._devices = devices
        self._own: dict[str, OwnGroup] = {}  # group key -> how the job's own group is made
        self._engines = engines
        self._limiter = limiter
        self._futures = futures
        self._checkpoints = checkpoints
        self._sample_queue_limit = sample_queue_limit
        self._sampler_routing = sampler_routing  # config sampler_routing: how a sampler picks a replica
        self._groups: dict[str, Group] = {}
        self._starting: dict[str, trio.Event] = {}
        self._start_errors: dict[str, str] = {}
        # The cancel scope of each group running or starting: `end` cancels it to stop the actors.
        self._scopes: dict[str, trio.CancelScope] = {}
        # Ended groups whose actors have not stopped yet: a new start of the same key waits for them.
        self._stopping: dict[str, trio.Event] = {}
        # One node-wide store: every group's sampler records into it, the job table resolves from it.
        self.stability = StabilityRecords()
        self._span_peers: SpanPeers | None = None  # None: no trainer here spans nodes
        self._rendezvous_port = rendezvous_port  # the first of the ports a span's rendezvous takes here
        self._spans: dict[str, SpanPlan] = {}  # group key -> the nodes its trainer spans, this node first
        self._span_ports: dict[str, int] = {}  # group key -> its rendezvous port
        self._span_devices: dict[str, tuple[str, ...]] = {}  # group key -> its members' devices, "node/device"

    def attach_spans(self, peers: SpanPeers) -> None:
        """The cluster is up: an Automodel trainer wider than this node may span nodes through `peers`."""
        self._span_peers = peers

    def reserve(
        self, model: ModelEntry, job: str, *, full_sync: str | None, exclusive: bool, images: Images = NO_IMAGES,
        automodel: Automodel | None = None, on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """Book devices now for `job`'s own group (exclusive, an image, Automodel, or full fine-tuning), before it starts.

        Placement is synchronous, so two jobs created at once never book one free device.

        Raises:
            BadRequest: exclusive, and no device of this node is free (key `openrl.exclusive`); or
                fewer free devices than its Automodel trainer's ranks (key `openrl.trainer_gpus`).
        """
        key = _group_key(model, job)
        self._own[key] = OwnGroup(
            job=job, full_sync=full_sync, is_exclusive=exclusive, images=images, automodel=automodel, on_lost=on_lost
        )
        if self._devices is not None:
            try:
                if automodel is not None and automodel.gpus > len(self._devices.slicers) and self._span_peers is not None:
                    plan = self._span_peers.plan(automodel.gpus)
                    # A trainer that spans nodes is exclusive on its devices: every step crosses the network.
                    self._own[key] = msgspec.structs.replace(self._own[key], is_exclusive=True)
                    self._devices.pool.place(
                        key, exclusive=True, label=f"job {job}", trainer_devices=plan.parts[0].devices
                    )
                    self._spans[key] = plan
                else:
                    self._devices.pool.place(
                        key, exclusive=exclusive, label=f"job {job}", trainer_devices=self._local_ranks(key)
                    )
            except OpenrldError:
                del self._own[key]
                raise

    def end(self, model: ModelEntry, job: str, reason: str) -> None:
        """`job`'s own group ends: its actors stop, what they hold fails with Gone(`reason`),
        and its devices are free once the actors have stopped (at once when it never started).

        Returns at once; a later `get` of the same group waits for the stop, then starts anew.
        """
        key = _group_key(model, job)
        self._own.pop(key, None)
        scope = self._scopes.get(key)
        if scope is None:  # booked but not started, or its start failed: only the booking to drop
            if self._devices is not None:
                self._devices.pool.release(key)
            self._spans.pop(key, None)
            return
        group = self._groups.pop(key, None)
        if group is not None:
            group.trainer.fail_pending(Gone(reason))
            group.sampler.fail_pending(Gone(reason))
        self._stopping.setdefault(key, trio.Event())
        logger.info("ending group key=%s reason=%s", key, reason)
        scope.cancel()

    def end_shared_job(self, model: ModelEntry, model_id: str, reason: str, sampler_ids: Collection[str]) -> None:
        """LoRA job `model_id` on `model`'s shared group ended while the group serves on: its queued ops fail
        with Gone(`reason`), its adapter leaves the trainer, and the versions it alone published (the
        sampling sessions `sampler_ids`, its inflight and its checkpoints' ones) leave the sampler. Never waits.
        A group not running holds nothing of it (a job whose group is starting posts nothing once it ended)."""
        group = self._groups.get(_group_key(model, None))
        if group is None:
            return
        group.trainer.end_job(model_id, Gone(reason))
        group.sampler.end_job(model_id, sampler_ids)

    def placement_of(self, model: ModelEntry, job: str | None = None) -> Placement | None:
        """Where the group runs; a trainer that spans nodes lists its members' devices after this node's."""
        key = _group_key(model, job)
        placement = self._devices.pool.placement_of(key) if self._devices is not None else None
        remote = self._span_devices.get(key)
        if placement is None or not remote:
            return placement
        return msgspec.structs.replace(placement, trainer_devices=(*placement.trainer_ranks, *remote))

    def span_ended(self, job: str, node: str, detail: str) -> bool:
        """A member's ranks of `job` ended (`SpanEnded`): the job is lost; False if no such span runs here."""
        for key, own in list(self._own.items()):
            if own.job == job and key in self._spans and node in (p.node for p in self._spans[key].parts[1:]):
                if own.on_lost is not None:
                    own.on_lost(_span_lost(job, node, detail))
                return True
        return False

    def _local_ranks(self, key: str) -> int:
        """How many devices of this node the group's trainer spans."""
        plan = self._spans.get(key)
        return plan.parts[0].devices if plan is not None else _ranks(self._own.get(key))

    def start_state(self, model: ModelEntry, job: str | None = None) -> tuple[bool, str | None]:
        """(is the group loading now, the error of its last failed start)."""
        key = _group_key(model, job)
        return key in self._starting, self._start_errors.get(key)

    def get_nowait(self, model: ModelEntry, job: str | None = None) -> Group | None:
        """The running group: `model`'s LoRA group, or with `job` that full fine-tuning run's own."""
        return self._groups.get(_group_key(model, job))

    def all_groups(self) -> list[Group]:
        return list(self._groups.values())

    async def get(self, model: ModelEntry, job: str | None = None, weight_sync: str = "delta") -> Group:
        """The group for `model` (or, with `job`, for that full fine-tuning run alone, its
        trainer syncing weights to its sampler by `weight_sync`), starting it if needed.

        Raises:
            ServerError: the engines could not be built (the message says why).
        """
        key = _group_key(model, job)
        while key not in self._groups:
            stopping = self._stopping.get(key)
            if stopping is not None:  # its previous run was ended and still holds its devices
                await stopping.wait()
                continue
            starting = self._starting.get(key)
            if starting is None:
                self._starting[key] = trio.Event()
                try:
                    self._groups[key] = await self._start(model, job, weight_sync)
                    self._start_errors.pop(key, None)
                except Gone:
                    raise  # ended while it started: not a failed start
                except Exception as error:
                    logger.exception("group start failed base_model=%s", model.name)
                    self._start_errors[key] = f"{type(error).__name__}: {error}"
                    raise ServerError(f"could not load base model {model.name!r}: {error}") from error
                finally:
                    self._starting.pop(key).set()
            else:
                await starting.wait()
                if key not in self._groups:
                    raise ServerError(
                        f"could not load base model {model.name!r}: {self._start_errors.get(key, 'unknown error')}"
                    )
        return self._groups[key]

    def _seats(
        self, model: ModelEntry, job: str | None, *, is_full: bool
    ) -> tuple[_Seat[DeviceLease | GroupLease], _Seat[DeviceLease]]:
        """Where the group's trainer and sampler run: device, engine factory, limiter, lease."""
        key = _group_key(model, job)
        name = model.name if job is None else f"{model.name}/{job}"
        if self._devices is None:
            return _Seat(self._engines, self._limiter, None), _Seat(self._engines, self._limiter, None)
        own = self._own.get(key)
        label = f"job {job}" if job is not None else name
        placement = self._devices.pool.place(
            key, exclusive=own is not None and own.is_exclusive, label=label, trainer_devices=self._local_ranks(key)
        )
        # A LoRA group's workers fit on one device together; a full fine-tuning job's take turns.
        trainer_party, sampler_party = (f"{name} trainer", f"{name} sampler") if is_full else (name, name)
        trainer, ranks = placement.trainer_device, placement.trainer_ranks
        trainer_lease: Callable[[Parkable], DeviceLease | GroupLease] = (
            partial(GroupLease, [self._devices.slicers[d] for d in ranks], f"{name} trainer", trainer_party)
            if len(ranks) > 1
            else partial(self._devices.slicers[trainer].register, f"{name} trainer", trainer_party)
        )
        sampler = placement.sampler_device
        sampler_lease = partial(self._devices.slicers[sampler].register, f"{name} sampler", sampler_party)
        return (
            _Seat(self._engines.on(trainer), self._devices.limiters[trainer], trainer_lease, ranks),
            _Seat(self._engines.on(sampler), self._devices.limiters[sampler], sampler_lease, (sampler,)),
        )

    async def _start(self, model: ModelEntry, job: str | None, weight_sync: str) -> Group:
        key = _group_key(model, job)
        scope = self._scopes[key] = trio.CancelScope()  # registered first: `end` may come mid-start
        return await self._nursery.start(self._run_group, key, scope, model, job, weight_sync)

    async def _run_group(
        self, key: str, scope: trio.CancelScope, model: ModelEntry, job: str | None, weight_sync: str,
        *, task_status: trio.TaskStatus[Group] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run one group's actors until `end` cancels `scope` (or the table's nursery closes),
        then free its devices.

        Raises:
            Gone: ended before it had started (reported by `nursery.start`).
        """
        started = False
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    task_status.started(await self._build(nursery, model, job, weight_sync))
                    started = True
        except BaseExceptionGroup as errors:
            # A failed start comes out of the nursery wrapped; its one error is what the caller reports.
            if started or len(errors.exceptions) != 1:
                raise
            raise errors.exceptions[0] from None
        finally:
            # Only now, with every engine call returned and the leases given back, is the device free.
            if self._scopes.get(key) is scope:
                del self._scopes[key]
            if self._devices is not None:
                self._devices.pool.release(key)
            stopping = self._stopping.pop(key, None)
            if stopping is not None:
                stopping.set()
        if not started:
            raise Gone(f"the group of {model.name if job is None else f'job {job}'} was ended while it started")

    async def _build(self, nursery: trio.Nursery, model: ModelEntry, job: str | None, weight_sync: str) -> Group:
        """Start the group's sampler, then its trainer, in `nursery`.

        A full fine-tuning run's group has engines of its own kind, and its sampler takes each
        new version as it is published, in order (`eager_versions`): weight-sync payloads chain.
        """
        logger.info("starting group base_model=%s dir=%s job=%s", model.name, model.directory, job)
        own = self._own.get(_group_key(model, job))
        is_full = job is not None and (own is None or own.full_sync is not None)
        trainer_seat, sampler_seat = self._seats(model, job, is_full=is_full)
        images = own.images if own is not None else NO_IMAGES
        name = model.name if job is None else f"{model.name}/{job}"
        build_sampler = sampler_seat.engines.full_sampler if is_full else sampler_seat.engines.sampler
        sampler = await nursery.start(
            SamplerActor(
                name=name,
                build_engine=build_sampler(model, images.sampler, job),
                limiter=sampler_seat.limiter,
                lease_from=sampler_seat.lease_from,
                futures=self._futures,
                queue_limit=self._sample_queue_limit,
                stability=self.stability,
                host_memory=self.host_memory,
                routing=self._sampler_routing,
                max_loaded_versions=FULL_LOADED_VERSIONS if is_full else MAX_LOADED_VERSIONS,
                max_host_versions=FULL_HOST_VERSIONS if is_full else MAX_HOST_VERSIONS,
                eager_versions=is_full,
            ).run
        )
        sync = own.full_sync if own is not None and own.full_sync is not None else weight_sync
        key = _group_key(model, job)
        if own is not None and own.automodel is not None:
            span = await nursery.start(self._run_span, key, own, model) if key in self._spans else None
            build_trainer = trainer_seat.engines.automodel_trainer(
                model, devices=trainer_seat.devices or ("cpu",) * self._local_ranks(key),
                fine_tuning="full" if is_full else "lora", weight_sync=sync, cp=own.automodel.cp, job=job, span=span,
            )
        elif is_full:
            build_trainer = trainer_seat.engines.full_trainer(model, sync, images.trainer, job)
        else:
            build_trainer = trainer_seat.engines.trainer(model, images.trainer, job)
        trainer = await nursery.start(
            TrainerActor(
                name=name,
                build_engine=build_trainer,
                limiter=trainer_seat.limiter,
                lease_from=trainer_seat.lease_from,
                futures=self._futures,
                checkpoints=self._checkpoints,
                autosaves=self._checkpoints.autosaves,
                sampler=sampler,
                host_memory=self.host_memory,
                on_engine_lost=_detail_to(own.on_lost) if own is not None and own.on_lost is not None else None,
            ).run
        )
        return Group(model=model, trainer=trainer, sampler=sampler, job=job if is_full else None)

    async def _run_span(
        self, key: str, own: OwnGroup, model: ModelEntry,
        *, task_status: trio.TaskStatus[SpanRendezvous] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the members' ranks of a trainer that spans nodes, report this node's rendezvous, then watch the
        members until the group ends; at its end, tell every member to stop.

        Raises:
            ServerError: a member did not start its ranks (the others started are stopped).
        """
        assert self._span_peers is not None, "a span is planned only once the cluster is attached"
        peers, plan = self._span_peers, self._spans[key]
        members = plan.parts[1:]
        host = peers.host(peers.local_name)
        port = self._free_rendezvous_port(key)
        started: list[str] = []
        try:
            devices: list[str] = []
            for part in members:
                order = SpanOrder(own.job, peers.local_name, model.name, part.devices, len(plan.parts), f"{host}:{port}")
                answer = await peers.start(part.node, order)
                started.append(part.node)
                devices += [f"{part.node}/{d}" for d in answer.devices]
            self._span_devices[key] = tuple(devices)
            task_status.started(SpanRendezvous(len(plan.parts), f"{host}:{port}", own.job, True, host))
            dead = None
            while dead is None:  # the members' liveness is the cluster view's, which gossip keeps
                await trio.sleep(SPAN_WATCH_S)
                dead = next((p.node for p in members if not peers.is_alive(p.node)), None)
            if own.on_lost is not None:
                own.on_lost(_span_lost(own.job, dead, "was declared dead by the cluster"))
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(SPAN_STOP_S, shield=True):
                async with trio.open_nursery() as stopping:
                    for node in started:
                        stopping.start_soon(peers.stop, node, own.job)
            self._span_devices.pop(key, None)
            self._span_ports.pop(key, None)
            if key not in self._own:
                self._spans.pop(key, None)

    def _free_rendezvous_port(self, key: str) -> int:
        """The first rendezvous port no span of this node holds: one port per span it is home to."""
        taken = set(self._span_ports.values())
        port = next(p for p in range(self._rendezvous_port, self._rendezvous_port + 1 + len(taken)) if p not in taken)
        self._span_ports[key] = port
        return port

    def statistics(self) -> list[GroupStatistics]:
        return [
            GroupStatistics(base_model=g.model.name, trainer=g.trainer.statistics(), sampler=g.sampler.statistics())
            for g in self._groups.values()
        ]


def _span_lost(job: str, node: str, why: str) -> str:
    return (
        f"job {job}: node {node}, which held ranks of its trainer, {why}; the weights and optimizer state its "
        "ranks held are gone: resume from a saved state"
    )


def _detail_to(on_lost: Callable[[str], None]) -> Callable[[OpenrldError], None]:
    return lambda error: on_lost(error.detail)


def _ranks(own: OwnGroup | None) -> int:
    """How many devices the group's trainer spans."""
    return own.automodel.gpus if own is not None and own.automodel is not None else 1


def _group_key(model: ModelEntry, job: str | None) -> str:
    # A LoRA group is keyed by its model directory (an absolute path); a full run's by its id,
    # which cannot look like one.
    return model.directory if job is None else f"full:{job}"
