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

What a subclass must write raises NotSupportedYet here, so a job that calls it
fails with a clear message and the worker serves on. What has one sensible
meaning is written here: several passes one after another, a pass then a step,
parking as "nothing to move" (the worker keeps its device memory), no weight
sync statistics.
"""

from __future__ import annotations

from pathlib import Path

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, LoraSpec, OptimParams, OptimResult, SampleJob, SyncStats
from openrld.engine_types import Finished, ParkReport, ResumeReport, WeightPayload
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


class TrainerWorker(_Resident):
    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str) -> None:
        raise _missing("add_adapter")

    def drop_adapter(self, name: str) -> None:
        raise _missing("drop_adapter")

    def has_adapter(self, name: str) -> bool:
        raise _missing("has_adapter")

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        raise _missing("forward_backward")

    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        return [self.forward_backward(name, batch) for batch in batches]

    def forward_backward_then_step(
        self, name: str, batches: list[ForwardBackwardBatch], params: OptimParams | None
    ) -> tuple[list[ForwardBackwardResult], OptimResult | Exception | None]:
        results = self.forward_backward_many(name, batches)
        if params is None:
            return results, None
        try:
            return results, self.optim_step(name, params)
        except Exception as error:  # the pass stands; the step's failure is its own op's
            return results, error

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        raise _missing("optim_step")

    def adapter_tensors(self, name: str) -> WeightPayload:
        return self.sampler_payload(name, "")

    def sampler_payload(self, name: str, version: str) -> WeightPayload:
        raise _missing("sampler_payload")

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        raise _missing("export_adapter (save_weights for use outside openrld)")

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        raise _missing("sampler_checkpoint (save_weights_for_sampler with a name)")

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int:
        raise _missing("save_state")

    def load_state(self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str) -> None:
        raise _missing("load_state")


class SamplerWorker(_Resident):
    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        raise _missing("load_version")

    def load_checkpoint(self, version: str, directory: Path) -> None:
        raise _missing("load_checkpoint")

    def drop_version(self, version: str) -> None:
        pass

    def versions_in_use(self) -> set[str]:
        return set()

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        raise _missing("add")

    def cancel(self, request_id: str) -> bool:
        return False

    def has_work(self) -> bool:
        return False

    def step(self) -> list[Finished]:
        return []
