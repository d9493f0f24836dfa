"""The job table: the training jobs on this node, and the routing of their requests.

It is the face the API calls for training jobs: it submits each request to its
job's group's trainer in seq_id order, counts training tokens for usage, ends
a session's jobs when it finishes, and reports a job's status and
what the cluster should know of the jobs it is home to. Lookups take the
caller's user and answer 404 for anything not theirs, 410 for a job that is no
longer resident. The API calls it from the event loop; its methods are sync and
never wait: a job's group starts in a task of its own, so that the create
returns at once.

The ways a job comes and goes are modules of their own, which this table
builds and wires: creating one from its settings or a checkpoint, booking its
own group and recording its run in `JobOpening` (actors/job_opening.py);
adopting a dead node's job, and giving up one another node adopted, in
`JobAdoption` (actors/job_adoption.py, the daemon hands it to the cluster's
watcher); why a job is gone, in `GoneJobs` (actors/gone_jobs.py). What it
holds is elsewhere too: the resident jobs, their seq_id memory and the
settings hand-off in the pure `JobRegistry` (actors/job_registry.py); sessions
in `SessionTable` (actors/sessions.py); sampling sessions and samples in
`SamplingSessions` (actors/sampling_sessions.py); stable_reinforce provenance
in `StabilityRecords` (actors/stability.py); the status body in
actors/model_status.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import trio

from openrld import ids, model_families, settings as job_settings
from openrld.actors.checkpoints import CheckpointWriter, check_ttl, readable_checkpoint
from openrld.actors.durable_commits import DurableCommits
from openrld.actors.futures import FutureTable
from openrld.actors.gone_jobs import GoneJobs
from openrld.actors.groups import GroupTable
from openrld.actors.job_adoption import JobAdoption
from openrld.actors.job_opening import JobOpening, NodeTables
from openrld.actors.job_registry import JobRegistry, optimizer_family, session_of
from openrld.actors.model_status import GroupView, JobFacts, ModelStatus, adopted_from, build_status
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.trainer import ForwardBackward, LoadState, OptimStep, Rejected, SaveForSampler, SaveState
from openrld.actors.usage import UsageMeter
from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec
from openrld.errors import BadRequest, Conflict, Gone, NotFound, NotSupportedYet, OpenrldError, UserError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.store import Store


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
        self._id_tag = id_tag  # a clustered node's tag, at the front of the ids it mints (ids.node_tag)
        self._usage = usage
        self._store = store
        self._catalog = catalog
        self._groups = groups
        self._futures = futures
        self._sessions = sessions
        self._sampling = sampling  # the sampling sessions a job saves unnamed weights for are registered there
        self._jobs = registry  # shared with `sampling`, which only reads it
        # Called when a job starts or ends here: a clustered node gossips its jobs at once (daemon.py), so
        # that a job is known to the cluster, and can be adopted, from its first step (cluster/adoption.py).
        self.changed: Callable[[], None] = lambda: None

        def changed() -> None:  # the daemon sets `self.changed` once this table is built: call the one set then
            self.changed()

        # Why a job is not here (gone_jobs.py): its calls' 404s and 410s
        self._gone = GoneJobs(
            store=store, registry=registry, sessions=sessions, sampling=sampling, groups=groups, changed=changed
        )
        node = NodeTables(
            store=store, catalog=catalog, groups=groups, futures=futures, sessions=sessions, registry=registry,
            gone=self._gone, commits=commits, new_request=self._new_request,
        )
        # Jobs created here, or restored from a checkpoint (job_opening.py)
        opening = JobOpening(
            node, nursery=nursery, changed=changed, max_lora_rank=max_lora_rank, allowed_images=allowed_images,
            has_automodel=has_automodel, lora_sampler=lora_sampler,
        )
        self.create_model = opening.create_model
        self.load_into_new_model = opening.load_into_new_model
        # A dead node's jobs taken over here, and ours another node took (job_adoption.py): the host
        # that cluster/adoption.py's watcher drives
        self.adoption = JobAdoption(node, opening=opening, checkpoints=checkpoints, on_adopted=on_adopted)

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
        """The session finishes, and its jobs end (their later calls are 410). A job with a group of its
        own (full fine-tuning, exclusive, an image, Automodel) ends it: the group stops and frees its
        devices, and its unnamed sampler weights go with it. A LoRA job on its base model's shared group
        leaves it: its queued ops fail, and the group drops its adapter (with its gradients and optimizer
        state) and the weight versions only it published. Its named checkpoints stay on disk.

        Raises:
            NotFound: the session is not the caller's.
        """
        self._sessions.finish(owner, session_id, reason, detail)
        why = f"model {{}} has stopped: its session {session_id} has finished ({reason})"
        ended = self._jobs.remove_jobs_of(session_id)
        for job in ended:
            self._gone.end(job, why.format(job.model_id))
        self._sampling.drop_session(session_id)
        if ended:
            self.changed()  # a clustered node gossips at once that they are no longer here

    # ------------------------------------------------------------ a job's state and requests

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
        ended = self._gone.ended(model_id) if job is None else None
        adoption = job.adoption if job is not None else ended.adoption if ended is not None else None
        facts = JobFacts(
            model_id=model_id, base_model=run.base_model, fine_tuning_type=settings.fine_tuning_type.value,
            is_exclusive=settings.exclusive, is_resident=job is not None,
            last_checkpoint=checkpoint.tinker_path if checkpoint is not None else None,
            adopted_from=adopted_from(adoption) if adoption is not None else None,
            lost_detail=self._gone.detail(model_id),
            final_progress=ended.progress if ended is not None else None,
            session_finished=job is None and self._sessions.is_finished(run.session_id),
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

    def _submit_train(self, owner: str, model_id: str, seq_id: int, kind: str, make_op) -> str:
        job = self._gone.resident(owner, model_id)
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
        """A request refused once its seq_id was known: its future fails with `error` in that seq_id's turn,
        so that the job's later ops are not left waiting for it."""
        return self._submit_train(
            owner, model_id, seq_id, kind,
            lambda rid: Rejected(model_id, seq_id, rid, error.detail),
        )

    def forward_backward(self, owner: str, model_id: str, seq_id: int, batch: ForwardBackwardBatch) -> str:
        kind = "forward" if batch.forward_only else "forward_backward"
        job = self._gone.resident(owner, model_id)
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
        job = self._gone.resident(owner, model_id)
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
        job = self._gone.resident(owner, model_id)
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
        job = self._gone.resident(owner, model_id)
        tinker_path, source_dir, source_run = readable_checkpoint(self._store, owner, path)
        if tinker_path.kind is not ids.CheckpointKind.WEIGHTS and with_optimizer:
            raise BadRequest(f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false")
        spec = msgspec.convert(source_run.lora, LoraSpec) if source_run.lora is not None else None
        if spec != job.lora:
            def shape(lora: LoraSpec | None) -> str:
                return "full fine-tuning" if lora is None else f"LoRA config {lora}"

            raise BadRequest(f"{path}: its {shape(spec)} differs from model {model_id}'s {shape(job.lora)}")
        if not self._same_base_model(source_run.base_model, job.model):
            raise BadRequest(f"{path}: it was trained on {source_run.base_model!r}; model {model_id} is "
                             f"{job.model.name!r} (load it into a new model of its base model)")
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

    def _same_base_model(self, name: str, model: ModelEntry) -> bool:
        """Whether base model `name` is `model`, under its own name or another that the catalog
        resolves to the same directory; a name the node no longer serves is not."""
        if name == model.name:
            return True
        try:
            return self._catalog.resolve(name).directory == model.directory
        except OpenrldError:
            return False

    def _new_request(self, owner: str, model_id: str, kind: str) -> str:
        request_id = ids.new_request_id(self._id_tag)
        self._futures.create(request_id, model_id=model_id, kind=kind, owner=owner)
        return request_id
