"""Sampling sessions: the sampling clients this node serves, and the routing of their samples.

It owns each sampling session's record (in the store, and resident here once
used): its owner, the weights it samples (a base model, a checkpoint, the
unnamed weights a training job saved for it, or inflight weights that follow
a training job), the group whose sampler serves it, and its
`seq_id -> (request_id, sequence ids)` memory, so that a retried sample
answers with its first future. It queues samples on the group's sampler,
starting the group first where needed in a task of its own, so that the
submission returns at once; it counts their prompt tokens for usage
(actors/usage.py); and it cancels abandoned samples (cancel_future).

Stability records of the samples are kept by the sampler in the node's
`StabilityRecords` (actors/stability.py); this module only asks for them
(`record_ids`). It never writes a training job's state: the job table
(actors/jobs.py) registers the sessions a training job saves weights for, and
drops them when that job ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import msgspec
import trio

from openrld import ids, model_families
from openrld.actors.checkpoints import readable_checkpoint
from openrld.actors.futures import FutureTable
from openrld.actors.groups import GroupTable
from openrld.actors.job_registry import SEQ_MEMORY, JobRegistry, full_group_of, session_of
from openrld.actors.sampler import Sample
from openrld.actors.sessions import SessionTable
from openrld.actors.usage import UsageMeter
from openrld.batches import SampleJob
from openrld.errors import BadRequest, Gone, NotFound, OpenrldError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.model_families import Engine
from openrld.store import Store


class SamplerInfo(msgspec.Struct, frozen=True):
    sampler_id: str
    base_model: str
    model_path: str | None


class SamplingSession:
    """One resident sampling session."""

    __slots__ = (
        "sampler_id", "owner", "model", "version", "source_dir", "model_path", "requests", "inflight_model",
        "group_job", "saved_by",
    )

    def __init__(
        self, sampler_id: str, owner: str, model: ModelEntry, version: str | None,
        source_dir: str | None, model_path: str | None, inflight_model: str | None = None,
        group_job: str | None = None, saved_by: str | None = None,
    ) -> None:
        self.group_job = group_job  # the full fine-tuning run whose group samples it; None: the LoRA group
        self.saved_by = saved_by  # the training job whose unnamed or inflight weights it samples; None: none
        self.sampler_id = sampler_id
        self.owner = owner
        self.model = model
        self.version = version  # the weights version it samples; None: the base model (or inflight)
        self.source_dir = source_dir  # a checkpoint's directory, for a session made from a tinker:// path
        self.model_path = model_path
        self.inflight_model = inflight_model  # inflight: follows this training model's published weights
        self.requests: dict[int, tuple[str, list[str]]] = {}  # seq_id -> (request_id, sequence ids)

    def remember(self, seq_id: int, request_id: str, sequence_ids: list[str]) -> None:
        """`seq_id` was answered; the oldest seq_id past SEQ_MEMORY is forgotten."""
        self.requests[seq_id] = (request_id, sequence_ids)
        if len(self.requests) > SEQ_MEMORY:
            del self.requests[min(self.requests)]


class SamplingSessions:
    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        store: Store,
        catalog: ModelCatalog,
        groups: GroupTable,
        futures: FutureTable,
        sessions: SessionTable,
        jobs: JobRegistry,
        usage: UsageMeter,
        id_tag: str = "",
        lora_sampler: model_families.Engine = model_families.Engine.TORCH_SAMPLER,
    ) -> None:
        self._lora_sampler = lora_sampler  # the node's sampler_backend: what samples a base model
        self._nursery = nursery  # where groups start for a first sample; the daemon's
        self._store = store
        self._catalog = catalog
        self._groups = groups
        self._futures = futures
        self._sessions = sessions
        self._jobs = jobs  # read only: whether a run that saved unnamed weights still runs here
        self._usage = usage
        self._id_tag = id_tag  # a clustered node's tag, at the front of the ids it mints (ids.node_tag)
        self._samplers: dict[str, SamplingSession] = {}
        self._awaiting_group: set[str] = set()  # samples queued behind their group's start; a cancel drops them here

    def is_home_to(self, sampler_id: str) -> bool:
        return sampler_id in self._samplers or self._store.samplers.get(sampler_id) is not None

    def register(
        self, owner: str, sampler_id: str, model: ModelEntry, *, version: str | None, source_dir: str | None,
        model_path: str | None, run_id: str | None, inflight_model: str | None = None,
        group_job: str | None = None,
    ) -> None:
        """Record the sampling session (in the store too, once) and make it resident; a known one is left as is."""
        if sampler_id in self._samplers:
            return
        session_id = sampler_id.split(":", 1)[0]
        if self._store.samplers.get(sampler_id) is None:
            self._store.samplers.create(
                sampler_id, session_id=session_id, owner=owner, base_model=model.name,
                model_path=model_path, run_id=run_id,
            )
        self._samplers[sampler_id] = SamplingSession(
            sampler_id, owner, model, version, source_dir, model_path, inflight_model, group_job,
            saved_by=run_id if model_path is None else None,
        )

    def drop_group(self, group_job: str) -> None:
        """The own group of run `group_job` has ended: the sessions it sampled go with it."""
        self._drop(lambda session: session.group_job == group_job)

    def drop_saved_by(self, run_id: str) -> list[str]:
        """Training job `run_id` ended on a shared group: the sessions of the unnamed and inflight weights
        it saved go (a later call is 410); returns their ids, the versions its sampler drops."""
        return self._drop(lambda session: session.saved_by == run_id)

    def drop_session(self, session_id: str) -> None:
        """Session `session_id` finished: its sampling sessions leave memory (with their seq_id memory).
        One made from a checkpoint's path is made resident again from the store if it is called."""
        self._drop(lambda session: session_of(session.sampler_id) == session_id)

    def _drop(self, ends: Callable[[SamplingSession], bool]) -> list[str]:
        """Forget the sessions `ends` picks; their ids."""
        ended = [k for k, v in self._samplers.items() if ends(v)]
        for sampler_id in ended:
            del self._samplers[sampler_id]
        return ended

    def create(
        self, owner: str, *, session_id: str, sampling_session_seq_id: int, base_model: str | None,
        model_path: str | None,
    ) -> str:
        """create_sampling_session: returns the sampling session id; a retry returns the same one.

        Raises:
            NotFound: the session, or the checkpoint at `model_path`, is not the caller's.
            BadRequest: neither base_model nor model_path was given.
        """
        self._sessions.owned(owner, session_id)
        sampler_id = ids.sampling_session_id(session_id, sampling_session_seq_id)
        if sampler_id in self._samplers:
            return sampler_id
        if model_path is not None:
            tinker_path, source_dir, run = readable_checkpoint(self._store, owner, model_path)
            model = self._catalog.resolve(run.base_model)
            self.register(
                owner, sampler_id, model, version=tinker_path.uri, source_dir=str(source_dir),
                model_path=tinker_path.uri, run_id=tinker_path.run_id, group_job=full_group_of(run.lora, run.run_id),
            )
        elif base_model is not None:
            model = self._catalog.resolve(base_model)
            # A base model samples on its LoRA group, which also loads the LoRA trainer.
            model_families.check_engines(model.name, model.arch, (Engine.LORA_TRAINER, self._lora_sampler))
            self.register(owner, sampler_id, model, version=None, source_dir=None, model_path=None, run_id=None)
        else:
            raise BadRequest("create_sampling_session needs base_model or model_path")
        # Load the engines now, so that the first sample does not pay for it.
        session = self._samplers[sampler_id]
        self._nursery.start_soon(self._warm_group, session.model, session.group_job)
        return sampler_id

    async def _warm_group(self, model: ModelEntry, group_job: str | None = None) -> None:
        with contextlib.suppress(OpenrldError):  # the first sample reports the same error on its own future
            await self._groups.get(model, group_job)

    def _owned(self, owner: str, sampler_id: str) -> SamplingSession:
        """The caller's sampling session, made resident again from the store after a restart.

        Raises:
            NotFound: no such sampling session, or not the caller's.
            Gone: it held unnamed weights that are lost (its run stopped, or the daemon restarted).
        """
        session = self._samplers.get(sampler_id)
        if session is not None and session.owner == owner:
            return session
        row = self._store.samplers.get(sampler_id)
        if row is None or row.owner != owner:
            raise NotFound(f"no sampling session {sampler_id!r}")
        if row.model_path is None and row.run_id is not None:
            if self._sessions.is_finished(row.session_id) and not self._jobs.is_running(row.run_id):
                raise Gone(
                    f"sampling session {sampler_id} held unnamed weights of model {row.run_id}, which stopped "
                    f"when its session {row.session_id} finished"
                )
            raise Gone(f"sampling session {sampler_id} held unnamed weights lost in a restart; save them again")
        group_job = None
        if row.model_path is not None:
            tinker_path, source_dir, source_run = readable_checkpoint(self._store, owner, row.model_path)
            version, source = tinker_path.uri, str(source_dir)
            group_job = full_group_of(source_run.lora, source_run.run_id)
        else:
            version, source = None, None
        model = self._catalog.resolve(row.base_model)
        self._samplers[sampler_id] = SamplingSession(
            sampler_id, owner, model, version, source, row.model_path, group_job=group_job
        )
        return self._samplers[sampler_id]

    def info(self, owner: str, sampler_id: str) -> SamplerInfo:
        session = self._owned(owner, sampler_id)
        return SamplerInfo(sampler_id=sampler_id, base_model=session.model.name, model_path=session.model_path)

    def sample(
        self, owner: str, sampler_id: str, seq_id: int, job: SampleJob, *, record_stability_info: bool = False
    ) -> tuple[str, list[str]]:
        """Queue a sample; returns (request_id, sequence ids). A retried seq_id returns the first.

        With `record_stability_info`, each sequence is recorded under its id when it
        finishes, for stable_reinforce (actors/stability.py).
        """
        session = self._owned(owner, sampler_id)
        first = session.requests.get(seq_id)
        if first is not None:
            return first
        if len(job.prompt) >= session.model.max_context:
            raise BadRequest(
                f"prompt has {len(job.prompt)} tokens; the model's context is {session.model.max_context}"
            )
        request_id = ids.new_request_id(self._id_tag)
        self._futures.create(request_id, model_id=sampler_id, kind="sample", owner=owner)
        sequence_ids = [f"{sampler_id}:{seq_id}:{i}" for i in range(job.num_samples)]
        op = Sample(
            request_id=request_id, version=session.version, job=job, source_dir=session.source_dir,
            sampler_id=sampler_id, inflight_model=session.inflight_model,
            record_ids=tuple(sequence_ids) if record_stability_info else None,
        )
        group = self._groups.get_nowait(session.model, session.group_job)
        try:
            if group is None:
                self._awaiting_group.add(request_id)
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
        session.remember(seq_id, request_id, sequence_ids)
        return request_id, sequence_ids

    async def _start_and_sample(self, model: ModelEntry, op: Sample, group_job: str | None = None) -> None:
        try:
            group = await self._groups.get(model, group_job)
            if op.request_id in self._awaiting_group:  # else it was cancelled while the group started
                group.sampler.submit_nowait(op)
        except OpenrldError as error:
            self._futures.fail(op.request_id, error)
        finally:
            self._awaiting_group.discard(op.request_id)

    def cancel(self, owner: str, request_id: str) -> None:
        """cancel_future: free an abandoned sample's queued or running work, and fail its future.

        A finished request is left as it is. Raises NotFound for a request that is not the caller's.
        """
        if self._futures.owner_of(request_id) != owner:
            raise NotFound(f"no request {request_id!r}")
        if self._futures.kind_of(request_id) != "sample":
            raise BadRequest(f"request {request_id} is not a sample; only samples can be cancelled")
        waits_for_group = request_id in self._awaiting_group
        self._awaiting_group.discard(request_id)
        if waits_for_group or any(group.sampler.cancel(request_id) for group in self._groups.all_groups()):
            self._futures.fail(request_id, BadRequest("sample cancelled by the client (cancel_future)"))
