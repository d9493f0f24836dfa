"""Base classes for a custom trainer or sampler image.

A custom image runs a program that builds its engine and calls `serve`:

    from openrld.worker import base, server

    class MyTrainer(base.TrainerWorker):
        def __init__(self, start): ...          # start.model_dir, start.device, start.options
        def add_adapter(self, name, spec, optimizer): ...
        def forward_backward(self, name, batch): ...
        def optim_step(self, name, params): ...
        def sampler_payload(self, name, version): ...   # {tensor name: torch tensor}
        def sampler_checkpoint(self, name, directory): ...
        def save_state(self, name, directory, with_optimizer): ...
        def load_state(self, name, directory, spec, with_optimizer, optimizer): ...

    server.serve(MyTrainer, role="trainer", engine="my-trainer:1")

What a subclass must write raises NotSupportedYet here (every call of the
`engine_types` Protocol that this module does not write), so a job that calls it
fails with a clear message and the worker serves on. What has one sensible
meaning is written here: several passes one after another, a pass then a step
(`engine_types.StepsAfterPasses`), no state snapshot (an auto-save calls `save_state`),
parking as "nothing to move" (the worker keeps its device memory), no weight sync statistics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, SyncStats
from openrld.engine_types import (
    Finished,
    ParkReport,
    ResumeReport,
    SamplerEngine,
    StateSnapshot,
    StepsAfterPasses,
    TrainerEngine,
    WeightPayload,
)
from openrld.errors import NotSupportedYet


def _missing(what: str) -> NotSupportedYet:
    return NotSupportedYet(f"this worker's engine does not implement {what}")


class _Resident:
    """Parking that moves nothing: the engine keeps its device memory while others take turns."""

    _parked = False

    def park(self) -> ParkReport:
        self._parked = True
        return ParkReport(device="", tensors=0, bytes_held=0, bytes_moved=0, cache_bytes_dropped=0,
                          device_bytes_freed=0, device_bytes_reserved_after=0, seconds=0.0)

    def resume(self) -> ResumeReport:
        self._parked = False
        return ResumeReport(device="", tensors=0, bytes_moved=0, seconds=0.0)

    @property
    def is_parked(self) -> bool:
        return self._parked

    @property
    def last_sync(self) -> SyncStats | None:
        return None

    def close(self) -> None:
        pass


class TrainerWorker(StepsAfterPasses, _Resident):
    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        return [self.forward_backward(name, batch) for batch in batches]  # type: ignore[attr-defined]

    # forward_backward_then_step: engine_types.StepsAfterPasses.

    def adapter_tensors(self, name: str) -> WeightPayload:
        return self.sampler_payload(name, "")  # type: ignore[attr-defined]

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        raise _missing("export_adapter (save_weights for use outside openrld)")

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        raise _missing("sampler_checkpoint (save_weights_for_sampler with a name)")

    def snapshot_state(self, name: str, with_optimizer: bool) -> StateSnapshot | None:
        return None  # an auto-save writes the state with the image's own save_state


class SamplerWorker(_Resident):
    def drop_version(self, version: str) -> None:
        pass

    def versions_in_use(self) -> set[str]:
        return set()

    def cancel(self, request_id: str) -> bool:
        return False

    def has_work(self) -> bool:
        return False

    def step(self) -> list[Finished]:
        return []


def _refuse_the_rest(cls: type, protocol: type) -> None:
    """Give `cls` every call of `protocol` it does not write, as one that raises NotSupportedYet."""
    for layer in protocol.__mro__:
        for name, member in vars(layer).items():
            if inspect.isfunction(member) and not name.startswith("_") and not hasattr(cls, name):
                setattr(cls, name, _refusal(name, member))


def _refusal(name: str, declared: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _missing(name)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__signature__ = inspect.signature(declared)  # type: ignore[attr-defined]
    return refuse


_refuse_the_rest(TrainerWorker, TrainerEngine)
_refuse_the_rest(SamplerWorker, SamplerEngine)
