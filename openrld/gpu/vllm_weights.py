"""A full fine-tuning job's weights inside vLLM: patched in place by vLLM's own loader, read back to check.

A full fine-tuning job on a vLLM node samples through `full_sampler.FullSampler` over a
`VllmSampler` built without LoRA; its live weights are vLLM's, and this module is how they
change. Two halves, in two processes:
- `VllmWeights`, beside the engine, is the sampler's `full_sampler.LiveWeights`. A version
  arrives as the trainer's `delta.WeightDelta` in the trainer's names (checkpoint
  coordinates): every tensor dense at the first sync, the changed elements after. It is
  cut into `WeightPatch` chunks and sent by `LLM.collective_rpc` to the worker extension,
  then vLLM's prefix cache is reset (it holds the old weights' KV).
- `WeightsExtension` runs in vLLM's GPU worker (vLLM mixes it into its worker class, named
  by `worker_extension_cls`, and `collective_rpc` calls its methods by name). It applies the
  patches with vLLM 0.33's `load_checkpoint_weight_patches`, which maps each checkpoint name
  through the model's own `load_weights` into vLLM's fused parameters (q/k/v into qkv_proj,
  gate/up into gate_up_proj), in place: sparse patches write only their elements (NaN marks
  the untouched ones while the loader runs), dense ones the whole tensor. It reads the
  weights back the same way (`read_back`: the loader run with its copies reversed), so the
  digest the sampler checks is of vLLM's live parameters as the loader maps them, not of a
  copy kept beside them: equal to the trainer's digest means vLLM samples the trainer's bits.

Why bytes on the wire: vLLM's engine process decodes a utility call's arguments without
types, so a torch tensor sent as an argument would not arrive as one; plain values and
bytes do (msgpack, never pickle). Chunks stay under `PATCH_CHUNK_BYTES`, below msgpack's
4 GiB limit on one bytes value, and bound the staging memory in the engine process.

What it refuses, by name: weights whose changed elements hold NaN (vLLM's sparse patches
keep NaN for "unchanged"), a dtype other than vLLM's, and a model whose loader does not end
in one plain copy of the whole checkpoint tensor (`read_back`; vLLM's own sparse contract);
one GPU per engine (tensor parallelism would hand each worker a slice).

Imports no vLLM here: the extension imports vLLM's patch loader only when it runs, in
vLLM's process. Never imports trio.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec
import torch

from openrld.errors import ServerError
from openrld.gpu import delta
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.vllm_sampler import VllmSampler, VllmSamplerConfig

logger = logging.getLogger(__name__)

# The worker extension's qualified name, for vLLM's `worker_extension_cls`.
EXTENSION = f"{__name__}.WeightsExtension"
# Tensor bytes per collective_rpc call: well under msgpack's 4 GiB per bytes value, and the most
# the engine process stages at once (a sparse patch stages its whole checkpoint tensor).
PATCH_CHUNK_BYTES = 256 << 20
# The checkpoint dtypes that are weights (safetensors' names); integer buffers are not trained.
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class WeightPatch(msgspec.Struct, frozen=True, array_like=True):
    """One checkpoint tensor's change, as it crosses into vLLM's engine process."""

    name: str  # the trainer's (checkpoint) name: what the model's load_weights takes
    shape: list[int]  # the whole checkpoint tensor's
    dtype: str  # torch's name without "torch.", as vLLM's serializer writes one
    values: bytes  # the whole tensor flat (dense), or the values at `indices`
    indices: bytes | None = None  # flat indices into the tensor, as the trainer made them; None: dense
    index_dtype: str = "int32"  # int32 below 2**31 elements, int64 above (delta.compute_delta)


class UnsupportedLoader(ServerError):
    """vLLM's loader for this model does not write a checkpoint tensor with one plain copy."""


# ---------------------------------------------------------------------------
# The wire: pure, tested without vLLM


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements, flat, in host byte order."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from(data: bytes, dtype: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A host tensor of `dtype` and `shape` holding `data` (a copy: the message buffer goes)."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


