"""The job table: the training jobs on this node, and the routing of their requests.

It owns the lifecycle of training jobs: creating one (from settings, or from a
checkpoint), recording its run in the store, booking a group of its own where
its settings ask for one (GroupTable.reserve: exclusive, images, Automodel), submitting
each request to its group's trainer in seq_id order, counting training tokens
for usage, and ending a session's jobs that have groups of their own. Lookups
take the caller's user and answer 404 for anything not theirs, 410 for a job
that is no longer resident. The API calls it from the event loop; its methods
are sync and never wait, except where a group must first be started, which
happens in a task of its own so that the submission returns at once.

What it holds is elsewhere: the resident jobs, their seq_id memory and the
settings hand-off in the pure `JobRegistry` (actors/job_registry.py); sessions
in `SessionTable` (actors/sessions.py); sampling sessions and samples in
`SamplingSessions` (actors/sampling_sessions.py); stable_reinforce provenance
in `StabilityRecords` (actors/stability.py); the status body in
actors/model_status.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import trio

from openrld import ids, model_families, settings as job_settings
from openrld.actors.checkpoints import CheckpointWriter, check_ttl, readable_checkpoint
from openrld.actors.durable_commits import DurableCommits
from openrld.actors.futures import Failed, FutureTable
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
    session_of,
)
from openrld.actors.model_status import GroupView, JobFacts, ModelStatus, adopted_from, build_status
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.trainer import (
    CreateAdapter,
    ForwardBackward,
    LoadState,
    OptimStep,
    Rejected,
    SaveForSampler,
    SaveState,
    TrainOp,
)
from openrld.actors.usage import UsageMeter
from openrld.autosave import Autosave, AutosaveManifest
from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec
from openrld.errors import BadRequest, Conflict, Gone, NotFound, NotSupportedYet, OpenrldError, UserError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.store import SessionRow, Store
from openrld.store.job_claims import Claim

logger = logging.getLogger(__name__)


class JobInfo(msgspec.Struct, frozen=True):
    model_id: str
    base_model: str
    tokenizer_id: str
    arch: str
    lora: LoraSpec | None  # None: full fine-tuning
    optimizer_config: dict[str, Any]


class HomeJob(msgspec.Struct, frozen=True):
    """A job this node is home to, as the cluster's gossip describes it."""

    model_id: str
    owner: str
    base_model: str
    fine_tuning_type: str  # "lora" or "full"
    is_exclusive: bool
    last_checkpoint: str | None
    autosave_steps: int = 0  # openrl.autosave_steps on a shared root: a survivor adopts the job if this node dies


