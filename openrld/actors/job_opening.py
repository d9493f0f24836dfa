"""Opening a job on this node: created from its settings, or from a checkpoint's run.

A job opens in three steps, in this order: its own group is booked if its
settings ask for one (GroupTable.reserve: exclusive, images, Automodel), so
that a node with no free device refuses it at once; its run is recorded in
the store; and it turns resident and starts in a task of its own (its group,
its sampler replicas, then its first op), so that the create returns at once.
Before any of it, a job is shaped from its settings the way every node shapes
it: its weight sync, images and Automodel trainer, the engines that must hold
its base model, its auto-save interval (`shaped`, which an adopter uses too:
job_adoption.py). A retried create answers with its first request.

The job table (jobs.py) serves the jobs once open; why one is gone is in
gone_jobs.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
import trio

from openrld import ids, model_families, settings as job_settings
from openrld.actors.checkpoints import readable_checkpoint
from openrld.actors.durable_commits import DurableCommits
from openrld.actors.futures import FutureTable
from openrld.actors.gone_jobs import GoneJobs
from openrld.actors.groups import GroupTable
from openrld.actors.job_registry import (
    Images,
    Job,
    JobRegistry,
    automodel_of,
    check_lora_rank,
    full_sync_of,
    images_of,
    optimizer_family,
    require_full_optimizer,
    resumed_optimizer_config,
)
from openrld.actors.sessions import SessionTable
from openrld.actors.trainer import CreateAdapter, LoadState, TrainOp
from openrld.batches import LoraSpec
from openrld.errors import BadRequest, Conflict, Gone, OpenrldError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.store import SessionRow, Store


@dataclass(frozen=True)
class NodeTables:
    """The node's tables a job is opened and adopted with; the job table builds it once (jobs.py)."""

    store: Store
    catalog: ModelCatalog
    groups: GroupTable
    futures: FutureTable
    sessions: SessionTable
    registry: JobRegistry  # the resident jobs
    gone: GoneJobs  # why a job ended here; a job whose own group is lost ends there
    commits: DurableCommits
    new_request: Callable[[str, str, str], str]  # (owner, model id, kind) -> a new request id with its future