def patches_of(
    change: delta.WeightDelta, shapes: Mapping[str, tuple[int, ...]], chunk_bytes: int = PATCH_CHUNK_BYTES
) -> Iterator[list[WeightPatch]]:
    """`change` as chunks of patches, each chunk at most `chunk_bytes` of tensor bytes unless one
    tensor alone is larger.

    Raises:
        ValueError: a tensor `shapes` does not hold, or a sparse change whose values hold NaN.
    """
    for part in change.tensors:  # all of it before the first chunk: a refusal must leave vLLM's weights as they are
        if part.name not in shapes:
            raise ValueError(f"the change names tensor {part.name!r}, which vLLM's model does not hold")
        if part.indices is not None and part.values.is_floating_point() and bool(torch.isnan(part.values).any()):
            raise ValueError(
                f"{part.name}: the trainer's new values hold NaN, which vLLM's sparse patches keep for "
                "'unchanged' (the training diverged)"
            )
    chunk: list[WeightPatch] = []
    held = 0
    for part in change.tensors:
        indices = None if part.indices is None else tensor_bytes(part.indices)
        patch = WeightPatch(
            name=part.name, shape=list(shapes[part.name]), dtype=_name(part.values.dtype),
            values=tensor_bytes(part.values), indices=indices,
            index_dtype=_name(part.indices.dtype) if part.indices is not None else "int32",
        )
        size = len(patch.values) + len(indices or b"")
        if chunk and held + size > chunk_bytes:
            yield chunk
            chunk, held = [], 0
        chunk.append(patch)
        held += size
    if chunk:
        yield chunk


