"""The model status body: what one training job is doing, built from the actors' statistics.

This module owns `ModelStatus` (the body of `GET /openrl/v1/models/{model_id}/status`)
and the rule that turns the statistics of a job's group, its workers' device
leases and its progress into one job state:

    lost > failed > waiting_for_placement > loading_weights > training > sampling > parked > ready

and, for a job no longer resident: lost (its engine or node was lost, or the daemon
restarted), or finished (its session finished, and the job with it).

A state that can last (placement, loading, a parked worker waiting for its
turn) says what it waits for in `waiting_for`, so a cold start never looks
like a silent hang. It is pure: it reads the statistics it is given, keeps no
state, does no I/O and never imports torch or trio.
"""

from __future__ import annotations

import enum

import msgspec

from openrld.actors.device_pool import Placement
from openrld.actors.sampler import SamplerStatistics
from openrld.actors.timeslicer import LeaseState, WorkerLeaseStatistics
from openrld.actors.trainer import JobProgress, TrainerStatistics
from openrld.batches import SyncStats
from openrld.cluster.membership.messages import JobNote
from openrld.store.job_claims import Claim


class JobState(enum.Enum):
    WAITING_FOR_PLACEMENT = "waiting_for_placement"
    LOADING_WEIGHTS = "loading_weights"
    READY = "ready"
    TRAINING = "training"
    SAMPLING = "sampling"
    PARKED = "parked"
    FAILED = "failed"
    LOST = "lost"
    FINISHED = "finished"  # its session finished, and the job with it; its checkpoints remain


class WorkerStatus(msgspec.Struct, frozen=True):
    role: str  # "trainer" or "sampler"
    state: str  # "loading_weights", or a device lease state: running, waiting, resident, parking, parked, resuming
    device: str | None
    lease_s: float  # time it has held its device
    turns: int
    parks: int
    resumes: int
    rank: int = 0  # a trainer on several devices (a torchrun group) is listed once per rank, in rank order


class QueueDepths(msgspec.Struct, frozen=True):
    training_ops_waiting: int  # this job's ops queued on its trainer
    samples_waiting: int  # on its group's sampler (shared by the group's jobs)
    samples_running: int


class AdoptedFrom(msgspec.Struct, frozen=True):
    """The move of a job that a survivor took over when its home node died (cluster/adoption.py)."""

    node: str  # the node it was taken from
    step: int  # the auto-save's step it resumed from
    generation: int  # how many times the job has moved so far, this move included
    detail: str  # "adopted from node X at step k"


def adopted_from(claim: Claim) -> AdoptedFrom:
    return AdoptedFrom(node=claim.previous_home, step=claim.step, generation=claim.generation, detail=claim.detail)


