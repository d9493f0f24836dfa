"""Worker groups: one trainer and one sampler per base model on this node.

Every LoRA job on a base model shares its group (many adapters, one resident
model). A group starts on first use; concurrent first users wait for the same
start, and a failed start is reported to each of them and retried by the next.
The group's actors run in the table's nursery and die with it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import msgspec
import trio

from openrld.actors.futures import FutureTable
from openrld.actors.sampler import SamplerActor, SamplerHandle, SamplerStatistics
from openrld.actors.trainer import CheckpointSink, TrainerActor, TrainerHandle, TrainerStatistics
from openrld.errors import ServerError
from openrld.model_catalog import ModelEntry

logger = logging.getLogger(__name__)


class EngineFactory(Protocol):
    """Builds engines for a model; called in a worker thread. Lives outside actors/ (it imports torch)."""

    def trainer(self, model: ModelEntry) -> Callable[[], Any]: ...
    def sampler(self, model: ModelEntry) -> Callable[[], Any]: ...


class Group(msgspec.Struct, frozen=True):
    model: ModelEntry
    trainer: TrainerHandle
    sampler: SamplerHandle


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
    ) -> None:
        self._nursery = nursery
        self._engines = engines
        self._limiter = limiter
        self._futures = futures
        self._checkpoints = checkpoints
        self._sample_queue_limit = sample_queue_limit
        self._groups: dict[str, Group] = {}
        self._starting: dict[str, trio.Event] = {}
        self._start_errors: dict[str, str] = {}

    def get_nowait(self, model: ModelEntry) -> Group | None:
        return self._groups.get(model.directory)

    def all_groups(self) -> list[Group]:
        return list(self._groups.values())

    async def get(self, model: ModelEntry) -> Group:
        """The group for `model`, starting it if needed.

        Raises:
            ServerError: the engines could not be built (the message says why).
        """
        key = model.directory
        while key not in self._groups:
            starting = self._starting.get(key)
            if starting is None:
                self._starting[key] = trio.Event()
                try:
                    self._groups[key] = await self._start(model)
                    self._start_errors.pop(key, None)
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

    async def _start(self, model: ModelEntry) -> Group:
        logger.info("starting group base_model=%s dir=%s", model.name, model.directory)
        sampler = await self._nursery.start(
            SamplerActor(
                name=model.name,
                build_engine=self._engines.sampler(model),
                limiter=self._limiter,
                futures=self._futures,
                queue_limit=self._sample_queue_limit,
            ).run
        )
        trainer = await self._nursery.start(
            TrainerActor(
                name=model.name,
                build_engine=self._engines.trainer(model),
                limiter=self._limiter,
                futures=self._futures,
                checkpoints=self._checkpoints,
                sampler=sampler,
            ).run
        )
        return Group(model=model, trainer=trainer, sampler=sampler)

    def statistics(self) -> list[GroupStatistics]:
        return [
            GroupStatistics(base_model=g.model.name, trainer=g.trainer.statistics(), sampler=g.sampler.statistics())
            for g in self._groups.values()
        ]
