"""The typed interface between the actors and the engines they drive.

`actors/trainer.py` and `actors/sampler.py` hold an engine as a `TrainerEngine` or a
`SamplerEngine`; every engine in `gpu/` (LoRA and full trainers, torch, full and vLLM
samplers) implements one, and so will whatever carries an engine across a process
boundary (`openrld/worker/`). Each Protocol names exactly the calls the actors make,
and nothing else: an engine's diagnostics (`statistics`, `adapter_gradients`) are its
own. `tests/test_engine_boundary.py` checks every engine class against them.

What it guarantees: this module imports no torch and no trio, so an actor can import
it, and the Structs it defines (what `park`, `resume` and `step` return) are plain
msgspec data that any worker protocol can encode. Tensors never appear in a type
here: the weights the trainer hands its sampler are a `WeightPayload`, opaque to the
actors, which only carry it from one engine to the other.

The Protocols are the one declaration of each engine call: a worker carries exactly
these calls, its method table, its client's methods and its server's dispatch derived from
their signatures (`worker/methods.py`); a call marked `updates_last_sync` brings the
engine's `last_sync` back with its result. `StepsAfterPasses` is the one
`forward_backward_then_step`, which every trainer (the built-in ones, a custom image's)
shares.

What it does not do: run anything but that composition. Engines are synchronous and called
one call at a time, from the owning actor's worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar

import msgspec
import numpy as np

from openrld.batches import (
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimParams,
    OptimResult,
    SampleJob,
    SampleResult,
    SyncStats,
)
from openrld.errors import OpenrldError

__all__ = [
    "DeviceEngine", "Finished", "ParkReport", "PassAndStep", "ResumeReport", "SamplerEngine", "SnapshotFile",
    "StateSnapshot", "StepsAfterPasses", "TrainerEngine", "WeightPayload", "updates_last_sync",
]

# The trainer's sampler payload: a dict of tensors (LoRA adapter tensors, or full-model
# weights read from a checkpoint) or a weight delta (gpu/delta.py). Opaque to actors: they
# hold it on the host and hand it to a sampler engine's `load_version`, nothing more.
# Annotated, so that the worker's method table tells it from a plain object (it crosses
# as a `WirePayload`); to a type checker it is any object.
WeightPayload = Annotated[object, "weight payload"]

# What `forward_backward_then_step` returns: the pass's results, and the step's result, or
# its exception (the pass stands), or None when no step was asked for.
PassAndStep = tuple[list[ForwardBackwardResult], OptimResult | Exception | None]

_Call = TypeVar("_Call", bound=Callable[..., Any])


def updates_last_sync(method: _Call) -> _Call:
    """Mark an engine call after which `last_sync` may have changed: across a worker, its
    reply carries the new value, so that reading the property is never a round trip."""
    method.__updates_last_sync__ = True  # type: ignore[attr-defined]
    return method


class ParkReport(msgspec.Struct, frozen=True):
    """What parking an engine moved off its device (gpu/offload.py), for the time-slicer's statistics."""

    device: str
    tensors: int  # tensors in the parked set
    bytes_held: int  # their bytes
    bytes_moved: int  # bytes copied device -> host (0 when the device is the host)
    cache_bytes_dropped: int  # caches dropped rather than moved (the KV cache)
    device_bytes_freed: int  # memory_allocated before - after on a CUDA device; 0 on the CPU
    device_bytes_reserved_after: int  # what the CUDA caching allocator still holds after empty_cache
    seconds: float


class ResumeReport(msgspec.Struct, frozen=True):
    """What resuming a parked engine copied back to its device."""

    device: str
    tensors: int
    bytes_moved: int  # bytes copied host -> device
    seconds: float


class Finished(msgspec.Struct, frozen=True):
    """A sampling request that a sampler engine's `step` completed."""

    request_id: str  # the id the actor gave it in `add`
    result: SampleResult | None
    # Set, and `result` None: the engine refused or failed this request alone (a worker's
    # sampler refuses an add in its next step, since `add` never waits on the worker).
    error: OpenrldError | None = None


class SnapshotFile(msgspec.Struct, frozen=True):
    """One file of a `StateSnapshot`: its name in the state's directory, and its bytes."""

    name: str
    head: bytes  # the file's first bytes: a safetensors header, or the whole of a small JSON file
    # (N,) uint8: the tensors' bytes that follow the head, a host copy of them; None: the head is all
    body: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return len(self.head) + (self.body.nbytes if self.body is not None else 0)


