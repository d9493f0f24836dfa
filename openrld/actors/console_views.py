"""What the console shows: runs with their state, a run's checkpoints and curves, this node's devices
and host memory.

This module owns the bodies of the console's read-only routes
(`GET /openrl/v1/runs`, `/openrl/v1/runs/{run_id}`, `/openrl/v1/runs/{run_id}/curves`
and `/openrl/v1/node`) and the owner rule they share with the rest of the API:
a caller sees their own runs, and the operator (api/auth.py `sees_all`) sees
everyone's; anything else answers 404 exactly as a missing run does. It
changes nothing, and reads only what the job table, the store, the run
history and the actors' statistics already hold. It never imports torch.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from openrld.actors.device_pool import DeviceUse
from openrld.actors.groups import GroupStatistics
from openrld.actors.host_memory import NO_HOST_MEMORY, HostMemoryStatistics
from openrld.actors.jobs import JobTable
from openrld.actors.model_status import ModelStatus
from openrld.actors.run_history import HistoryRecorder, RunCurves
from openrld.actors.timeslicer import DeviceStatistics, WorkerLeaseStatistics
from openrld.actors.trainer import JobQueueStats
from openrld.errors import NotFound
from openrld.store import CheckpointRow, JsonScalar, RunRow, Store


class Cursor(msgspec.Struct, frozen=True):
    offset: int
    limit: int
    total_count: int


class RunSummary(msgspec.Struct, frozen=True):
    training_run_id: str
    owner: str
    base_model: str
    created: str  # ISO 8601, UTC; the list is ordered by it, newest first
    last_request_time: str
    lora_rank: int | None  # None: full fine-tuning
    settings: dict[str, JsonScalar]  # the run's openrl.* settings, stored form
    user_metadata: dict[str, str]
    status: ModelStatus  # as GET /openrl/v1/models/{model_id}/status answers
    node: str  # the node that answered: the run's home


class RunPage(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/runs."""

    runs: list[RunSummary]
    cursor: Cursor


class CheckpointView(msgspec.Struct, frozen=True):
    checkpoint_id: str  # "<kind>/<name>"
    checkpoint_type: str  # "training" or "sampler"
    tinker_path: str
    time: str  # ISO 8601, UTC
    size_bytes: int | None
    expires_at: str | None  # None: no TTL
    public: bool
    user_metadata: dict[str, str]


