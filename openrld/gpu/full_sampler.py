"""The sampling engine of one full fine-tuning job: full-weight versions on one model.

`FullSampler` is a `SamplerEngine` (`openrld/engine_types.py`) around one
`TorchSampler`, whose scheduling and sampling math it reuses unchanged. What differs
from LoRA: a version here is a whole set of weights, and one forward can serve only
one of them. So the model's parameters hold one version at a time (the *live* one),
and every request in the running batch samples from it.

- `load_version(version, payload)` takes a version as full tensors (a checkpoint read
  from disk), or as a weight-sync payload from the trainer (`gpu/delta.py`): the changed
  elements since the previous sync (or every tensor, under weight_sync=full). The payload
  is patched into the live weights in place, once the running batch has drained, and the
  sync is checked: the digest of the patched weights must equal the trainer's
  (`WeightMismatch` otherwise, and the version is not loaded).
- Memory: the live weights, plus a host copy of each other version that is still loaded
  (the actor keeps few), plus the weights of the last sync (the next delta's base) if the
  live weights have moved away from them. Leaving a loaded version for another copies it
  to the host first, so that an older sampling client still gets its own weights.
- A request for another version than the live one waits until the running batch has
  drained; then the live weights switch to its version (a copy from the host), and
  every waiting request of that version joins. Requests are taken in arrival order,
  and once one waits, later requests wait behind it, so no version starves.

The engine under it and the place its live weights are kept are two parts: the torch
sampler's parameters (`TorchWeights`), or vLLM's (`FullSampler.on_engine` with a
`VllmSampler` and `vllm_weights.VllmWeights`, on a vLLM node). The versions, the order of
switches and syncs, and the digest check are this module's either way. On vLLM a change
or a switch waits while the engine sleeps (its weights are off the device) and lands at the
first `step` after it wakes.

Guarantees: versions are immutable once loaded; the weights a request samples from
are exactly its version's; a version in use by a live or waiting request cannot be
dropped. It never imports trio and is not thread-safe: one call at a time.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, Unpack

import msgspec
import torch

from openrld.batches import LoraSpec, SampleJob, SampleResult
from openrld.engine_types import Finished, ParkReport, ResumeReport, WeightPayload
from openrld.gpu import delta as weight_delta, full_io
from openrld.gpu.sample_alone import sample_alone
from openrld.gpu.torch_sampler import SamplerOptions, TorchSampler, TorchSamplerStatistics
from openrld.gpu.vllm_sampler import VllmSampler, VllmSamplerStatistics

logger = logging.getLogger(__name__)

# The engine that samples the live weights: it serves the base model (version None), which they are.
SamplingEngine = TorchSampler | VllmSampler

# What `_live` says after a failed sync patched the weights: no version name looks like it.
DAMAGED = "<live weights damaged by a failed sync>"


class LiveWeights(Protocol):
    """Where the live version's weights are, in the trainer's names (checkpoint coordinates)."""

    # Whether they take a change while the engine is parked (the torch sampler's parked parameters
    # are host tensors; vLLM's sleeping weights are in no tensor a patch can reach).
    patches_while_parked: bool

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape by name: what a full version must hold."""
        ...

    def apply(self, change: weight_delta.WeightDelta) -> None:
        """Patch the live weights in place (`delta.apply_delta`'s contract)."""
        ...

    def copy_from(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every live weight with `tensors` (host tensors of the same names and shapes)."""
        ...

    def digest(self) -> int:
        """`delta.digest` of the live weights as they are now."""
        ...

    def host_copy(self) -> dict[str, torch.Tensor]:
        """A copy of the live weights in host memory, never written after."""
        ...

    def read(self) -> dict[str, torch.Tensor]:
        """The live weights by name (views where they can be), for a comparison."""
        ...


class TorchWeights:
    """The torch sampler's own parameters as the live weights; every change drops its cached prefixes."""

    patches_while_parked = True

    def __init__(self, engine: TorchSampler) -> None:
        self._engine = engine
        self._params = engine.base_weights()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(p.shape) for key, p in self._params.items()}

    def apply(self, change: weight_delta.WeightDelta) -> None:
        weight_delta.apply_delta(self._params, change)
        self._engine.base_weights_changed()  # the inner engine's cached prefixes were the old weights'

    def copy_from(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, param in self._params.items():
                param.copy_(tensors[key])
        self._engine.base_weights_changed()

    def digest(self) -> int:
        return weight_delta.digest(self._params)

    def host_copy(self) -> dict[str, torch.Tensor]:
        return {key: p.detach().to("cpu", copy=True) for key, p in self._params.items()}

    def read(self) -> dict[str, torch.Tensor]:
        return {key: p.detach() for key, p in self._params.items()}


class FullSamplerStatistics(msgspec.Struct, frozen=True):
    engine: TorchSamplerStatistics | VllmSamplerStatistics  # the engine's own (torch, or vLLM on a vLLM node)
    live_version: str | None
    versions_held: int  # full-weight copies held on the host (the live weights not counted)
    requests_waiting_for_switch: int
    switches: int  # times the live weights changed to another held version
    last_sync: weight_delta.SyncStats | None  # the last version that arrived as a delta or in full


class FullSampler:
    """Samples from full-weight versions of one model, one version live at a time.

    Args:
        model_dir, device, dtype: as `TorchSampler`.
        **sampler_options: `TorchSampler`'s keyword options.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        **sampler_options: Unpack[SamplerOptions],
    ) -> None:
        # Its weights change in place at every sync (delta.apply_delta), which a packed copy would not see.
        options: SamplerOptions = {**sampler_options, "packed_weights": False}
        inner = TorchSampler(model_dir, device, dtype, **options)
        self._setup(inner, TorchWeights(inner))

    @classmethod
    def on_engine(cls, inner: SamplingEngine, weights: LiveWeights) -> FullSampler:
        """Full-weight versions on another engine (vLLM's), whose live weights `weights` holds."""
        sampler = cls.__new__(cls)
        sampler._setup(inner, weights)
        return sampler

    def _setup(self, inner: SamplingEngine, weights: LiveWeights) -> None:
        self._inner = inner
        self._weights = weights
        self._held: dict[str | None, dict[str, torch.Tensor]] = {}  # version -> host tensors (never written)
        self._live: str | None = None  # the version in the model's parameters; None: the base
        self._live_is_held = False  # whether `_held` has a copy of the live weights
        # The version the last weight sync made (None: the base, before any): the next delta's
        # base. Its weights are kept (live or held) even once the actor drops it, or the chain breaks.
        self._head: str | None = None
        self._loaded: set[str] = set()  # versions this engine can serve
        self._running: dict[str, str | None] = {}  # request id in the inner engine -> its version
        self._waiting: collections.deque[tuple[str, str | None, SampleJob]] = collections.deque()
        self._incoming: collections.deque[tuple[str, weight_delta.WeightDelta]] = collections.deque()
        self._switches = 0
        self._last_sync: weight_delta.SyncStats | None = None

    # -- versions ---------------------------------------------------------

    def has_version(self, version: str | None) -> bool:
        return (version is None and self._live is None) or version in self._loaded

    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None = None) -> None:
        """Load an immutable version: full tensors keyed like `named_parameters()`, or a
        `delta.WeightDelta` from a version this engine holds.

        Raises:
            ValueError: `version` is loaded already; tensors missing, unexpected or misshapen;
                a delta whose base is neither live nor held.
            delta.WeightMismatch: the patched weights' digest differs from the trainer's.
        """
        if version in self._loaded:
            raise ValueError(f"weight version {version!r} is already loaded; versions are immutable")
        if isinstance(payload, weight_delta.WeightDelta):
            # Patching waits for the running batch to drain (`step` applies it then); meanwhile the
            # change waits in host memory, whatever device its sender computed it on.
            self._loaded.add(version)
            self._incoming.append((version, payload.to_host()))
            if not self._running and self._may_change_weights:
                self._apply_incoming()
        else:
            assert isinstance(payload, dict), f"a full version is a dict of tensors, got {type(payload).__name__}"
            self._check_keys(version, payload)
            self._held[version] = {key: t.detach().to("cpu") for key, t in payload.items()}
            self._loaded.add(version)
        logger.info("loaded full weight version=%s", version)

    def load_checkpoint(self, version: str, directory: Path) -> None:
        """Load the full-model weights a trainer saved in `directory` (full_io format) as `version`.

        Raises:
            BadRequest: not full-model weights, or malformed files.  ValueError: as `load_version`.
        """
        self.load_version(version, full_io.load_full(directory))

    def _apply_incoming(self) -> None:
        """Apply the deltas that arrived, in order; the batch is empty."""
        while self._incoming:
            version, change = self._incoming.popleft()
            try:
                self._load_delta(version, change)
            except BaseException:
                self._loaded.discard(version)
                raise

    def _load_delta(self, version: str, change: weight_delta.WeightDelta) -> None:
        """Patch the live weights in place from `change.base_version` to `version`.

        A delta applies to its base version, which becomes live first if it is not; a
        full update ("full" mode) applies to any. The version left behind keeps a host
        copy if it is still loaded, so that it can be sampled again.
        """
        assert not self._running, "the live weights change only between batches"
        if change.mode == "delta" and change.base_version != self._head:
            raise ValueError(
                f"weight version {version!r} is a delta from {change.base_version!r}, but this sampler's last "
                f"sync made {self._head!r} (a sync was lost or failed)"
            )
        if change.mode == "delta" and change.base_version != self._live:
            if change.base_version not in self._held:
                raise ValueError(
                    f"weight version {version!r} is a delta from {change.base_version!r}, which this sampler "
                    f"no longer holds"
                )
            self._switch(change.base_version)
        if not self._live_is_held and self._live in self._loaded:
            self._held[self._live] = self._weights.host_copy()
        started = time.perf_counter()
        try:
            self._weights.apply(change)
        except BaseException:
            self._live, self._live_is_held = DAMAGED, False  # a patch may have landed in part
            raise
        digest = self._weights.digest()
        if digest != change.digest:
            self._live, self._live_is_held = DAMAGED, False  # the live weights are no version now
            raise weight_delta.WeightMismatch(
                f"weight version {version!r}: sampler digest {digest:#018x} != trainer digest {change.digest:#018x} "
                f"after applying the delta"
            )
        self._last_sync = change.stats(apply_s=time.perf_counter() - started)
        self._live = version
        self._live_is_held = False
        previous_head, self._head = self._head, version
        if previous_head not in self._loaded:
            self._held.pop(previous_head, None)  # kept only as the delta's base

    def drop_version(self, version: str) -> None:
        """Free a version. Raises KeyError (not loaded) or ValueError (in use)."""
        if version in self.versions_in_use():
            raise ValueError(f"weight version {version!r} is in use by a live request")
        self._loaded.remove(version)
        # The head's weights stay (live or held): the next delta applies to them.
        if version != self._head:
            self._held.pop(version, None)
        logger.info("dropped full weight version=%s", version)

    def versions_in_use(self) -> set[str]:
        used = {v for v in self._running.values() if v is not None}
        return used | {v for _, v, _ in self._waiting if v is not None}

    def _switch(self, version: str | None) -> None:
        """Make `version` the live weights; the batch is empty."""
        assert not self._running, "the live weights change only between batches"
        if version == self._live:
            return
        if version not in self._held:
            raise KeyError(f"weight version {version!r} is not held by this sampler")
        if not self._live_is_held and (self._live in self._loaded or self._live == self._head):
            self._held[self._live] = self._weights.host_copy()  # keep the version we leave
        self._weights.copy_from(self._held[version])
        self._live = version
        self._live_is_held = True
        self._switches += 1

    def _check_keys(self, version: str, tensors: dict[str, torch.Tensor]) -> None:
        shapes = self._weights.shapes()
        missing = sorted(set(shapes) - set(tensors))
        unknown = sorted(set(tensors) - set(shapes))
        if missing or unknown:
            raise ValueError(f"weight version {version!r}: missing {missing[:3]}, unexpected {unknown[:3]}")
        for key, shape in shapes.items():
            if tuple(tensors[key].shape) != shape:
                raise ValueError(
                    f"weight version {version!r}: {key} has shape {list(tensors[key].shape)}; "
                    f"expected {list(shape)}"
                )

    # -- scheduling -------------------------------------------------------

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        """Queue one request on `version`; it runs once its version is live.

        Raises:
            BadRequest: the job is invalid.  KeyError: `version` is not loaded.
            ValueError: `request_id` is already live.
        """
        self._inner.validate(job)
        if not self.has_version(version):
            raise KeyError(f"weight version {version!r} is not loaded")
        if request_id in self._running or any(r == request_id for r, _, _ in self._waiting):
            raise ValueError(f"request {request_id!r} is already in the sampler")
        # While parked vLLM's weights are off the device: the request waits, and the first step
        # after resume starts it.
        if not self._waiting and not self._incoming and self._may_change_weights and (version == self._live or not self._running):
            self._switch(version)
            self._start(request_id, version, job)
        else:
            self._waiting.append((request_id, version, job))

    def _start(self, request_id: str, version: str | None, job: SampleJob) -> None:
        self._inner.add(request_id, None, job)  # the inner engine's base model is the live version
        self._running[request_id] = version

    def cancel(self, request_id: str) -> bool:
        for entry in self._waiting:
            if entry[0] == request_id:
                self._waiting.remove(entry)
                return True
        if self._running.pop(request_id, "absent") == "absent":
            return False
        return self._inner.cancel(request_id)

    def has_work(self) -> bool:
        return self._inner.has_work() or bool(self._waiting) or bool(self._incoming)

    def step(self) -> list[Finished]:
        """Switch versions if the batch has drained and requests wait, then one inner step."""
        if not self._running and self._incoming and self._may_change_weights:
            self._apply_incoming()
        if not self._running and self._waiting:
            self._switch(self._waiting[0][1])
            later: collections.deque[tuple[str, str | None, SampleJob]] = collections.deque()
            for request_id, version, job in self._waiting:
                if version == self._live:
                    self._start(request_id, version, job)
                else:
                    later.append((request_id, version, job))
            self._waiting = later
        if not self._inner.has_work():
            return []
        finished = self._inner.step()
        for done in finished:
            self._running.pop(done.request_id, None)
        return finished

    def sample(self, version: str | None, job: SampleJob) -> SampleResult:
        """Run one request alone to completion on the idle engine (`sample_alone`)."""
        return sample_alone(self, version, job)

    def park(self) -> ParkReport:
        """Park the model (between requests only; `TorchSampler.park`). Held versions and waiting
        changes are in host memory already (`LiveWeights.host_copy`, `WeightDelta.to_host`): only the live
        weights and the KV cache are on the device."""
        return self._inner.park()

    def resume(self) -> ResumeReport:
        """Resume the model; a change that arrived meanwhile lands at the next `step` (has_work says so)."""
        return self._inner.resume()

    @property
    def is_parked(self) -> bool:
        return self._inner.is_parked

    @property
    def _may_change_weights(self) -> bool:
        return not self.is_parked or self._weights.patches_while_parked

    @property
    def last_sync(self) -> weight_delta.SyncStats | None:
        """The last weight sync that landed here, with its apply time (None before the first)."""
        return self._last_sync

    def close(self) -> None:
        self._inner.close()

    def live_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by name (for tests and checks that compare them with the trainer's)."""
        return self._weights.read()

    def statistics(self) -> FullSamplerStatistics:
        return FullSamplerStatistics(
            engine=self._inner.statistics(),
            live_version=self._live,
            versions_held=len(self._held),
            requests_waiting_for_switch=len(self._waiting),
            switches=self._switches,
            last_sync=self._last_sync,
        )

