"""A node's request tables on stand-in engines: the job table, the sessions and the sampling
sessions driven directly, as the API calls them, without HTTP, torch or a daemon.

Everything above the engine edge is real: the store (SQLite in a temporary data dir),
the future table, the group table with its trainer and sampler actors, the checkpoint
writer. Below it, `StandInEngines` builds torch-free engines that note every call, so
that a test reads which engine ran what, in which order (as vLLM drives its scheduler
and nanochat its engine with a mock model). The end-to-end tests run the same paths
through the SDK and real engines.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio

from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.durable_commits import DurableCommits
from openrld.actors.futures import Completed, Failed, FutureTable, Outcome
from openrld.actors.groups import GroupTable
from openrld.actors.job_registry import JobRegistry
from openrld.actors.jobs import JobTable
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.usage import UsageMeter
from openrld.batches import (
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimResult,
    SampledSequence,
    SampleJob,
    SampleResult,
    SamplingSpec,
    TrainDatum,
)
from openrld.engine_types import Finished, ParkReport, ResumeReport
from openrld.errors import BadRequest, EngineLost, ServerError
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.store import Store

OWNER = "alice"
MODEL = "tiny"  # the base model the node serves (a configured directory: a config.json only)
OTHER_MODEL = "tiny-other"  # a second base model of the same shape, in a directory of its own
ALIAS = "tiny-alias"  # MODEL's directory under another name
MAX_CONTEXT = 32
MAX_LORA_RANK = 8
SPEC = LoraSpec(rank=2)
SETTLE_S = 5.0  # every future here settles in milliseconds; past this a test fails instead of hanging
REFUSED_LOSS = "refused_by_engine"  # a loss_fn the stand-in trainer refuses with BadRequest
BROKEN_LOSS = "breaks_engine"  # a loss_fn on which the stand-in trainer raises ValueError
LOST_LOSS = "loses_engine"  # a loss_fn on which the stand-in trainer is lost (EngineLost)
LOST_DETAIL = "trainer process died (exit status -9)"


# ---------------------------------------------------------------- stand-in engines


class StandInEngine:
    """What every engine has: turns on a device (never taken here: the node has no time-slicers)."""

    def __init__(self, label: str) -> None:
        self.label = label  # "<base model> <role>", or "<base model>/<job> <role>" for a job's own group
        self.is_parked = False
        self.last_sync = None
        self.closed = False

    def park(self) -> ParkReport:
        self.is_parked = True
        return ParkReport("cpu", 0, 0, 0, 0, 0, 0, 0.0)

    def resume(self) -> ResumeReport:
        self.is_parked = False
        return ResumeReport("cpu", 0, 0, 0.0)

    def close(self) -> None:
        self.closed = True


def marks(batch: ForwardBackwardBatch) -> list[int]:
    """The first token of each datum: what a test names a batch by."""
    return [int(datum.tokens[0]) for datum in batch.data]


class StandInTrainer(StandInEngine):
    """Adapters by name. `passes` lists each forward_backward batch's marks in the order the engine
    ran them; `calls` every other call. A batch's loss_fn can make the engine refuse it or break."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.adapters: dict[str, LoraSpec | None] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.passes: list[list[int]] = []
        self.batches: list[ForwardBackwardBatch] = []  # every batch it ran, as it reached the engine

    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str) -> None:
        self.calls.append(("add_adapter", name, spec, optimizer))
        self.adapters[name] = spec

    def drop_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        if batch.loss_fn == REFUSED_LOSS:
            raise BadRequest(f"loss_fn {REFUSED_LOSS!r} is not one this engine knows")
        if batch.loss_fn == BROKEN_LOSS:
            raise ValueError("the engine broke")
        if batch.loss_fn == LOST_LOSS:
            raise EngineLost(LOST_DETAIL)
        self.passes.append(marks(batch))
        self.batches.append(batch)
        # One logprob per model-input token, -1.0 each; the loss is the sum of the batch's marks.
        return ForwardBackwardResult(
            logprobs=[np.full(len(datum.tokens), -1.0, np.float32) for datum in batch.data],
            metrics={"loss:sum": float(sum(marks(batch)))},
        )

    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        return [self.forward_backward(name, batch) for batch in batches]

    def forward_backward_then_step(
        self, name: str, batches: list[ForwardBackwardBatch], params: Any
    ) -> tuple[list[ForwardBackwardResult], OptimResult | None]:
        results = self.forward_backward_many(name, batches)
        return results, self.optim_step(name, params) if params is not None else None

    def optim_step(self, name: str, params: Any) -> OptimResult:
        self.calls.append(("optim_step", name, params.learning_rate))
        return OptimResult(metrics={"learning_rate:mean": params.learning_rate})

    def adapter_tensors(self, name: str) -> str:
        return f"{name} inflight weights"

    def sampler_payload(self, name: str, version: str) -> str:
        return f"{name} weights as {version}"

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        return self._write(directory, "adapter_model.safetensors", f"{name} on {base_model}")

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        return self._write(directory, "adapter_model.safetensors", f"{name} for sampling")

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int:
        return self._write(directory, "state.safetensors", f"{name} state")

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str
    ) -> None:
        self.calls.append(("load_state", name, (directory / "state.safetensors").read_text(), with_optimizer))
        self.adapters[name] = spec

    @staticmethod
    def _write(directory: Path, filename: str, text: str) -> int:
        (directory / filename).write_text(text)
        return len(text)