class RunDetail(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/runs/{run_id}."""

    run: RunSummary
    checkpoints: list[CheckpointView]  # newest first


class DeviceView(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "cpu", "cuda"
    memory_bytes: int
    is_exclusive: bool  # held by an exclusive job: nothing else is placed on it
    groups: int  # worker groups placed on it
    holder: str | None  # the worker holding the time-slicer's lease now
    waiting: int  # workers queued for a turn
    workers: list[WorkerLeaseStatistics]  # each worker's lease state, turns, parks and resumes
    last_error: str | None  # the time-slicer's last failed park or resume


class GroupView(msgspec.Struct, frozen=True):
    base_model: str
    jobs: list[JobQueueStats]  # the jobs its trainer serves, with their queued ops
    trainer_device: str
    sampler_device: str
    trainer_busy: bool
    sampler_waiting: int
    sampler_running: int
    sampler_replicas: int
    prefix_cache_bytes: int  # KV its sampler's prefix caches hold now
    parked_bytes: int  # its trainer's and sampler's device state parked in host memory
    engine_state_bytes: int  # its engines' state in host memory (CPU devices): weights, adapters, optimizer


class NodeView(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/node."""

    node: str
    devices: list[DeviceView]
    groups: list[GroupView]
    host_memory: HostMemoryStatistics  # the budget and what holds it, node-wide (actors/host_memory.py)


def _time(value: datetime) -> str:
    return value.isoformat()


def checkpoint_view(row: CheckpointRow) -> CheckpointView:
    return CheckpointView(
        checkpoint_id=row.checkpoint_id, checkpoint_type=row.checkpoint_type, tinker_path=row.tinker_path,
        time=_time(row.created_at), size_bytes=row.size_bytes,
        expires_at=_time(row.expires_at) if row.expires_at is not None else None,
        public=row.public, user_metadata=row.user_metadata,
    )


def node_view(
    node: str,
    device_kinds: dict[str, tuple[str, int]],
    uses: list[DeviceUse],
    slicers: list[DeviceStatistics],
    groups: list[GroupStatistics],
    host_memory: HostMemoryStatistics | None = None,
) -> NodeView:
    """This node's devices, worker groups and host memory, from the device pool's, the time-slicers', the
    groups' and the host-memory ledger's statistics (None: the node keeps no budget, all zero).

    Args:
        device_kinds: device name -> (kind, memory bytes), as the daemon resolved them.
    """
    by_device = {s.device: s for s in slicers}
    devices = []
    for use in uses:
        kind, memory = device_kinds.get(use.device, ("", 0))
        slicer = by_device.get(use.device)
        devices.append(
            DeviceView(
                name=use.device, kind=kind, memory_bytes=memory, is_exclusive=use.is_exclusive, groups=len(use.groups),
                holder=slicer.holder if slicer is not None else None,
                waiting=slicer.waiting if slicer is not None else 0,
                workers=list(slicer.workers) if slicer is not None else [],
                last_error=slicer.last_error if slicer is not None else None,
            )
        )
    return NodeView(
        node=node, devices=devices,
        groups=[
            GroupView(
                base_model=g.base_model, jobs=list(g.trainer.jobs), trainer_device=g.trainer.device,
                sampler_device=g.sampler.device, trainer_busy=g.trainer.busy, sampler_waiting=g.sampler.waiting,
                sampler_running=g.sampler.running, sampler_replicas=g.sampler.replicas,
                prefix_cache_bytes=g.sampler.memory.prefix_cache_bytes,
                parked_bytes=g.trainer.memory.parked_bytes + g.sampler.memory.parked_bytes,
                engine_state_bytes=g.trainer.memory.state_bytes + g.sampler.memory.state_bytes,
            )
            for g in groups
        ],
        host_memory=host_memory if host_memory is not None else NO_HOST_MEMORY,
    )


class ConsoleViews:
    """The console's reads, under the API's owner rule. Sync except for curves read from the store."""

    def __init__(self, *, store: Store, jobs: JobTable, history: HistoryRecorder, node: str) -> None:
        self._store = store
        self._jobs = jobs
        self._history = history
        self._node = node

    def _visible_run(self, viewer: str, run_id: str, sees_all: bool) -> RunRow:
        run = self._store.runs.get(run_id)
        if run is None or (run.owner != viewer and not sees_all):
            raise NotFound(f"no training run {run_id!r}")
        return run

    def _summary(self, run: RunRow) -> RunSummary:
        return RunSummary(
            training_run_id=run.run_id, owner=run.owner, base_model=run.base_model, created=_time(run.created_at),
            last_request_time=_time(run.last_request_at), lora_rank=run.lora_rank, settings=run.settings,
            user_metadata=run.user_metadata,
            status=self._jobs.model_status(run.owner, run.run_id),
            node=self._node,
        )

    def runs(self, viewer: str, *, sees_all: bool, limit: int, offset: int) -> RunPage:
        """A page of the runs `viewer` may see on this node, newest first."""
        rows, total = self._store.runs.list(viewer, limit, offset, every_owner=sees_all)
        return RunPage(runs=[self._summary(r) for r in rows], cursor=Cursor(offset, limit, total))

    def run(self, viewer: str, run_id: str, *, sees_all: bool) -> RunDetail:
        """One run with its checkpoints. Raises NotFound for a run `viewer` may not see."""
        run = self._visible_run(viewer, run_id, sees_all)
        rows = sorted(self._store.checkpoints.of_run(run_id), key=lambda r: r.created_at, reverse=True)
        return RunDetail(run=self._summary(run), checkpoints=[checkpoint_view(r) for r in rows])

    async def curves(self, viewer: str, run_id: str, *, sees_all: bool, after_seq: int) -> RunCurves:
        """The run's points newer than `after_seq`, and its sampling buckets. Raises NotFound as `run` does."""
        self._visible_run(viewer, run_id, sees_all)
        return await self._history.curves(run_id, after_seq)