def dense_change(tensors: Mapping[str, torch.Tensor]) -> delta.WeightDelta:
    """Every tensor of `tensors` as a dense change (a held version made live again)."""
    return delta.WeightDelta(
        base_version=None, tensors=[delta.TensorDelta(name=k, indices=None, values=t.reshape(-1)) for k, t in tensors.items()],
        digest=0, mode="full", changed_elements=0, total_elements=0, full_bytes=0, compute_s=0.0,
    )


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every floating tensor's shape in the model's safetensors files, by name (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():  # noqa: SIM118  # safetensors' safe_open has keys() but is not iterable
                part = file.get_slice(name)
                if part.get_dtype() in FLOAT_DTYPES:
                    shapes[name] = tuple(int(d) for d in part.get_shape())
    return shapes


# ---------------------------------------------------------------------------
# In vLLM's engine process


def read_back(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Checkpoint tensor `name` as vLLM's `model` holds it: its `load_weights` run on a buffer with
    each copy reversed (the buffer receives what the loader would have overwritten).

    Raises:
        UnsupportedLoader: the loader copies anything but the buffer itself whole, or writes it
            other than once (a transformed or sliced copy could not be reversed).
    """
    buffer = torch.empty(shape, dtype=dtype, device=device)
    copied: list[tuple[int, ...]] = []
    plain_copy = torch.Tensor.copy_

    def reverse(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        whole = source.data_ptr() == buffer.data_ptr() and source.shape == buffer.shape and source.stride() == buffer.stride()
        if not whole or destination.shape != source.shape or destination.dtype != source.dtype:
            raise UnsupportedLoader(
                f"{name}: vLLM's loader writes {list(destination.shape)} {destination.dtype} from a tensor that is "
                f"not the checkpoint's {list(shape)} {dtype} itself; its weights cannot be read back or patched in place"
            )
        plain_copy(source, destination)
        copied.append(tuple(destination.shape))
        return destination

    torch.Tensor.copy_ = reverse
    try:
        model.load_weights([(name, buffer)])
    finally:
        torch.Tensor.copy_ = plain_copy
    if len(copied) != 1:
        raise UnsupportedLoader(f"{name}: vLLM's loader wrote it {len(copied)} times; expected once")
    return buffer


class _ReadBack(Mapping[str, torch.Tensor]):
    """The model's weights in checkpoint coordinates, each read back when it is looked up, so
    that `delta.digest` holds one tensor at a time."""

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        self._model, self._shapes, self._dtype = model, shapes, dtype
        self._device = next(model.parameters()).device

    def __getitem__(self, name: str) -> torch.Tensor:
        return read_back(self._model, name, self._shapes[name], self._dtype, self._device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


class WeightsExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); `collective_rpc` calls these by name.
    `self` is vLLM's worker: `get_model()` is its model, unwrapped of CUDA graphs."""

    def openrld_patch_weights(self, patches: list) -> int:
        """Apply one chunk of `WeightPatch`es in place; returns the elements written."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        model = self.get_model()  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        dense: list[CheckpointWeightPatch] = []
        sparse: list[CheckpointWeightPatch] = []
        written = 0
        for patch in msgspec.convert(patches, list[WeightPatch]):
            values = tensor_from(patch.values, patch.dtype, [-1]).to(device)
            indices = None if patch.indices is None else tensor_from(patch.indices, patch.index_dtype, [-1]).to(device)
            entry = CheckpointWeightPatch(patch.name, tuple(patch.shape), values.dtype, values, indices)
            (dense if indices is None else sparse).append(entry)
            written += values.numel()
        for group in (dense, sparse):  # vLLM takes one kind per call
            if group:
                load_checkpoint_weight_patches(model, group)
        return written

    def openrld_weights_digest(self, shapes: dict, dtype: str) -> int:
        """`delta.digest` of the model's weights in checkpoint coordinates (`read_back`)."""
        model = self.get_model()  # type: ignore[attr-defined]
        entries = {name: tuple(shape) for name, shape in shapes.items()}
        return delta.digest(_ReadBack(model, entries, getattr(torch, dtype)))

    def openrld_read_weights(self, shapes: dict, dtype: str) -> list:
        """The named weights' bytes, in the order of `shapes` (`read_back`)."""
        model = self.get_model()  # type: ignore[attr-defined]
        entries = {name: tuple(shape) for name, shape in shapes.items()}
        back = _ReadBack(model, entries, getattr(torch, dtype))
        return [tensor_bytes(back[name]) for name in entries]


# ---------------------------------------------------------------------------
# Beside the engine


def vllm_full_sampler(model_dir: str | Path, device: torch.device, config: VllmSamplerConfig) -> FullSampler:
    """A full fine-tuning job's sampler on vLLM: `FullSampler` over a LoRA-less `VllmSampler`
    whose weights `VllmWeights` patches.

    Raises:
        VllmUnavailable: as `VllmSampler`.
    """
    engine = VllmSampler(model_dir, device, config, serves_lora=False, worker_extension=EXTENSION)
    return FullSampler.on_engine(engine, VllmWeights(engine, checkpoint_shapes(Path(model_dir))))


class VllmWeights:
    """A `VllmSampler`'s weights as a full sampler's live weights (`full_sampler.LiveWeights`).

    Args:
        engine: a VllmSampler built with `serves_lora=False` and `worker_extension=EXTENSION`.
        shapes: the checkpoint tensors vLLM holds, by name (`checkpoint_shapes`).
    """

    patches_while_parked = False  # asleep, vLLM's weights are in host memory it alone manages

    def __init__(self, engine: VllmSampler, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._engine = engine
        self._shapes = dict(shapes)
        self._dtype = _name(engine.model_dtype)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def apply(self, change: delta.WeightDelta) -> None:
        """Patch vLLM's weights in place, chunk by chunk, then drop its cached prefixes.

        Raises:
            ValueError: a tensor vLLM's model does not hold, of another dtype, or NaN in a sparse change.
        """
        for part in change.tensors:
            if _name(part.values.dtype) != self._dtype:
                raise ValueError(f"{part.name}: the change is {part.values.dtype}; vLLM holds the weights in {self._dtype}")
        for chunk in patches_of(change, self._shapes):
            self._engine.call_workers("openrld_patch_weights", chunk)
        self._engine.base_weights_changed()

    def copy_from(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.apply(dense_change(tensors))

    def digest(self) -> int:
        (value,) = set(self._engine.call_workers("openrld_weights_digest", self._wire_shapes(self._shapes), self._dtype))
        return int(value)

    def host_copy(self) -> dict[str, torch.Tensor]:
        copy: dict[str, torch.Tensor] = {}
        element = torch.empty((), dtype=getattr(torch, self._dtype)).element_size()
        for chunk in _chunks(self._shapes, element, PATCH_CHUNK_BYTES):
            (data,) = self._engine.call_workers("openrld_read_weights", self._wire_shapes(chunk), self._dtype)
            copy.update({name: tensor_from(raw, self._dtype, shape) for (name, shape), raw in zip(chunk.items(), data)})
        return copy

    def read(self) -> dict[str, torch.Tensor]:
        return self.host_copy()

    @staticmethod
    def _wire_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[int]]:
        return {name: list(shape) for name, shape in shapes.items()}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _chunks(
    shapes: Mapping[str, tuple[int, ...]], element_bytes: int, chunk_bytes: int
) -> Iterator[dict[str, tuple[int, ...]]]:
    """`shapes` in runs of at most `chunk_bytes` of tensor bytes (one tensor may exceed it alone)."""
    chunk: dict[str, tuple[int, ...]] = {}
    held = 0
    for name, shape in shapes.items():
        size = element_bytes * math.prod(shape)
        if chunk and held + size > chunk_bytes:
            yield chunk
            chunk, held = {}, 0
        chunk[name] = shape
        held += size
    if chunk:
        yield chunk