class ModelStatus(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/models/{model_id}/status."""

    model_id: str
    base_model: str
    fine_tuning_type: str  # "lora" or "full"
    is_exclusive: bool
    state: JobState
    waiting_for: str | None  # what a waiting, loading or parked job waits for; None otherwise
    workers: list[WorkerStatus]
    queues: QueueDepths
    step: int  # optim_steps done since the job was created on this node
    sampler_weight_version: str | None  # the newest weights it published for sampling
    last_sync: SyncStats | None  # null until a full fine-tuning job has synced
    last_error: str | None
    last_checkpoint: str | None  # the newest weights/ checkpoint: what a lost job restores from
    adopted_from: AdoptedFrom | None = None  # set once a survivor took the job over from its dead home node


class JobFacts(msgspec.Struct, frozen=True):
    """What the job table knows of a job, for `build_status`."""

    model_id: str
    base_model: str
    fine_tuning_type: str
    is_exclusive: bool
    is_resident: bool  # False: the run is in the store but not on this daemon (it restarted)
    last_checkpoint: str | None
    adopted_from: AdoptedFrom | None = None
    lost_detail: str | None = None  # why a job that ran here no longer does (it moved, its engine was lost)
    adoptable: bool = False  # lost with its node, but auto-saved: a survivor is adopting it
    final_progress: JobProgress | None = None  # an ended job's progress as its trainer last reported it
    session_finished: bool = False  # not resident because its session finished (ServiceClient.close)


class GroupView(msgspec.Struct, frozen=True):
    """The job's group as the group table sees it; statistics None while it is not running."""

    is_loading: bool
    start_error: str | None
    placement: Placement | None
    trainer: TrainerStatistics | None
    sampler: SamplerStatistics | None


_PARKED_LEASE = (LeaseState.PARKED, LeaseState.PARKING, LeaseState.RESUMING, LeaseState.WAITING)


def _worker(role: str, lease: WorkerLeaseStatistics | None, device: str | None, rank: int = 0) -> WorkerStatus:
    if lease is None:
        return WorkerStatus(role, "resident", device, 0.0, 0, 0, 0, rank)
    return WorkerStatus(role, lease.state.value, device, lease.lease_s, lease.turns, lease.parks, lease.resumes, rank)


def _loading(role: str, device: str | None, rank: int = 0) -> WorkerStatus:
    return WorkerStatus(role, JobState.LOADING_WEIGHTS.value, device, 0.0, 0, 0, 0, rank)


def _last_sync(trainer: TrainerStatistics | None, sampler: SamplerStatistics | None) -> SyncStats | None:
    # The sampler's record of a sync has its apply time too; the trainer's is there first.
    if sampler is not None and sampler.last_sync is not None:
        return sampler.last_sync
    return trainer.last_sync if trainer is not None else None


def build_status(job: JobFacts, group: GroupView) -> ModelStatus:
    """The status of one job, from what the job table and its group report."""
    placement = group.placement
    trainer_device = placement.trainer_device if placement is not None else None
    sampler_device = placement.sampler_device if placement is not None else None
    rank_devices: tuple[str | None, ...] = placement.trainer_ranks if placement is not None else (None,)
    trainer, sampler = group.trainer, group.sampler
    progress = job.final_progress if job.final_progress is not None else progress_of(trainer, job.model_id)
    waiting_ops = next((j.waiting for j in trainer.jobs if j.model_id == job.model_id), 0) if trainer else 0
    # The ranks of one torchrun trainer share its one lease: they park and resume together.
    workers = (
        [_worker("trainer", trainer.lease, d, r) for r, d in enumerate(rank_devices)]
        + [_worker("sampler", sampler.lease, sampler_device)]
        if trainer is not None and sampler is not None
        else [_loading("trainer", d, r) for r, d in enumerate(rank_devices)] + [_loading("sampler", sampler_device)]
    )
    state, waiting_for = _state(job, group, waiting_ops, trainer_device)
    return ModelStatus(
        model_id=job.model_id,
        base_model=job.base_model,
        fine_tuning_type=job.fine_tuning_type,
        is_exclusive=job.is_exclusive,
        state=state,
        waiting_for=waiting_for,
        workers=workers if job.is_resident else [],
        queues=QueueDepths(
            training_ops_waiting=waiting_ops,
            samples_waiting=sampler.waiting if sampler is not None else 0,
            samples_running=sampler.running if sampler is not None else 0,
        ),
        step=progress.optim_steps,
        sampler_weight_version=progress.sampler_version,
        last_sync=_last_sync(trainer, sampler),
        last_error=progress.last_error or group.start_error,
        last_checkpoint=job.last_checkpoint,
        adopted_from=job.adopted_from,
    )


def lost_status(model_id: str, note: JobNote) -> ModelStatus:
    """The status of a job whose home node is dead or gone, from what that node gossiped of it."""
    facts = JobFacts(
        model_id=model_id, base_model=note.base_model, fine_tuning_type=note.fine_tuning_type,
        is_exclusive=note.is_exclusive, is_resident=False, last_checkpoint=note.last_checkpoint or None,
        adoptable=note.autosave_steps > 0,
    )
    return build_status(facts, GroupView(False, None, None, None, None))


def progress_of(trainer: TrainerStatistics | None, model_id: str) -> JobProgress:
    """Job `model_id`'s progress as `trainer` reports it (none yet: 0 steps)."""
    found = next((p for p in trainer.progress if p.model_id == model_id), None) if trainer is not None else None
    return found or JobProgress(model_id, 0, None, None)


def _state(job: JobFacts, group: GroupView, waiting_ops: int, device: str | None) -> tuple[JobState, str | None]:
    """The job's state and what it waits for (the order of the module docstring)."""
    if not job.is_resident:
        if job.adoptable:
            return JobState.LOST, "a surviving node to adopt it from its auto-save on the shared checkpoint root"
        if job.lost_detail is not None:
            return JobState.LOST, job.lost_detail
        if job.session_finished:
            return JobState.FINISHED, None
        restore = job.last_checkpoint or "no checkpoint was saved"
        return JobState.LOST, f"a restore with create_training_client_from_state (last checkpoint: {restore})"
    trainer, sampler = group.trainer, group.sampler
    if trainer is None or sampler is None:
        if group.start_error is not None and not group.is_loading:
            return JobState.FAILED, None
        if group.is_loading:
            where = f" onto {device}" if device is not None else ""
            return JobState.LOADING_WEIGHTS, f"base model {job.base_model} to load{where}"
        return JobState.WAITING_FOR_PLACEMENT, "a device for its trainer and sampler"
    if not any(j.model_id == job.model_id for j in trainer.jobs):
        return JobState.LOADING_WEIGHTS, "its sampler replicas to start"  # the trainer opens the job after them
    trainer_lease = trainer.lease.state if trainer.lease is not None else None
    if trainer.running_job == job.model_id or waiting_ops > 0:
        if trainer_lease in _PARKED_LEASE:
            return JobState.PARKED, f"a turn on {device}, which another worker holds"
        return JobState.TRAINING, None
    if sampler.running > 0 or sampler.waiting > 0:
        return JobState.SAMPLING, None
    if trainer_lease in (LeaseState.PARKED, LeaseState.PARKING):
        return JobState.PARKED, f"its next training op (it resumes on {device} then)"
    return JobState.READY, None
