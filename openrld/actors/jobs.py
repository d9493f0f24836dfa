"""The job table: sessions, training jobs and sampling sessions on this node.

It owns who owns what (every lookup takes the caller's user and answers 404 for
anything not theirs), the `(model_id, seq_id) -> request_id` map that makes a
retried submission return its first future, and the routing of each request
to its group's trainer or sampler. The API calls it from the event loop; its
methods are sync and never wait, except where a group must first be started,
which happens in a task of its own so that the submission returns at once.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from openrld import ids, settings as job_settings
from openrld.actors.checkpoints import check_ttl
from openrld.actors.futures import FutureTable
from openrld.actors.groups import NO_IMAGES, Group, GroupTable, Images
from openrld.actors.model_status import GroupView, JobFacts, ModelStatus, build_status
from openrld.actors.sampler import Sample
from openrld.actors.usage import UsageMeter
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
from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, SampleJob
from openrld.errors import BadRequest, Conflict, Gone, NotFound, NotSupportedYet, OpenrldError, UserError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.store import Store
from openrld.worker.images import check_image_allowed

logger = logging.getLogger(__name__)

SEQ_MEMORY = 4096  # how many past seq_ids per job still answer a retry with their first future


class JobInfo(msgspec.Struct, frozen=True):
    model_id: str
    base_model: str
    tokenizer_id: str
    arch: str
    lora: LoraSpec | None  # None: full fine-tuning
    optimizer_config: dict[str, Any]


class SamplerInfo(msgspec.Struct, frozen=True):
    sampler_id: str
    base_model: str
    model_path: str | None


class HomeJob(msgspec.Struct, frozen=True):
    """A job this node is home to, as the cluster's gossip describes it."""

    model_id: str
    owner: str
    base_model: str
    fine_tuning_type: str  # "lora" or "full"
    is_exclusive: bool
    last_checkpoint: str | None


class SessionSnapshot(msgspec.Struct, frozen=True):
    """A session as its home node sends it with a relayed request, for the node the job is placed on."""

    session_id: str
    owner: str
    tags: list[str]
    user_metadata: dict[str, str]
    sdk_version: str
    project_id: str | None
    display_name: str | None


TOUCH_EVERY_S = 1.0  # how stale a run's last_request_time may be; spares the store a write per request


class _Job:
    __slots__ = (
        "model_id", "owner", "model", "lora", "requests", "touched_at", "sampler_replicas", "full_sync", "is_exclusive",
        "images",
    )

    def __init__(
        self, model_id: str, owner: str, model: ModelEntry, lora: LoraSpec | None, sampler_replicas: int = 1,
        full_sync: str | None = None, is_exclusive: bool = False, images: Images = NO_IMAGES,
    ) -> None:
        self.is_exclusive = is_exclusive  # openrl.exclusive: a group of its own on devices of its own
        # openrl.trainer_backend / sampler_backend=<image>: a group of its own, running them
        self.images = images
        self.model_id = model_id
        self.owner = owner
        self.model = model
        self.lora = lora  # None: full fine-tuning
        # Full fine-tuning: its weight_sync ("delta" or "full"); the job has a group of its own.
        self.full_sync = full_sync
        self.sampler_replicas = sampler_replicas  # openrl.sampler_replicas; its group runs at least this many
        self.requests: dict[int, str] = {}  # seq_id -> request_id
        self.touched_at = float("-inf")

    def remember(self, seq_id: int, request_id: str) -> None:
        self.requests[seq_id] = request_id
        if len(self.requests) > SEQ_MEMORY:
            del self.requests[min(self.requests)]

    @property
    def group_job(self) -> str | None:
        """The key of the job's own group (full fine-tuning, exclusive or an image), else None (its base model's LoRA group)."""
        has_own = self.full_sync is not None or self.is_exclusive or self.images.any
        return self.model_id if has_own else None