class StandInSampler(StandInEngine):
    """Weight versions by name; each request answers `num_samples` sequences at once, each the
    prompt's last token followed by the sequence's index. `added` lists (request id, version) as
    requests arrive. With `gate` set, a step waits until the gate opens."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.versions: dict[str, object] = {}  # version -> the payload or checkpoint text it loaded
        self.added: list[tuple[str, str | None]] = []
        self.cancelled: list[str] = []
        self.gate: threading.Event | None = None
        self.unfinished_steps = 0  # the next steps that finish nothing: requests that take several steps
        self._live: dict[str, tuple[SampleJob, str | None]] = {}  # request id -> (its job, its version)

    def load_version(self, version: str, payload: object, spec: LoraSpec | None) -> None:
        self.versions[version] = payload

    def load_checkpoint(self, version: str, directory: Path) -> None:
        self.versions[version] = (directory / "adapter_model.safetensors").read_text()

    def drop_version(self, version: str) -> None:
        self.versions.pop(version, None)

    def versions_in_use(self) -> set[str]:
        return {version for _, version in self._live.values() if version is not None}

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        if version is not None and version not in self.versions:
            raise KeyError(f"version {version} is not loaded")
        self.added.append((request_id, version))
        self._live[request_id] = (job, version)

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return self._live.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> list[Finished]:
        if self.gate is not None:
            self.gate.wait(SETTLE_S)
        if self.unfinished_steps:
            self.unfinished_steps -= 1
            return []
        # A request whose version left the engine while it ran fails, as a real engine's would.
        finished = [
            Finished(request_id, _answer(job)) if version is None or version in self.versions
            else Finished(request_id, None, ServerError(f"version {version} was dropped mid-flight"))
            for request_id, (job, version) in self._live.items()
        ]
        self._live.clear()
        return finished


def _answer(job: SampleJob) -> SampleResult:
    last = int(job.prompt[-1])
    return SampleResult(
        sequences=[
            SampledSequence(
                tokens=np.array([last, i], np.int32), logprobs=np.array([-0.5, -0.5], np.float32),
                stop_reason="length",
            )
            for i in range(job.num_samples)
        ]
    )


class StandInEngines:
    """The node's engine factory: builds stand-ins and keeps each, by label, in build order."""

    def __init__(self) -> None:
        self.trainers: list[StandInTrainer] = []
        self.samplers: list[StandInSampler] = []
        self.failing_builds = 0  # the next trainer builds that raise, as a model that cannot load

    def on(self, device: str) -> StandInEngines:
        return self

    def trainer(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return lambda: self._trainer(_label(model, job, "trainer"))

    def full_trainer(
        self, model: ModelEntry, weight_sync: str, image: str | None = None, job: str | None = None
    ) -> Callable[[], Any]:
        return lambda: self._trainer(_label(model, job, "full trainer"))

    def automodel_trainer(self, model: ModelEntry, **kwargs: Any) -> Callable[[], Any]:
        raise AssertionError("no Automodel here")

    def sampler(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return lambda: self._sampler(_label(model, job, "sampler"))

    def full_sampler(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return lambda: self._sampler(_label(model, job, "full sampler"))

    def trainer_of(self, label: str) -> StandInTrainer:
        (found,) = [t for t in self.trainers if t.label == label]
        return found

    def sampler_of(self, label: str) -> StandInSampler:
        (found,) = [s for s in self.samplers if s.label == label]
        return found

    def _trainer(self, label: str) -> StandInTrainer:
        if self.failing_builds:
            self.failing_builds -= 1
            raise OSError("no config.json in the model directory")
        self.trainers.append(StandInTrainer(label))
        return self.trainers[-1]

    def _sampler(self, label: str) -> StandInSampler:
        self.samplers.append(StandInSampler(label))
        return self.samplers[-1]


def _label(model: ModelEntry, job: str | None, role: str) -> str:
    return f"{model.name} {role}" if job is None else f"{model.name}/{job} {role}"


# ---------------------------------------------------------------- the node


class Node(msgspec.Struct):
    """The request tables of one node, as `daemon.serve` wires them, on stand-in engines."""

    store: Store
    engines: StandInEngines
    futures: FutureTable
    groups: GroupTable
    sessions: SessionTable
    sampling: SamplingSessions
    jobs: JobTable
    usage: UsageMeter
    catalog: ModelCatalog
    nursery: trio.Nursery

    async def session(self, owner: str = OWNER, tags: list[str] | None = None) -> str:
        return await self.sessions.create(
            owner, tags=tags or [], user_metadata={}, sdk_version="0.38.0", project_id=None, display_name=None
        )

    def create_model(
        self, session_id: str, seq: int = 0, *, owner: str = OWNER, lora: LoraSpec | None = SPEC,
        user_metadata: dict[str, str] | None = None, optimizer_config: dict[str, Any] | None = None,
        base_model: str = MODEL,
    ) -> tuple[str, str]:
        return self.jobs.create_model(
            owner, session_id=session_id, model_seq_id=seq, base_model=base_model, lora=lora,
            user_metadata=user_metadata or {}, optimizer_config=optimizer_config or {"type": "adamw"},
        )

    async def new_model(self, owner: str = OWNER, **kwargs: Any) -> str:
        """A LoRA job (or what `kwargs` make it) in a new session, created; its model id."""
        session_id = await self.session(owner)
        request_id, model_id = self.create_model(session_id, owner=owner, **kwargs)
        await self.completed(request_id, owner)
        return model_id

    async def outcome(self, request_id: str, owner: str = OWNER) -> Outcome:
        """The request's outcome, once it settles; fails the test past SETTLE_S."""
        outcome = await self.futures.wait(request_id, owner=owner, hold_s=SETTLE_S)
        assert outcome is not None, f"request {request_id} still pending after {SETTLE_S} s"
        return outcome

    async def completed(self, request_id: str, owner: str = OWNER) -> Any:
        outcome = await self.outcome(request_id, owner)
        assert isinstance(outcome, Completed), outcome
        return outcome.value

    async def failed(self, request_id: str, owner: str = OWNER) -> Failed:
        outcome = await self.outcome(request_id, owner)
        assert isinstance(outcome, Failed), outcome
        return outcome

    def usage_rows(self, owner: str = OWNER) -> list[tuple[str, str, int]]:
        """(session, kind, tokens) counted for `owner` so far, written to the store as maintenance does."""
        self.usage.flush(self.store)
        rows = self.store.usage_ledger.of_owner(owner, datetime(1970, 1, 1, tzinfo=UTC), datetime(1970, 1, 2, tzinfo=UTC))
        return sorted((row.session_id, row.kind, row.tokens) for row in rows)


def batch(*mark_tokens: int, loss_fn: str = "cross_entropy", forward_only: bool = False) -> ForwardBackwardBatch:
    """One datum per mark: its model input is [mark, mark + 1], its targets the next tokens."""
    data = [
        TrainDatum(
            tokens=np.array([mark, mark + 1], np.int64),
            inputs={"target_tokens": np.array([mark + 1, mark + 2], np.int64), "weights": np.ones(2, np.float32)},
        )
        for mark in mark_tokens
    ]
    return ForwardBackwardBatch(data=data, loss_fn=loss_fn, loss_config={}, forward_only=forward_only)


def sample_job(prompt: list[int], num_samples: int = 1) -> SampleJob:
    params = SamplingSpec(max_tokens=2, temperature=0.0, seed=0, stop_at_eos=False)
    return SampleJob(prompt=np.array(prompt, np.int64), num_samples=num_samples, params=params)


def model_dir(root: Path, name: str = MODEL) -> Path:
    """A base model directory as the catalog reads it: its config.json, and no weights (nothing loads them)."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": MAX_CONTEXT}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


async def open_node(
    store: Store, nursery: trio.Nursery, models_root: Path, *, sample_queue_limit: int = 64,
    usage: UsageMeter | None = None, id_tag: str = "",
) -> Node:
    """The node's tables over `store`, their actors in `nursery`, as `daemon.serve` builds them."""
    engines = StandInEngines()
    futures = FutureTable(store.requests)
    commits = DurableCommits(store.database.sync)
    directory = str(model_dir(models_root))
    catalog = ModelCatalog({MODEL: directory, ALIAS: directory, OTHER_MODEL: str(model_dir(models_root, OTHER_MODEL))})
    groups = GroupTable(
        nursery=nursery, engines=engines, limiter=trio.CapacityLimiter(1), futures=futures,
        checkpoints=CheckpointWriter(store, commits), sample_queue_limit=sample_queue_limit,
    )
    usage = usage if usage is not None else UsageMeter(now=lambda: 0.0)  # every count in the hour from 0
    sessions = SessionTable(store=store, commits=commits, id_tag=id_tag)
    registry = JobRegistry()
    sampling = SamplingSessions(
        nursery=nursery, store=store, catalog=catalog, groups=groups, futures=futures, sessions=sessions,
        jobs=registry, usage=usage, id_tag=id_tag,
    )
    jobs = JobTable(
        nursery=nursery, store=store, catalog=catalog, groups=groups, futures=futures, sessions=sessions,
        registry=registry, sampling=sampling, max_lora_rank=MAX_LORA_RANK, usage=usage, commits=commits,
        id_tag=id_tag,
    )
    return Node(store, engines, futures, groups, sessions, sampling, jobs, usage, catalog, nursery)


@asynccontextmanager
async def running_node(tmp_path: Path, **kwargs: Any) -> AsyncIterator[Node]:
    """A node on a fresh data dir under `tmp_path`; its actors stop when the block ends."""
    with Store.open(tmp_path / "data") as store:
        async with trio.open_nursery() as nursery:
            yield await open_node(store, nursery, tmp_path / "models", **kwargs)
            nursery.cancel_scope.cancel()
