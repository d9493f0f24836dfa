"""The sampler actor: one per LoRA group (one base model on one device).

It owns the group's sampling queue, the immutable weight versions it can serve,
and its engine (`gpu.torch_sampler`, run in a worker thread under the device's
capacity limiter).

Versions: a version is a name (a `tinker://…/sampler_weights/…` or
`…/weights/…` path, or a sampling session id for unnamed saves) bound once to
adapter weights; `None` is the base model. Weights published by the trainer
are held on the host; weights saved on disk are read when first sampled. At
most `max_loaded` versions live in the engine at once, least recently used out
first, and an evicted version is reloaded from the host copy or the disk.

Requests run in arrival order (continuous batching is the sampler engine's
business, not this queue's). A full queue answers 429 at submission.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import msgspec
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.actors.mailbox import Mailbox
from openrld.batches import LoraSpec, SampleJob
from openrld.errors import Gone, OpenrldError, ServerError

logger = logging.getLogger(__name__)

MAX_LOADED_VERSIONS = 32  # adapters resident in the engine at once
MAX_HOST_VERSIONS = 256  # unnamed (in-memory only) versions kept for reloading


class Sample(msgspec.Struct, frozen=True):
    request_id: str
    version: str | None  # None: the base model
    job: SampleJob
    source_dir: str | None = None  # where the version's adapter lies on disk, if it does


class SamplerStatistics(msgspec.Struct, frozen=True):
    queue_depth: int
    loaded_versions: int
    host_versions: int
    samples_done: int
    samples_failed: int
    busy: bool


class VersionCache:
    """Which versions the engine holds, in LRU order, and the host copies. Pure: no I/O."""

    def __init__(self, max_loaded: int, max_host: int) -> None:
        self._max_loaded = max_loaded
        self._max_host = max_host
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.host: OrderedDict[str, tuple[Any, LoraSpec]] = OrderedDict()

    def remember(self, version: str, tensors: Any, spec: LoraSpec) -> None:
        self.host[version] = (tensors, spec)
        self.host.move_to_end(version)
        while len(self.host) > self._max_host:
            self.host.popitem(last=False)

    def touch(self, version: str) -> bool:
        """Mark `version` used; True if the engine already holds it."""
        if version in self.loaded:
            self.loaded.move_to_end(version)
            return True
        return False

    def admit(self, version: str) -> list[str]:
        """Record that the engine now holds `version`; return the versions to drop to make room."""
        self.loaded[version] = None
        evicted: list[str] = []
        while len(self.loaded) > self._max_loaded:
            old, _ = self.loaded.popitem(last=False)
            evicted.append(old)
        return evicted


class SamplerHandle:
    def __init__(self, actor: "SamplerActor") -> None:
        self._actor = actor

    def submit_nowait(self, op: Sample) -> None:
        self._actor.mailbox.post(op)

    async def publish_version(self, version: str, tensors: Any, spec: LoraSpec) -> None:
        self._actor.versions.remember(version, tensors, spec)

    def statistics(self) -> SamplerStatistics:
        return self._actor.statistics()


class SamplerActor:
    def __init__(
        self,
        *,
        name: str,
        build_engine: Callable[[], Any],
        limiter: trio.CapacityLimiter,
        futures: FutureTable,
        queue_limit: int,
    ) -> None:
        self.name = name
        self.mailbox: Mailbox[Sample] = Mailbox(f"sampler {name}", queue_limit)
        self.versions = VersionCache(MAX_LOADED_VERSIONS, MAX_HOST_VERSIONS)
        self._build_engine = build_engine
        self._limiter = limiter
        self._futures = futures
        self._engine: Any = None
        self._busy = False
        self._done = 0
        self._failed = 0

    async def run(self, *, task_status: trio.TaskStatus[SamplerHandle] = trio.TASK_STATUS_IGNORED) -> None:
        self._engine = await trio.to_thread.run_sync(self._build_engine, limiter=self._limiter)
        logger.info("sampler ready group=%s", self.name)
        task_status.started(SamplerHandle(self))
        async for op in self.mailbox.receive:
            self._busy = True
            try:
                result = await self._sample(op)
            except OpenrldError as error:
                self._failed += 1
                self._futures.fail(op.request_id, error)
            except Exception as error:  # one request's failure is its own; keep serving
                logger.exception("sample failed group=%s request_id=%s", self.name, op.request_id)
                self._failed += 1
                self._futures.fail(op.request_id, ServerError(f"{type(error).__name__}: {error}"))
            else:
                self._done += 1
                self._futures.resolve(op.request_id, Completed(result))
            finally:
                self._busy = False

    async def _sample(self, op: Sample) -> Any:
        if op.version is not None:
            await self._ensure_loaded(op.version, op.source_dir)
        return await trio.to_thread.run_sync(self._engine.sample, op.version, op.job, limiter=self._limiter)

    async def _ensure_loaded(self, version: str, source_dir: str | None) -> None:
        if self.versions.touch(version):
            return
        if version in self.versions.host:
            tensors, spec = self.versions.host[version]
        elif source_dir is not None:
            tensors, spec = await trio.to_thread.run_sync(_load_adapter, Path(source_dir))
        else:
            raise Gone(f"sampler weights {version} are no longer held; save them again")
        await trio.to_thread.run_sync(self._engine.load_version, version, tensors, spec, limiter=self._limiter)
        for old in self.versions.admit(version):
            await trio.to_thread.run_sync(self._engine.drop_version, old, limiter=self._limiter)

    def statistics(self) -> SamplerStatistics:
        return SamplerStatistics(
            queue_depth=self.mailbox.depth(),
            loaded_versions=len(self.versions.loaded),
            host_versions=len(self.versions.host),
            samples_done=self._done,
            samples_failed=self._failed,
            busy=self._busy,
        )


def _load_adapter(directory: Path) -> tuple[Any, LoraSpec]:
    # Imported in the worker thread, so this module never imports torch.
    from openrld.gpu.lora_io import load_adapter

    return load_adapter(directory)