class _SamplingSession:
    __slots__ = (
        "sampler_id", "owner", "model", "version", "source_dir", "model_path", "requests", "inflight_model",
        "group_job",
    )

    def __init__(
        self, sampler_id: str, owner: str, model: ModelEntry, version: str | None,
        source_dir: str | None, model_path: str | None, inflight_model: str | None = None,
        group_job: str | None = None,
    ) -> None:
        self.group_job = group_job  # the full fine-tuning run whose group samples it; None: the LoRA group
        self.sampler_id = sampler_id
        self.owner = owner
        self.model = model
        self.version = version
        self.source_dir = source_dir
        self.model_path = model_path
        self.inflight_model = inflight_model  # inflight: follows this training model's published weights
        self.requests: dict[int, tuple[str, list[str]]] = {}  # seq_id -> (request_id, sequence ids)


class JobTable:
    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        store: Store,
        catalog: ModelCatalog,
        groups: GroupTable,
        futures: FutureTable,
        max_lora_rank: int,
        usage: UsageMeter | None = None,
        id_tag: str = "",
        allowed_images: tuple[str, ...] = (),
    ) -> None:
        self._allowed_images = allowed_images  # [workers] allowed_images: which trainer images a job may name
        self._id_tag = id_tag  # a clustered node's tag, at the front of the ids it mints (ids.node_tag)
        self._usage = usage if usage is not None else UsageMeter()
        self._nursery = nursery
        self._store = store
        self._catalog = catalog
        # What clients used before a restart is still served without a download: list it.
        catalog.remember(store.base_models())
        self._groups = groups
        self._futures = futures
        self._max_lora_rank = max_lora_rank
        self._jobs: dict[str, _Job] = {}
        self._samplers: dict[str, _SamplingSession] = {}

    # ------------------------------------------------------------ sessions

    def create_session(
        self, owner: str, *, tags: list[str], user_metadata: dict[str, str], sdk_version: str,
        project_id: str | None, display_name: str | None,
    ) -> str:
        # Settings are validated here too, so a bad tag fails at the first call, not the first model.
        job_settings.parse_settings(tags, user_metadata, {})
        session_id = ids.new_session_id(self._id_tag)
        self._store.create_session(
            session_id, owner=owner, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version,
            project_id=project_id, display_name=display_name,
        )
        return session_id

    def _session(self, owner: str, session_id: str):
        row = self._store.get_session(session_id)
        if row is None or row.owner != owner:
            raise NotFound(f"no session {session_id!r}")
        return row

    def session_snapshot(self, session_id: str) -> SessionSnapshot | None:
        """This node's session `session_id`, to send along with a request relayed to another node."""
        row = self._store.get_session(session_id)
        if row is None:
            return None
        return SessionSnapshot(
            session_id=row.session_id, owner=row.owner, tags=list(row.tags), user_metadata=dict(row.user_metadata),
            sdk_version=row.sdk_version, project_id=row.project_id, display_name=row.display_name,
        )

    def mirror_session(self, snapshot: SessionSnapshot) -> None:
        """Record another node's session here, so that jobs and samplers placed here can belong to it.

        The home node keeps the heartbeats and the finish; the mirror carries
        what settings and ownership need (tags, user_metadata, owner).
        """
        if self._store.get_session(snapshot.session_id) is not None:
            return
        self._store.create_session(
            snapshot.session_id, owner=snapshot.owner, tags=snapshot.tags, user_metadata=snapshot.user_metadata,
            sdk_version=snapshot.sdk_version, project_id=snapshot.project_id, display_name=snapshot.display_name,
        )

    def is_running(self, model_id: str) -> bool:
        """Whether the job `model_id` runs on this node now."""
        return model_id in self._jobs

    def has_run(self, model_id: str) -> bool:
        """Whether this node's store has the run `model_id`: from before a restart, or adopted from a shared root."""
        return self._store.get_run(model_id) is not None

    def is_home_to_sampler(self, sampler_id: str) -> bool:
        return sampler_id in self._samplers or self._store.get_sampler(sampler_id) is not None

    def is_home_to_session(self, session_id: str) -> bool:
        return self._store.get_session(session_id) is not None

    def home_jobs(self) -> list[HomeJob]:
        """The jobs running here, with what the cluster should report of them if this node dies."""
        homes = []
        for job in self._jobs.values():
            checkpoint = self._store.last_checkpoint(job.model_id, ids.CheckpointKind.WEIGHTS)
            homes.append(
                HomeJob(
                    model_id=job.model_id, owner=job.owner, base_model=job.model.name,
                    fine_tuning_type="full" if job.full_sync is not None else "lora", is_exclusive=job.is_exclusive,
                    last_checkpoint=checkpoint.tinker_path if checkpoint is not None else None,
                )
            )
        return homes

    def heartbeat(self, owner: str, session_id: str) -> None:
        row = self._session(owner, session_id)
        if row.is_finished:
            raise Gone(f"session {session_id} has finished")
        self._store.heartbeat(session_id)

    def finish_session(self, owner: str, session_id: str, reason: str, detail: str | None) -> None:
        self._session(owner, session_id)
        self._store.finish_session(session_id, reason, detail)
        self._end_own_groups(session_id, f"its session {session_id} has finished ({reason})")

    def _end_own_groups(self, session_id: str, why: str) -> None:
        """The session's jobs that have a group of their own (full fine-tuning, exclusive) end:
        their groups stop and free their devices, and their unnamed sampler weights go with them.
        Its LoRA jobs on a shared group are left as they are."""
        for job in [j for j in self._jobs.values() if _session_of(j.model_id) == session_id]:
            if job.group_job is None:
                continue
            del self._jobs[job.model_id]
            for sampler_id in [k for k, v in self._samplers.items() if v.group_job == job.model_id]:
                del self._samplers[sampler_id]
            self._groups.end(job.model, job.model_id, f"model {job.model_id} has stopped: {why}")

    # ------------------------------------------------------------ training jobs

    def create_model(
        self, owner: str, *, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec | None,
        user_metadata: dict[str, str], optimizer_config: dict[str, Any],
    ) -> tuple[str, str]:
        """Start a LoRA job, or a full fine-tuning job (openrl.fine_tuning_type=full) in a group of
        its own; returns (request_id, model_id). A retry returns the first request."""
        session = self._session(owner, session_id)
        model_id = ids.model_id(session_id, model_seq_id)
        existing = self._jobs.get(model_id)
        if existing is not None and 0 in existing.requests:
            return existing.requests[0], model_id
        if self._store.get_run(model_id) is not None:
            raise Conflict(f"model {model_id} already exists")
        job_settings_value, client_metadata = job_settings.parse_settings(
            session.tags, session.user_metadata, user_metadata
        )
        job_settings.require_supported(job_settings_value)
        images = self._images(job_settings_value)
        full_sync = _full_sync(job_settings_value)
        if full_sync is None:
            if lora is None:
                raise BadRequest("create_model needs lora_config for a LoRA job (or openrl.fine_tuning_type=full)")
            self._check_lora(lora)
        else:
            lora = None  # the SDK always sends a lora_config; a full job has no adapter
            _require_full_optimizer(optimizer_config)
        model = self._catalog.resolve(base_model)
        # Booked now, so that a node with no free device refuses an exclusive job.
        own_group = job_settings_value.exclusive or images.any
        if own_group:
            self._groups.reserve(model, model_id, full_sync=full_sync, exclusive=job_settings_value.exclusive, images=images)
        try:
            self._store.create_run(
                model_id, session_id=session_id, owner=owner, base_model=base_model, model_dir=model.directory,
                lora=msgspec.to_builtins(lora) if lora is not None else None,
                settings=job_settings.settings_to_dict(job_settings_value),
                user_metadata=user_metadata, optimizer_config=optimizer_config,
            )
        except BaseException:
            if own_group:  # no job, so no booking
                self._groups.end(model, model_id, f"model {model_id} could not be created")
            raise
        request_id = self._new_request(owner, model_id, "create_model")
        job = _Job(
            model_id, owner, model, lora, job_settings_value.sampler_replicas, full_sync, job_settings_value.exclusive,
            images,
        )
        job.remember(0, request_id)
        self._jobs[model_id] = job
        first = CreateAdapter(model_id, request_id, lora, optimizer=_optimizer_family(optimizer_config))
        self._nursery.start_soon(self._open_and_submit, job, first)
        return request_id, model_id

    def load_into_new_model(
        self, owner: str, *, session_id: str, model_seq_id: int, path: str, with_optimizer: bool,
        optimizer_config: dict[str, Any] | None,
    ) -> tuple[str, str]:
        """create_training_client_from_state[_with_optimizer]: a new job named as the SDK expects."""
        self._session(owner, session_id)
        model_id = ids.model_id(session_id, model_seq_id)
        existing = self._jobs.get(model_id)
        if existing is not None and 0 in existing.requests:
            return existing.requests[0], model_id
        tinker_path, source_dir, source_run = self._readable_checkpoint(owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        lora = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        model = self._catalog.resolve(source_run.base_model)
        resumed_config = _resumed_optimizer_config(path, source_run.optimizer_config, optimizer_config, with_optimizer)
        # A restore takes the checkpoint's fine_tuning_type (and, for full, its weight_sync).
        full_sync = _full_sync(job_settings.settings_from_dict(source_run.settings))
        if full_sync is not None:
            _require_full_optimizer(resumed_config)
        source_settings = job_settings.settings_from_dict(source_run.settings)
        is_exclusive = source_settings.exclusive
        images = self._images(source_settings)
        own_group = is_exclusive or images.any
        if own_group:
            self._groups.reserve(model, model_id, full_sync=full_sync, exclusive=is_exclusive, images=images)
        try:
            self._store.create_run(
                model_id, session_id=session_id, owner=owner, base_model=source_run.base_model,
                model_dir=model.directory, lora=source_run.lora, settings=source_run.settings,
                user_metadata=dict(source_run.user_metadata), optimizer_config=resumed_config,
            )
        except BaseException:
            if own_group:  # no job, so no booking
                self._groups.end(model, model_id, f"model {model_id} could not be created")
            raise
        request_id = self._new_request(owner, model_id, "load_weights")
        job = _Job(model_id, owner, model, lora, source_settings.sampler_replicas, full_sync, is_exclusive, images)
        job.remember(0, request_id)
        self._jobs[model_id] = job
        op = LoadState(
            model_id=model_id, request_id=request_id, source_dir=str(source_dir), source_uri=path,
            spec=lora, with_optimizer=with_optimizer, optimizer=_optimizer_family(resumed_config),
        )
        self._nursery.start_soon(self._open_and_submit, job, op)
        return request_id, model_id

    def _images(self, settings: job_settings.JobSettings) -> Images:
        """The job's trainer and sampler images, once the node's allow-list has let them through.

        Raises:
            BadRequest: an image matches no pattern of [workers] allowed_images (naming its key).
        """
        for key, image in (("trainer_backend", settings.trainer_image), ("sampler_backend", settings.sampler_image)):
            if image is not None:
                check_image_allowed(image, self._allowed_images, key=job_settings.PREFIX + key)
        return Images(settings.trainer_image, settings.sampler_image)

    async def _open_and_submit(self, job: _Job, first_op: TrainOp) -> None:
        try:
            group = await self._groups.get(job.model, job.group_job, job.full_sync or "delta")
            # Before the job's first op, so that its sampler replicas serve once create_model answers.
            await group.sampler.ensure_replicas(job.sampler_replicas)
            group.trainer.open_job(job.model_id, next_seq=0)
            group.trainer.submit_nowait(first_op)
        except OpenrldError as error:
            self._futures.fail(first_op.request_id, error)
            if job.group_job is not None:  # its own group never served it: free the devices it booked
                self._groups.end(job.model, job.model_id, f"model {job.model_id} failed to start: {error.detail}")

    def model_status(self, owner: str, model_id: str, *, sees_all: bool = False) -> ModelStatus:
        """GET /openrl/v1/models/{model_id}/status: the job's state, workers, queues and progress.

        `sees_all`: the caller is the operator (api/auth.py), who may read any user's.

        Raises:
            NotFound: no such model, or not the caller's.
        """
        run = self._store.get_run(model_id)
        if run is None or (run.owner != owner and not sees_all):
            raise NotFound(f"no model {model_id!r}")
        settings = job_settings.settings_from_dict(run.settings)
        checkpoint = self._store.last_checkpoint(model_id, ids.CheckpointKind.WEIGHTS)
        job = self._jobs.get(model_id)
        facts = JobFacts(
            model_id=model_id, base_model=run.base_model, fine_tuning_type=settings.fine_tuning_type.value,
            is_exclusive=settings.exclusive, is_resident=job is not None,
            last_checkpoint=checkpoint.tinker_path if checkpoint is not None else None,
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
        run = self._store.get_run(model_id)
        if run is None or run.owner != owner:
            raise NotFound(f"no model {model_id!r}")
        model = self._catalog.resolve(run.base_model)
        return JobInfo(
            model_id=model_id, base_model=run.base_model, tokenizer_id=model.tokenizer_id or run.base_model,
            arch=model.arch,
            lora=msgspec.convert(run.lora, LoraSpec) if run.lora is not None else None,
            optimizer_config=dict(run.optimizer_config),
        )

    def _job(self, owner: str, model_id: str) -> _Job:
        job = self._jobs.get(model_id)
        if job is None or job.owner != owner:
            run = self._store.get_run(model_id)
            if run is not None and run.owner == owner:
                session = self._store.get_session(run.session_id)
                if session is not None and session.is_finished:
                    raise Gone(f"model {model_id} has stopped: its session {run.session_id} has finished")
                raise Gone(
                    f"model {model_id} is not resident (the daemon restarted); resume it with "
                    f"create_training_client_from_state from its last checkpoint"
                )
            raise NotFound(f"no model {model_id!r}")
        return job

    def _submit_train(self, owner: str, model_id: str, seq_id: int, kind: str, make_op) -> str:
        job = self._job(owner, model_id)
        first = job.requests.get(seq_id)
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
        now = trio.current_time()
        if now - job.touched_at >= TOUCH_EVERY_S:
            job.touched_at = now
            self._store.touch_run(model_id)
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
        fresh = seq_id not in job.requests
        if fresh and batch.loss_fn == "stable_reinforce":
            # Provenance is resolved here, where the records live; a bad span fails the
            # request's future in its turn (losses.md §1.6), so its seq_id is not orphaned.
            try:
                batch = msgspec.structs.replace(
                    batch, data=self._groups.stability.resolve(batch.data, _session_of(model_id), trio.current_time())
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
        if seq_id not in job.requests:
            self._register_sampler(
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
        tinker_path, source_dir, source_run = self._readable_checkpoint(owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        spec = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        if spec != job.lora:
            def shape(lora: LoraSpec | None) -> str:
                return "full fine-tuning" if lora is None else f"LoRA config {lora}"

            raise BadRequest(f"{path}: its {shape(spec)} differs from model {model_id}'s {shape(job.lora)}")
        run = self._store.get_run(model_id)
        family = _optimizer_family(run.optimizer_config if run is not None else {})
        if with_optimizer and _optimizer_family(source_run.optimizer_config) != family:
            raise BadRequest(
                f"{path}: its optimizer state is {_optimizer_family(source_run.optimizer_config)!r}; model "
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

    # ------------------------------------------------------------ checkpoints

    def _readable_checkpoint(self, owner: str, path: str):
        """(TinkerPath, directory, run row) for a checkpoint `owner` may read, else 404.

        On a shared checkpoint root, a checkpoint another node wrote (a dead
        node's, say) is adopted from its manifest first, so any node resumes it.
        """
        tinker_path = ids.parse_tinker_path(path)
        row = self._store.get_checkpoint(tinker_path.run_id, tinker_path.kind, tinker_path.name)
        if row is None:
            row = self._store.adopt_checkpoint(tinker_path)
        if row is None or (row.owner != owner and not row.public):
            raise NotFound(f"no checkpoint {path}")
        run = self._store.get_run(tinker_path.run_id)
        if run is None:
            raise NotFound(f"no training run {tinker_path.run_id!r}")
        directory = self._store.checkpoint_dir(tinker_path.run_id, tinker_path.kind, tinker_path.name)
        return tinker_path, directory, run

    # ------------------------------------------------------------ sampling

    def _register_sampler(
        self, owner: str, sampler_id: str, model: ModelEntry, *, version: str | None, source_dir: str | None,
        model_path: str | None, run_id: str | None, inflight_model: str | None = None,
        group_job: str | None = None,
    ) -> None:
        if sampler_id in self._samplers:
            return
        session_id = sampler_id.split(":", 1)[0]
        if self._store.get_sampler(sampler_id) is None:
            self._store.create_sampler(
                sampler_id, session_id=session_id, owner=owner, base_model=model.name,
                model_path=model_path, run_id=run_id,
            )
        self._samplers[sampler_id] = _SamplingSession(
            sampler_id, owner, model, version, source_dir, model_path, inflight_model, group_job
        )

    def create_sampling_session(
        self, owner: str, *, session_id: str, sampling_session_seq_id: int, base_model: str | None,
        model_path: str | None,
    ) -> str:
        self._session(owner, session_id)
        sampler_id = ids.sampling_session_id(session_id, sampling_session_seq_id)
        if sampler_id in self._samplers:
            return sampler_id
        if model_path is not None:
            tinker_path, source_dir, run = self._readable_checkpoint(owner, model_path)
            model = self._catalog.resolve(run.base_model)
            self._register_sampler(
                owner, sampler_id, model, version=tinker_path.uri, source_dir=str(source_dir),
                model_path=tinker_path.uri, run_id=tinker_path.run_id, group_job=_full_group(run),
            )
        elif base_model is not None:
            model = self._catalog.resolve(base_model)
            self._register_sampler(owner, sampler_id, model, version=None, source_dir=None, model_path=None, run_id=None)
        else:
            raise BadRequest("create_sampling_session needs base_model or model_path")
        # Load the engines now, so that the first sample does not pay for it.
        session = self._samplers[sampler_id]
        self._nursery.start_soon(self._warm_group, session.model, session.group_job)
        return sampler_id

    async def _warm_group(self, model: ModelEntry, group_job: str | None = None) -> None:
        try:
            await self._groups.get(model, group_job)
        except OpenrldError:
            pass  # the first sample reports the same error on its own future

    def _sampling_session(self, owner: str, sampler_id: str) -> _SamplingSession:
        session = self._samplers.get(sampler_id)
        if session is not None and session.owner == owner:
            return session
        row = self._store.get_sampler(sampler_id)
        if row is None or row.owner != owner:
            raise NotFound(f"no sampling session {sampler_id!r}")
        if row.model_path is None and row.run_id is not None:
            session_row = self._store.get_session(row.session_id)
            if session_row is not None and session_row.is_finished and row.run_id not in self._jobs:
                raise Gone(
                    f"sampling session {sampler_id} held unnamed weights of model {row.run_id}, which stopped "
                    f"when its session {row.session_id} finished"
                )
            raise Gone(f"sampling session {sampler_id} held unnamed weights lost in a restart; save them again")
        group_job = None
        if row.model_path is not None:
            tinker_path, source_dir, source_run = self._readable_checkpoint(owner, row.model_path)
            version, source, group_job = tinker_path.uri, str(source_dir), _full_group(source_run)
        else:
            version, source = None, None
        model = self._catalog.resolve(row.base_model)
        self._samplers[sampler_id] = _SamplingSession(
            sampler_id, owner, model, version, source, row.model_path, group_job=group_job
        )
        return self._samplers[sampler_id]

    def sampler_info(self, owner: str, sampler_id: str) -> SamplerInfo:
        session = self._sampling_session(owner, sampler_id)
        return SamplerInfo(sampler_id=sampler_id, base_model=session.model.name, model_path=session.model_path)

    def sample(
        self, owner: str, sampler_id: str, seq_id: int, job: SampleJob, *, record_stability_info: bool = False
    ) -> tuple[str, list[str]]:
        """Queue a sample; returns (request_id, sequence ids). A retried seq_id returns the first.

        With `record_stability_info`, each sequence is recorded under its id when it
        finishes, for stable_reinforce (actors/stability.py).
        """
        session = self._sampling_session(owner, sampler_id)
        first = session.requests.get(seq_id)
        if first is not None:
            return first
        if len(job.prompt) >= session.model.max_context:
            raise BadRequest(
                f"prompt has {len(job.prompt)} tokens; the model's context is {session.model.max_context}"
            )
        request_id = self._new_request(owner, sampler_id, "sample")
        sequence_ids = [f"{sampler_id}:{seq_id}:{i}" for i in range(job.num_samples)]
        op = Sample(
            request_id=request_id, version=session.version, job=job, source_dir=session.source_dir,
            sampler_id=sampler_id, inflight_model=session.inflight_model,
            record_ids=tuple(sequence_ids) if record_stability_info else None,
        )
        group = self._groups.get_nowait(session.model, session.group_job)
        try:
            if group is None:
                self._nursery.start_soon(self._start_and_sample, session.model, op, session.group_job)
            else:
                group.sampler.submit_nowait(op)
        except OpenrldError:
            self._futures.fail(request_id, Gone("not queued"))
            raise
        self._usage.sample_submitted(
            request_id=request_id, sampler_id=sampler_id, owner=owner, base_model=session.model.name,
            prompt_tokens=len(job.prompt),
        )
        session.requests[seq_id] = (request_id, sequence_ids)
        if len(session.requests) > SEQ_MEMORY:
            del session.requests[min(session.requests)]
        return request_id, sequence_ids

    def cancel_sample(self, owner: str, request_id: str) -> None:
        """cancel_future: free an abandoned sample's queued or running work, and fail its future.

        A finished request is left as it is. Raises NotFound for a request that is not the caller's.
        """
        if self._futures.owner_of(request_id) != owner:
            raise NotFound(f"no request {request_id!r}")
        if self._futures.kind_of(request_id) != "sample":
            raise BadRequest(f"request {request_id} is not a sample; only samples can be cancelled")
        for group in self._groups.all_groups():
            if group.sampler.cancel(request_id):
                self._futures.fail(request_id, BadRequest("sample cancelled by the client (cancel_future)"))
                return

    async def _start_and_sample(self, model: ModelEntry, op: Sample, group_job: str | None = None) -> None:
        try:
            group = await self._groups.get(model, group_job)
            group.sampler.submit_nowait(op)
        except OpenrldError as error:
            self._futures.fail(op.request_id, error)

    # ------------------------------------------------------------ helpers

    def _new_request(self, owner: str, model_id: str, kind: str) -> str:
        request_id = ids.new_request_id(self._id_tag)
        self._futures.create(request_id, model_id=model_id, kind=kind, owner=owner)
        return request_id

    def _check_lora(self, lora: LoraSpec) -> None:
        if not 1 <= lora.rank <= self._max_lora_rank:
            raise BadRequest(f"lora_config.rank: expected 1..{self._max_lora_rank}, got {lora.rank}")

    def group_of(self, model: ModelEntry) -> Group | None:
        return self._groups.get_nowait(model)


def _session_of(model_id: str) -> str:
    """The ServiceClient session of a model or sampling session id ("<session>:train:<n>")."""
    return model_id.split(":", 1)[0]


def _full_sync(settings: job_settings.JobSettings) -> str | None:
    """A full fine-tuning job's weight_sync ("delta" or "full"); None for a LoRA job."""
    if settings.fine_tuning_type is not job_settings.FineTuningType.FULL:
        return None
    return settings.weight_sync.value


def _full_group(run: Any) -> str | None:
    """The group that samples a run's checkpoints: the run's own when it trained every weight."""
    return run.run_id if run.lora is None else None


def _require_full_optimizer(optimizer_config: dict[str, Any]) -> None:
    """optimizers.md §1.1: Dimuon is defined on LoRA matrices, so a full job is refused it."""
    family = _optimizer_family(optimizer_config)
    if family != "adamw":
        raise BadRequest(
            f"optimizer_config.type {family!r}: dimuon needs a LoRA model (openrl.fine_tuning_type=full trains with "
            f"adamw)",
            key="optimizer_config",
        )


def _optimizer_family(config: dict[str, Any]) -> str:
    """"adamw" or "dimuon" from a stored optimizer_config (api/wire.py validated it)."""
    return str(config.get("type", "adamw"))


def _resumed_optimizer_config(
    path: str, stored: dict[str, Any], requested: dict[str, Any] | None, with_optimizer: bool
) -> dict[str, Any]:
    """The optimizer of a model created from a checkpoint (optimizers.md §1.4).

    With optimizer state it is the checkpoint's, and a request for another family is an
    error; without, it is the requested one, else AdamW, whatever the checkpoint used.

    Raises:
        BadRequest: `requested` differs from the checkpoint's family while restoring its state.
    """
    if not with_optimizer:
        return dict(requested) if requested is not None else {"type": "adamw"}
    if requested is not None and _optimizer_family(requested) != _optimizer_family(stored):
        raise BadRequest(
            f"{path}: cannot override restored optimizer state: the checkpoint's optimizer_config is {stored}, "
            f"the request's is {requested}",
            key="optimizer_config",
        )
    return dict(stored)