class StateSnapshot(msgspec.Struct, frozen=True):
    """A job's training state as `save_state` would write it, copied to host memory on the engine
    thread: the files of the state's directory, name by name, for a writer off that thread."""

    files: list[SnapshotFile]

    @property
    def nbytes(self) -> int:
        return sum(file.nbytes for file in self.files)


class DeviceEngine(Protocol):
    """What every engine has, trainer or sampler: turns on its device, its last weight sync, an end."""

    def park(self) -> ParkReport:
        """Give the device back (the time-slicer's turn is over); compute refuses until `resume`."""
        ...

    def resume(self) -> ResumeReport: ...

    @property
    def is_parked(self) -> bool: ...

    @property
    def last_sync(self) -> SyncStats | None:
        """Full fine-tuning's last weight sync (the trainer's side, or the sampler's with its
        apply time); None before one, and always for LoRA."""
        ...

    def close(self) -> None:
        """Free what the engine holds; nothing is called on it after."""
        ...


class TrainerEngine(DeviceEngine, Protocol):
    """A trainer: LoRA adapters by name over one base model, or one full fine-tuning job.

    `name` is the job's model id. Errors the engine means (bad input, an unknown
    adapter) are `openrld.errors` exceptions and fail the one op; `EngineLost` says the
    engine itself is gone (a worker that died) and the actor builds another.
    """

    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str) -> None: ...
    def drop_adapter(self, name: str) -> None: ...
    def has_adapter(self, name: str) -> bool: ...
    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult: ...
    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]: ...

    def forward_backward_then_step(
        self, name: str, batches: list[ForwardBackwardBatch], params: OptimParams | None
    ) -> PassAndStep:
        """The pass, then the optim_step unless `params` is None; a failed step is returned, not raised."""
        ...

    def optim_step(self, name: str, params: OptimParams) -> OptimResult: ...

    def adapter_tensors(self, name: str) -> WeightPayload:
        """The weights as they are now, for an inflight publish to the sampler."""
        ...

    @updates_last_sync
    def sampler_payload(self, name: str, version: str) -> WeightPayload:
        """What takes the sampler to these weights as `version` (full fine-tuning: chains on the previous one)."""
        ...

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        """Write the Hugging Face PEFT adapter (`external_weights`) into the empty `directory`; bytes written."""
        ...

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        """Write what a sampler's `load_checkpoint` reads into the empty `directory`; bytes written."""
        ...

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int: ...

    def snapshot_state(self, name: str, with_optimizer: bool) -> StateSnapshot | None:
        """What `save_state` would write, copied to host memory now (a later op cannot change it),
        for a writer off the engine thread; None: this engine does not copy its state (it is too
        large to hold twice), and the caller writes it with `save_state` instead."""
        ...

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str
    ) -> None: ...


class StepsAfterPasses:
    """`forward_backward_then_step` written once: the engine's own `forward_backward_many`,
    then its `optim_step` unless `params` is None. The trainers of `gpu/` (`train_steps`) and a
    custom image's (`worker/base.py`) inherit it."""

    def forward_backward_then_step(
        self: _Trains, name: str, batches: Sequence[ForwardBackwardBatch], params: OptimParams | None
    ) -> PassAndStep:
        """Returns (the pass's results, the step's OptimResult, or its exception, or None): a failed
        step leaves the pass's results standing. The pass's failure is raised."""
        results = self.forward_backward_many(name, list(batches))
        if params is None:
            return results, None
        try:
            return results, self.optim_step(name, params)
        except Exception as error:  # the pass stands; the step's failure is its own op's
            return results, error


class _Trains(Protocol):
    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]: ...
    def optim_step(self, name: str, params: OptimParams) -> OptimResult: ...


class SamplerEngine(DeviceEngine, Protocol):
    """A step-level sampler: immutable weight versions, requests that join and leave between steps.

    A request or version that the engine refuses raises `BadRequest`, `KeyError` or
    `ValueError` from the call that brought it.
    """

    @updates_last_sync
    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None: ...

    @updates_last_sync
    def load_checkpoint(self, version: str, directory: Path) -> None:
        """Read a sampler checkpoint (`TrainerEngine.sampler_checkpoint`, or a state) and load it as `version`."""
        ...

    def drop_version(self, version: str) -> None: ...
    def versions_in_use(self) -> set[str]: ...
    def add(self, request_id: str, version: str | None, job: SampleJob) -> None: ...
    def cancel(self, request_id: str) -> bool: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[Finished]: ...