class JobOpening:
    """Creates jobs and restores them from checkpoints; see the module docstring."""

    def __init__(
        self,
        node: NodeTables,
        *,
        nursery: trio.Nursery,
        changed: Callable[[], None],
        max_lora_rank: int,
        allowed_images: tuple[str, ...],
        has_automodel: bool,
        lora_sampler: model_families.Engine,
    ) -> None:
        self._node = node
        self._nursery = nursery  # each job starts in a task of its own
        self._changed = changed  # a clustered node gossips a new job at once
        self._max_lora_rank = max_lora_rank
        self._allowed_images = allowed_images  # [workers] allowed_images: which trainer images a job may name
        self._has_automodel = has_automodel  # [workers] automodel_python is set: Automodel jobs run here
        self._lora_sampler = lora_sampler  # the node's sampler_backend: what samples its LoRA groups

    def create_model(
        self, owner: str, *, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec | None,
        user_metadata: dict[str, str], optimizer_config: dict[str, Any],
    ) -> tuple[str, str]:
        """Start a LoRA job, or a full fine-tuning job (openrl.fine_tuning_type=full) in a group of
        its own; returns (request_id, model_id). A retry returns the first request."""
        session, model_id, first = self._created(owner, session_id, model_seq_id)
        if first is not None:
            return first, model_id
        if self._node.store.runs.get(model_id) is not None:
            raise Conflict(f"model {model_id} already exists")
        job_settings_value, _client_metadata = job_settings.parse_settings(
            session.tags, session.user_metadata, user_metadata
        )
        job_settings.require_supported(job_settings_value)
        images = images_of(job_settings_value, self._allowed_images)
        automodel = automodel_of(job_settings_value, available=self._has_automodel)
        full_sync = full_sync_of(job_settings_value)
        if full_sync is None:
            if lora is None:
                raise BadRequest("create_model needs lora_config for a LoRA job (or openrl.fine_tuning_type=full)")
            check_lora_rank(lora, self._max_lora_rank)
        else:
            lora = None  # the SDK always sends a lora_config; a full job has no adapter
            require_full_optimizer(optimizer_config)
        model = self._node.catalog.resolve(base_model)
        self._check_engines(model, lora, full_sync is not None, automodel is not None, images)
        job = Job(
            model_id, owner, model, lora, job_settings_value.sampler_replicas, full_sync, job_settings_value.exclusive,
            images, automodel,
        )
        job.autosave_steps = self._autosave_steps(job_settings_value)
        request_id = self._open_job(
            job, "create_model",
            lambda: self._node.store.runs.create(
                model_id, session_id=session_id, owner=owner, base_model=base_model, model_dir=model.directory,
                lora=msgspec.to_builtins(lora) if lora is not None else None,
                settings=job_settings.settings_to_dict(job_settings_value),
                user_metadata=user_metadata, optimizer_config=optimizer_config,
            ),
            lambda rid: CreateAdapter(model_id, rid, lora, optimizer=optimizer_family(optimizer_config)),
        )
        return request_id, model_id

    def load_into_new_model(
        self, owner: str, *, session_id: str, model_seq_id: int, path: str, with_optimizer: bool,
        optimizer_config: dict[str, Any] | None,
    ) -> tuple[str, str]:
        """create_training_client_from_state[_with_optimizer]: a new job named as the SDK expects."""
        _, model_id, first = self._created(owner, session_id, model_seq_id)
        if first is not None:
            return first, model_id
        tinker_path, source_dir, source_run = readable_checkpoint(self._node.store, owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        lora = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        model = self._node.catalog.resolve(source_run.base_model)
        resumed_config = resumed_optimizer_config(path, source_run.optimizer_config, optimizer_config, with_optimizer)
        # A restore takes the checkpoint's fine_tuning_type (and, for full, its weight_sync).
        source_settings = job_settings.settings_from_dict(source_run.settings)
        if full_sync_of(source_settings) is not None:
            require_full_optimizer(resumed_config)
        job = self.shaped(model_id, owner, model, lora, source_settings)
        request_id = self._open_job(
            job, "load_weights",
            lambda: self._node.store.runs.create(
                model_id, session_id=session_id, owner=owner, base_model=source_run.base_model,
                model_dir=model.directory, lora=source_run.lora, settings=source_run.settings,
                user_metadata=dict(source_run.user_metadata), optimizer_config=resumed_config,
            ),
            lambda rid: LoadState(
                model_id=model_id, request_id=rid, source_dir=str(source_dir), source_uri=path,
                spec=lora, with_optimizer=with_optimizer, optimizer=optimizer_family(resumed_config),
            ),
        )
        return request_id, model_id

    def shaped(
        self, model_id: str, owner: str, model: ModelEntry, lora: LoraSpec | None, settings: job_settings.JobSettings
    ) -> Job:
        """The job `settings` describe, as this node would run it (a restored or an adopted job's).

        Raises:
            UserError: this node cannot hold it (an image, an engine), as a create would be refused.
        """
        images = images_of(settings, self._allowed_images)
        automodel = automodel_of(settings, available=self._has_automodel)
        full_sync = full_sync_of(settings)
        self._check_engines(model, lora, full_sync is not None, automodel is not None, images)
        job = Job(
            model_id, owner, model, lora, settings.sampler_replicas, full_sync, settings.exclusive, images, automodel
        )
        job.autosave_steps = self._autosave_steps(settings)
        return job

    def book_own_group(self, job: Job) -> None:
        """Book `job`'s own group, on devices this node has free now (GroupTable.reserve); if its trainer
        engine is lost, the job ends (gone_jobs.py)."""
        # An Automodel trainer that is not exclusive takes turns on its devices with other groups,
        # parking every rank's FSDP shards together (actors/group_lease.py, gpu/automodel_park.py).
        self._node.groups.reserve(
            job.model, job.model_id, full_sync=job.full_sync, exclusive=job.is_exclusive,
            images=job.images, automodel=job.automodel, on_lost=partial(self._node.gone.own_group_lost, job),
        )

    def _autosave_steps(self, settings: job_settings.JobSettings) -> int:
        """Steps between the job's auto-saves: its openrl.autosave_steps, none without a shared root."""
        return settings.autosave_interval if self._node.store.files.is_shared else 0

    def _check_engines(
        self, model: ModelEntry, lora: LoraSpec | None, is_full: bool, is_automodel: bool, images: Images
    ) -> None:
        """Refuse, before any group is built, a model one of the job's engines cannot hold (a 400
        naming the family and the engine; `model_families`)."""
        engines = model_families.job_engines(
            is_full=is_full, is_automodel=is_automodel, trainer_image=images.trainer is not None,
            sampler_image=images.sampler is not None, lora_sampler=self._lora_sampler,
        )
        model_families.check_engines(model.name, model.arch, engines, trains_mlp=lora is not None and lora.train_mlp)

    def _open_job(
        self, job: Job, kind: str, record_run: Callable[[], object], first_op: Callable[[str], TrainOp]
    ) -> str:
        """Book the job's own group if it has one, record its run, make it resident, and start it in a
        task of its own (its group, then `first_op`); returns the first op's request id.

        The booking comes first, so that a node with no free device refuses an exclusive job now.
        """
        own_group = job.is_exclusive or job.images.any or job.automodel is not None
        if own_group:
            self.book_own_group(job)
        try:
            record_run()
        except BaseException:
            if own_group:  # no job, so no booking
                self._node.groups.end(job.model, job.model_id, f"model {job.model_id} could not be created")
            raise
        request_id = self._node.new_request(job.owner, job.model_id, kind)
        job.remember(0, request_id)
        self._node.registry.add(job)
        self._changed()
        self._nursery.start_soon(self._open_and_submit, job, first_op(request_id))
        return request_id

    def _created(self, owner: str, session_id: str, model_seq_id: int) -> tuple[SessionRow, str, str | None]:
        """(session, model_id, the request that created it) for a retried create of resident job
        `model_id` (its seq_id 0 remembered); else (session, model_id, None), the session live and `owner`'s.

        Raises:
            NotFound: no such session of `owner`'s.  Gone: a job to create in a finished session.
        """
        session = self._node.sessions.owned(owner, session_id)
        model_id = ids.model_id(session_id, model_seq_id)
        job = self._node.registry.get(model_id)
        first = job.first_request(0) if job is not None else None
        if first is None:
            _refuse_finished(session)
        return session, model_id, first

    async def _open_and_submit(self, job: Job, first_op: TrainOp) -> None:
        try:
            await self._node.commits.durable()  # the run's row, before its first op can answer
            self._node.gone.resident(job.owner, job.model_id)  # Gone if its session finished meanwhile: start no group for it
            group = await self._node.groups.get(job.model, job.group_job, job.full_sync or "delta")
            # Before the job's first op, so that its sampler replicas serve once create_model answers.
            await group.sampler.ensure_replicas(job.sampler_replicas)
            self._node.gone.resident(job.owner, job.model_id)  # again: it may have ended while the replicas started
            group.trainer.open_job(job.model_id, next_seq=0)
            group.trainer.submit_nowait(first_op)
        except OpenrldError as error:
            self._node.futures.fail(first_op.request_id, error)
            if job.group_job is not None:  # its own group never served it: free the devices it booked
                self._node.groups.end(job.model, job.model_id, f"model {job.model_id} failed to start: {error.detail}")


def _refuse_finished(session: SessionRow) -> None:
    """A job is made only in a live session: a finished one's jobs' own groups ended with it, and
    a job made now would hold its devices with nothing left to end it. Raises Gone."""
    if session.is_finished:
        raise Gone(f"session {session.session_id} has finished")