class JobTable:
    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        store: Store,
        catalog: ModelCatalog,
        groups: GroupTable,
        futures: FutureTable,
        sessions: SessionTable,
        registry: JobRegistry,
        sampling: SamplingSessions,
        max_lora_rank: int,
        usage: UsageMeter,
        commits: DurableCommits,
        id_tag: str = "",
        allowed_images: tuple[str, ...] = (),
        has_automodel: bool = False,
        lora_sampler: model_families.Engine = model_families.Engine.TORCH_SAMPLER,
        checkpoints: CheckpointWriter | None = None,
        on_adopted: Callable[[str, int], None] | None = None,
    ) -> None:
        self._on_adopted = on_adopted  # (model id, step) of a job adopted here: its curve goes on from its step
        self._checkpoints = checkpoints  # adopting a run's checkpoints from a shared root, files in its threads
        self._lora_sampler = lora_sampler  # the node's sampler_backend: what samples its LoRA groups
        self._has_automodel = has_automodel  # [workers] automodel_python is set: Automodel jobs run here
        self._allowed_images = allowed_images  # [workers] allowed_images: which trainer images a job may name
        self._id_tag = id_tag  # a clustered node's tag, at the front of the ids it mints (ids.node_tag)
        self._usage = usage
        self._commits = commits
        self._nursery = nursery
        self._store = store
        self._catalog = catalog
        self._groups = groups
        self._futures = futures
        self._max_lora_rank = max_lora_rank
        self._sessions = sessions
        self._sampling = sampling  # the sampling sessions a job saves unnamed weights for are registered there
        self._jobs = registry  # shared with `sampling`, which only reads it
        self._lost: dict[str, str] = {}  # model_id -> why: jobs whose own group ended with a lost engine
        # Called when a job starts or ends here: a clustered node gossips its jobs at once (daemon.py), so
        # that a job is known to the cluster, and can be adopted, from its first step (cluster/adoption.py).
        self.changed: Callable[[], None] = lambda: None

    # ------------------------------------------------------------ what this node holds

    def is_running(self, model_id: str) -> bool:
        """Whether the job `model_id` runs on this node now."""
        return self._jobs.is_running(model_id)

    def has_run(self, model_id: str) -> bool:
        """Whether this node's store has the run `model_id`: from before a restart, or adopted from a shared root."""
        return self._store.runs.get(model_id) is not None

    def home_jobs(self) -> list[HomeJob]:
        """The jobs running here, with what the cluster should report of them if this node dies."""
        homes = []
        for job in self._jobs:
            checkpoint = self._store.checkpoints.last(job.model_id, ids.CheckpointKind.WEIGHTS)
            homes.append(
                HomeJob(
                    model_id=job.model_id, owner=job.owner, base_model=job.model.name,
                    fine_tuning_type="full" if job.full_sync is not None else "lora", is_exclusive=job.is_exclusive,
                    last_checkpoint=checkpoint.tinker_path if checkpoint is not None else None,
                    autosave_steps=job.autosave_steps,
                )
            )
        return homes

    # ------------------------------------------------------------ sessions ending

    def finish_session(self, owner: str, session_id: str, reason: str, detail: str | None) -> None:
        """The session finishes, and its jobs that have a group of their own (full fine-tuning,
        exclusive, an image, Automodel) end: their groups stop and free their devices, and their unnamed
        sampler weights go with them. Its LoRA jobs on a shared group are left as they are.

        Raises:
            NotFound: the session is not the caller's.
        """
        self._sessions.finish(owner, session_id, reason, detail)
        why = f"its session {session_id} has finished ({reason})"
        for job in self._jobs.remove_own_groups_of(session_id):
            self._sampling.drop_group(job.model_id)
            self._groups.end(job.model, job.model_id, f"model {job.model_id} has stopped: {why}")

    # ------------------------------------------------------------ training jobs

    def create_model(
        self, owner: str, *, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec | None,
        user_metadata: dict[str, str], optimizer_config: dict[str, Any],
    ) -> tuple[str, str]:
        """Start a LoRA job, or a full fine-tuning job (openrl.fine_tuning_type=full) in a group of
        its own; returns (request_id, model_id). A retry returns the first request."""
        session, model_id, first = self._created(owner, session_id, model_seq_id)
        if first is not None:
            return first, model_id
        if self._store.runs.get(model_id) is not None:
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
        model = self._catalog.resolve(base_model)
        self._check_engines(model, lora, full_sync is not None, automodel is not None, images)
        job = Job(
            model_id, owner, model, lora, job_settings_value.sampler_replicas, full_sync, job_settings_value.exclusive,
            images, automodel,
        )
        job.autosave_steps = self._autosave_steps(job_settings_value)
        request_id = self._open_job(
            job, "create_model",
            lambda: self._store.runs.create(
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
        tinker_path, source_dir, source_run = readable_checkpoint(self._store, owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        lora = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        model = self._catalog.resolve(source_run.base_model)
        resumed_config = resumed_optimizer_config(path, source_run.optimizer_config, optimizer_config, with_optimizer)
        # A restore takes the checkpoint's fine_tuning_type (and, for full, its weight_sync).
        source_settings = job_settings.settings_from_dict(source_run.settings)
        full_sync = full_sync_of(source_settings)
        if full_sync is not None:
            require_full_optimizer(resumed_config)
        is_exclusive = source_settings.exclusive
        images = images_of(source_settings, self._allowed_images)
        automodel = automodel_of(source_settings, available=self._has_automodel)
        self._check_engines(model, lora, full_sync is not None, automodel is not None, images)
        job = Job(
            model_id, owner, model, lora, source_settings.sampler_replicas, full_sync, is_exclusive, images, automodel
        )
        job.autosave_steps = self._autosave_steps(source_settings)
        request_id = self._open_job(
            job, "load_weights",
            lambda: self._store.runs.create(
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

    def _autosave_steps(self, settings: job_settings.JobSettings) -> int:
        """Steps between the job's auto-saves: its openrl.autosave_steps, none without a shared root."""
        return settings.autosave_interval if self._store.files.is_shared else 0

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
            # An Automodel trainer that is not exclusive takes turns on its devices with other groups,
            # parking every rank's FSDP shards together (actors/group_lease.py, gpu/automodel_park.py).
            self._groups.reserve(
                job.model, job.model_id, full_sync=job.full_sync, exclusive=job.is_exclusive,
                images=job.images, automodel=job.automodel, on_lost=partial(self._own_group_lost, job),
            )
        try:
            record_run()
        except BaseException:
            if own_group:  # no job, so no booking
                self._groups.end(job.model, job.model_id, f"model {job.model_id} could not be created")
            raise
        request_id = self._new_request(job.owner, job.model_id, kind)
        job.remember(0, request_id)
        self._jobs.add(job)
        self.changed()
        self._nursery.start_soon(self._open_and_submit, job, first_op(request_id))
        return request_id

    def _own_group_lost(self, job: Job, detail: str) -> None:
        """The trainer engine of `job`'s own group was lost (its process, or a rank of it, died):
        the job is over, its group ends (freeing its devices), and its later calls fail with `detail`
        and the job's last checkpoint, what it resumes from (as a job lost with its node is told)."""
        if self._jobs.remove(job.model_id) is None:
            return  # already ended (its session finished)
        checkpoint = self._store.checkpoints.last(job.model_id, ids.CheckpointKind.WEIGHTS)
        restore = f"its last checkpoint is {checkpoint.tinker_path}" if checkpoint is not None else "it saved no checkpoint"
        self._lost[job.model_id] = f"{detail}; {restore}"
        self._sampling.drop_group(job.model_id)
        self._groups.end(job.model, job.model_id, detail)

    def _created(self, owner: str, session_id: str, model_seq_id: int) -> tuple[SessionRow, str, str | None]:
        """(session, model_id, the request that created it) for a retried create of resident job
        `model_id` (its seq_id 0 remembered); else (session, model_id, None), the session live and `owner`'s.

        Raises:
            NotFound: no such session of `owner`'s.  Gone: a job to create in a finished session.
        """
        session = self._sessions.owned(owner, session_id)
        model_id = ids.model_id(session_id, model_seq_id)
        job = self._jobs.get(model_id)
        first = job.first_request(0) if job is not None else None
        if first is None:
            _refuse_finished(session)
        return session, model_id, first

    async def _open_and_submit(self, job: Job, first_op: TrainOp) -> None:
        try:
            await self._commits.durable()  # the run's row, before its first op can answer
            self._job(job.owner, job.model_id)  # Gone if its session finished meanwhile: start no group for it
            group = await self._groups.get(job.model, job.group_job, job.full_sync or "delta")
            # Before the job's first op, so that its sampler replicas serve once create_model answers.
            await group.sampler.ensure_replicas(job.sampler_replicas)
            self._job(job.owner, job.model_id)  # again: it may have ended while the replicas started
            group.trainer.open_job(job.model_id, next_seq=0)
            group.trainer.submit_nowait(first_op)
        except OpenrldError as error:
            self._futures.fail(first_op.request_id, error)
            if job.group_job is not None:  # its own group never served it: free the devices it booked
                self._groups.end(job.model, job.model_id, f"model {job.model_id} failed to start: {error.detail}")

    # ------------------------------------------------------------ adoption (cluster/adoption.py)

    def refusal(self, autosave: Autosave) -> str | None:
        """Why this node cannot hold the job of `autosave` (its base model, its engines); None if it can."""
        try:
            self._adopted_job(autosave.manifest)
        except UserError as error:
            return error.detail
        return None

    def _adopted_job(self, manifest: AutosaveManifest) -> Job:
        """The job an auto-save describes, shaped here as a create of its settings would be.

        Raises:
            UserError: this node cannot hold it (its base model, an image, an engine), as a create would be refused.
        """
        run = manifest.run
        settings = job_settings.settings_from_dict(run.settings)
        lora = msgspec.convert(run.lora, LoraSpec) if run.lora is not None else None
        model = self._catalog.resolve(run.base_model)
        images = images_of(settings, self._allowed_images)
        automodel = automodel_of(settings, available=self._has_automodel)
        full_sync = full_sync_of(settings)
        self._check_engines(model, lora, full_sync is not None, automodel is not None, images)
        job = Job(
            manifest.model_id, run.owner, model, lora, settings.sampler_replicas, full_sync, settings.exclusive,
            images, automodel,
        )
        job.autosave_steps = self._autosave_steps(settings)
        return job

    async def adopt(self, autosave: Autosave, claim: Claim) -> None:
        """Take job `autosave.manifest.model_id` over from the dead node `claim.previous_home`, which this
        node has claimed: its run's row and checkpoints from the shared root, its group, and its trainer
        loaded from the auto-save with its step count, its seq_ids going on after the auto-save's.
        Returns once the state is loaded; the job is resident from the load on.

        Raises:
            OpenrldError: the group could not start or the load failed (the job stays lost, logged).
        """
        manifest = autosave.manifest
        model_id = manifest.model_id
        job = self._adopted_job(manifest)
        job.adoption = claim
        if self._store.adoption.insert_job_run(manifest.run) is None:
            raise Conflict(f"model {model_id}: this node holds a run of that id of another owner")
        self._sessions.mirror_adopted(manifest.run.session_id, manifest.run.owner)
        if self._checkpoints is not None:
            await self._checkpoints.adopt_run(model_id)  # its checkpoints on the root, for its status and restores
        await self._commits.durable()
        own_group = job.group_job is not None
        if own_group:
            self._groups.reserve(
                job.model, model_id, full_sync=job.full_sync, exclusive=job.is_exclusive, images=job.images,
                automodel=job.automodel, on_lost=partial(self._own_group_lost, job),
            )
        try:
            group = await self._groups.get(job.model, job.group_job, job.full_sync or "delta")
            await group.sampler.ensure_replicas(job.sampler_replicas)
            request_id = self._new_request(job.owner, model_id, "load_weights")
            group.trainer.open_job(model_id, next_seq=manifest.seq_id)
            group.trainer.submit_nowait(
                LoadState(
                    model_id=model_id, request_id=request_id, source_dir=str(autosave.directory),
                    source_uri=f"the auto-save of step {manifest.step}", spec=job.lora, with_optimizer=True,
                    seq_id=manifest.seq_id, optimizer=optimizer_family(manifest.run.optimizer_config),
                    optim_steps=manifest.step,
                )
            )
        except BaseException:
            if own_group:
                self._groups.end(job.model, model_id, f"model {model_id} could not be adopted")
            raise
        # The auto-save's own seq_id is not remembered: a request of it replayed here (replay.py) is refused
        # as already applied, never answered with the load's future.
        self._lost.pop(model_id, None)
        if self._on_adopted is not None:
            self._on_adopted(model_id, manifest.step)
        self._jobs.add(job)
        outcome = None
        while outcome is None:
            outcome = await self._futures.wait(request_id, owner=job.owner, hold_s=60.0)
        if isinstance(outcome, Failed):
            self._drop(job, f"model {model_id} could not be adopted from its auto-save: {outcome.detail}")
            raise Gone(outcome.detail)
        logger.info("adopted model_id=%s %s generation=%d", model_id, claim.detail, claim.generation)

    def claimed_jobs(self) -> list[tuple[str, int]]:
        """(model id, the generation of the claim this node holds it by) of its jobs that auto-save."""
        return [(job.model_id, job.claim_generation) for job in self._jobs if job.autosave_steps > 0]

    def superseded(self, model_id: str, claim: Claim) -> None:
        """Another node has claimed job `model_id` (this node was declared dead): it stops here; its later
        calls here fail naming its new home."""
        job = self._jobs.get(model_id)
        if job is not None:
            self._drop(job, f"model {model_id} moved to node {claim.adopter} ({claim.detail}): its calls go there now")

    def _drop(self, job: Job, detail: str) -> None:
        """`job` ends here: its later calls fail with `detail`; its own group, if it has one, ends."""
        if self._jobs.remove(job.model_id) is None:
            return
        self._lost[job.model_id] = detail
        self._sampling.drop_group(job.model_id)
        if job.group_job is not None:
            self._groups.end(job.model, job.model_id, detail)
        self.changed()

    def model_status(self, owner: str, model_id: str, *, sees_all: bool = False) -> ModelStatus:
        """GET /openrl/v1/models/{model_id}/status: the job's state, workers, queues and progress.

        `sees_all`: the caller is the operator (api/auth.py), who may read any user's.

        Raises:
            NotFound: no such model, or not the caller's.
        """
        run = self._store.runs.get(model_id)
        if run is None or (run.owner != owner and not sees_all):
            raise NotFound(f"no model {model_id!r}")
        settings = job_settings.settings_from_dict(run.settings)
        checkpoint = self._store.checkpoints.last(model_id, ids.CheckpointKind.WEIGHTS)
        job = self._jobs.get(model_id)
        facts = JobFacts(
            model_id=model_id, base_model=run.base_model, fine_tuning_type=settings.fine_tuning_type.value,
            is_exclusive=settings.exclusive, is_resident=job is not None,
            last_checkpoint=checkpoint.tinker_path if checkpoint is not None else None,
            adopted_from=adopted_from(job.adoption) if job is not None and job.adoption is not None else None,
            lost_detail=self._lost.get(model_id),
        )
        if job is None:
            return build_status(facts, GroupView(False, None, None, None, None))
        group = self._groups.get_nowait(job.model, job.group_job)
        is_loading, start_error = self._groups.start_state(job.model, job.group_job)
        return build_status(
            facts,
            GroupView(
                is_loading=is_loading, start_error=start_error,
                placement=self._groups.placement_of(job.model, job.group_job),
                trainer=group.trainer.statistics() if group is not None else None,
                sampler=group.sampler.statistics() if group is not None else None,
            ),
        )

    def job_info(self, owner: str, model_id: str) -> JobInfo:
        run = self._store.runs.get(model_id)
        if run is None or run.owner != owner:
            raise NotFound(f"no model {model_id!r}")
        model = self._catalog.resolve(run.base_model)
        return JobInfo(
            model_id=model_id, base_model=run.base_model, tokenizer_id=model.tokenizer_id or run.base_model,
            arch=model.arch,
            lora=msgspec.convert(run.lora, LoraSpec) if run.lora is not None else None,
            optimizer_config=dict(run.optimizer_config),
        )

    def _job(self, owner: str, model_id: str) -> Job:
        job = self._jobs.owned(owner, model_id)
        if job is None:
            run = self._store.runs.get(model_id)
            if run is not None and run.owner == owner:
                if model_id in self._lost:
                    raise Gone(self._lost[model_id])
                if self._sessions.is_finished(run.session_id):
                    raise Gone(f"model {model_id} has stopped: its session {run.session_id} has finished")
                raise Gone(
                    f"model {model_id} is not resident (the daemon restarted); resume it with "
                    f"create_training_client_from_state from its last checkpoint"
                )
            raise NotFound(f"no model {model_id!r}")
        return job

    def _submit_train(self, owner: str, model_id: str, seq_id: int, kind: str, make_op) -> str:
        job = self._job(owner, model_id)
        first = job.first_request(seq_id)
        if first is not None:
            return first
        group = self._groups.get_nowait(job.model, job.group_job)
        if group is None:
            raise Conflict(f"model {model_id} is still loading; wait for create_model to finish")
        request_id = self._new_request(owner, model_id, kind)
        try:
            group.trainer.submit_nowait(make_op(request_id))
        except OpenrldError:
            self._futures.fail(request_id, Gone("not queued"))
            raise
        job.remember(seq_id, request_id)
        if job.is_due_for_touch(trio.current_time()):
            self._store.runs.touch(model_id)
        return request_id

    def reject(self, owner: str, model_id: str, seq_id: int, kind: str, error: OpenrldError) -> str:
        """A request whose body was refused: its future fails with `error`, in seq_id order."""
        return self._submit_train(
            owner, model_id, seq_id, kind,
            lambda rid: Rejected(model_id, seq_id, rid, error.detail),
        )

    def forward_backward(self, owner: str, model_id: str, seq_id: int, batch: ForwardBackwardBatch) -> str:
        kind = "forward" if batch.forward_only else "forward_backward"
        job = self._job(owner, model_id)
        fresh = job.first_request(seq_id) is None
        if fresh and batch.loss_fn == "stable_reinforce":
            # Provenance is resolved here, where the records live; a bad span fails the
            # request's future in its turn, so its seq_id is not orphaned.
            try:
                batch = msgspec.structs.replace(
                    batch, data=self._groups.stability.resolve(batch.data, session_of(model_id), trio.current_time())
                )
            except UserError as error:
                return self.reject(owner, model_id, seq_id, kind, error)
        request_id = self._submit_train(
            owner, model_id, seq_id, kind, lambda rid: ForwardBackward(model_id, seq_id, rid, batch)
        )
        if fresh:  # a retried seq_id is the same work, counted once
            tokens = sum(len(datum.tokens) for datum in batch.data)
            self._usage.training(model_id=model_id, owner=owner, base_model=job.model.name, tokens=tokens)
        return request_id

    def optim_step(self, owner: str, model_id: str, seq_id: int, params: AdamParams | DimuonParams) -> str:
        return self._submit_train(owner, model_id, seq_id, "optim_step", lambda rid: OptimStep(model_id, seq_id, rid, params))

    def save_weights(
        self, owner: str, model_id: str, seq_id: int, *, name: str, overwrite: bool,
        ttl_seconds: int | None, user_metadata: dict[str, str],
    ) -> str:
        ids.validate_name(name, "checkpoint name")
        check_ttl(ttl_seconds)
        return self._submit_train(
            owner, model_id, seq_id, "save_weights",
            lambda rid: SaveState(model_id, seq_id, rid, "weights", name, overwrite, ttl_seconds, user_metadata),
        )

    def save_weights_for_sampler(
        self, owner: str, model_id: str, seq_id: int, *, name: str | None, sampling_session_seq_id: int | None,
        kind: str, ttl_seconds: int | None, user_metadata: dict[str, str],
    ) -> str:
        if kind not in ("snapshot", "inflight"):
            raise BadRequest(f"kind: expected 'snapshot' or 'inflight', got {kind!r}")
        check_ttl(ttl_seconds)
        if name is not None:
            ids.validate_name(name, "checkpoint name")
            return self._submit_train(
                owner, model_id, seq_id, "save_weights_for_sampler",
                lambda rid: SaveState(model_id, seq_id, rid, "sampler_weights", name, False, ttl_seconds, user_metadata),
            )
        if sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        job = self._job(owner, model_id)
        session_id = model_id.split(":", 1)[0]
        sampler_id = ids.sampling_session_id(session_id, sampling_session_seq_id)
        inflight = kind == "inflight"
        if inflight and job.full_sync is not None:
            raise NotSupportedYet("save_weights_for_sampler kind='inflight' is not supported yet for full fine-tuning")
        if job.first_request(seq_id) is None:
            self._sampling.register(
                owner, sampler_id, job.model, version=None if inflight else sampler_id, source_dir=None,
                model_path=None, run_id=model_id, inflight_model=model_id if inflight else None,
                group_job=job.group_job,
            )
        return self._submit_train(
            owner, model_id, seq_id, "save_weights_for_sampler",
            lambda rid: SaveForSampler(model_id, seq_id, rid, sampler_id, inflight=inflight),
        )

    def save_weights_external(
        self, owner: str, model_id: str, seq_id: int, *, name: str, ttl_seconds: int | None
    ) -> str:
        """Write the adapter in PEFT format as `tinker://<model_id>/external_weights/<name>`."""
        ids.validate_name(name, "checkpoint name")
        check_ttl(ttl_seconds)
        job = self._job(owner, model_id)
        if job.full_sync is not None:
            raise NotSupportedYet(
                "save_weights_external is not supported yet for full fine-tuning; save_weights_for_sampler with a "
                "name writes the full weights as safetensors (model.safetensors)"
            )
        return self._submit_train(
            owner, model_id, seq_id, "save_weights_external",
            lambda rid: SaveState(
                model_id, seq_id, rid, "external_weights", name, False, ttl_seconds, {}, base_model=job.model.name
            ),
        )

    def load_weights(self, owner: str, model_id: str, seq_id: int, *, path: str, with_optimizer: bool) -> str:
        """The legacy in-place load: `model_id` takes the checkpoint's weights, in seq_id order."""
        job = self._job(owner, model_id)
        tinker_path, source_dir, source_run = readable_checkpoint(self._store, owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        spec = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        if spec != job.lora:
            def shape(lora: LoraSpec | None) -> str:
                return "full fine-tuning" if lora is None else f"LoRA config {lora}"

            raise BadRequest(f"{path}: its {shape(spec)} differs from model {model_id}'s {shape(job.lora)}")
        run = self._store.runs.get(model_id)
        family = optimizer_family(run.optimizer_config if run is not None else {})
        if with_optimizer and optimizer_family(source_run.optimizer_config) != family:
            raise BadRequest(
                f"{path}: its optimizer state is {optimizer_family(source_run.optimizer_config)!r}; model "
                f"{model_id} uses {family!r} (load it with optimizer=false, or into a new model)",
                key="optimizer",
            )
        return self._submit_train(
            owner, model_id, seq_id, "load_weights",
            lambda rid: LoadState(
                model_id=model_id, request_id=rid, source_dir=str(source_dir), source_uri=path,
                spec=spec, with_optimizer=with_optimizer, seq_id=seq_id, optimizer=family,
            ),
        )

    # ------------------------------------------------------------ helpers

    def _new_request(self, owner: str, model_id: str, kind: str) -> str:
        request_id = ids.new_request_id(self._id_tag)
        self._futures.create(request_id, model_id=model_id, kind=kind, owner=owner)
        return request_id


def _refuse_finished(session: SessionRow) -> None:
    """A job is made only in a live session: a finished one's jobs' own groups ended with it, and
    a job made now would hold its devices with nothing left to end it. Raises Gone."""
    if session.is_finished:
        raise Gone(f"session {session.session_id} has finished")
