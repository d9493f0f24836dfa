"""Moving values between the shards of an FSDP2 model and whole tensors, one tensor at a time.

The Automodel trainer (`gpu/automodel_trainer.py`) holds every parameter as a DTensor
sharded on dim 0 over the group's ranks (FSDP2's `Shard(0)`; torch.chunk's split, so
the last ranks may hold fewer rows or none). What it must do across ranks is here:
- `whole`: one parameter (or any tensor laid out like it) as a full tensor on the
  host, gathered from the shards; `local_rows` says which rows a rank holds;
- `ShardedWeights.delta`: the weight sync of full fine-tuning, computed where the shards
  are: each rank compares its shard with its own shadow of that shard, and only the
  changed elements (flat indices into the whole tensor, and their values) reach rank 0;
  a tensor whose change would cost as much as the whole goes dense (the rule of
  `delta.compute_delta`). The digest is of the whole weights, gathered tensor by tensor;
- `gather_bytes`: every rank's bytes on rank 0 (results of the datums a rank scored),
  as length-prefixed uint8 tensors: nothing here pickles;
- `global_norm`: the 2-norm over every rank's gradient shards.

Guarantees: no rank ever holds more than one whole parameter at a time on its device
(gathers go to the host at once); every function is a collective, called by every rank
in the same order with tensors of the same names and shapes, as SPMD code must.

What it does not do: know about requests, losses or optimizers, or import trio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import safetensors
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from openrld.errors import BadRequest
from openrld.gpu import delta

__all__ = ["ShardedWeights", "gather_bytes", "gather_concat", "global_norm", "local_rows", "local_view", "read_rows", "shard_of", "whole"]


def local_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows that `rank` of `world` holds: torch.chunk's split.

    chunk gives ceil(rows / world) rows to each rank in turn, so trailing ranks may get
    fewer, or none: 5 rows over 4 ranks are 2, 2, 1, 0.
    """
    size = -(-rows // world)  # ceil
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The rank's shard of `param` as a plain tensor sharing its storage (no grad tracking):
    in-place writes to it are writes to the parameter."""
    if isinstance(param, DTensor):
        return param.to_local().detach()
    return param.detach()


def _check_sharding(param: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        assert all(p == Shard(0) for p in placements), f"expected Shard(0) placements; got {placements}"


def whole(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the host, on every rank (an all-gather; a plain tensor is copied)."""
    _check_sharding(param)
    if isinstance(param, DTensor):
        return param.detach().full_tensor().to("cpu")
    return param.detach().to("cpu").clone()


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the whole tensor `full`, for a parameter laid out as `like` (a tensor
    that already has the local shape, as `read_rows` gives, is taken as it is)."""
    if not isinstance(like, DTensor) or tuple(full.shape) == tuple(like.to_local().shape):
        return full
    _check_sharding(like)
    rank, world = dist.get_rank(), dist.get_world_size()
    start, stop = local_rows(full.shape[0], rank, world)
    part = full[start:stop]
    assert part.shape == like.to_local().shape, f"shard {tuple(part.shape)} != local {tuple(like.to_local().shape)}"
    return part


def read_rows(path: Path, like: Callable[[str], torch.Tensor | None]) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor]]:
    """Every tensor's whole shape in a safetensors file, and this rank's rows of each tensor laid
    out as a sharded parameter (`like(key)` names it; others are read whole), reading no other rows.

    A rank reads its share of a checkpoint, not the whole of it, so N ranks hold one copy of
    the weights between them while they load.

    Raises:
        BadRequest: the file is missing or is not safetensors.
    """
    if not path.is_file():
        raise BadRequest(f"checkpoint {path.parent.name!r} has no {path.name}")
    shapes: dict[str, tuple[int, ...]] = {}
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safetensors.safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118  # safetensors' safe_open has keys() but is not iterable
                part = file.get_slice(key)
                shape = tuple(part.get_shape())
                shapes[key] = shape
                param = like(key)
                if isinstance(param, DTensor) and shape == tuple(param.shape) and shape:
                    start, stop = local_rows(shape[0], dist.get_rank(), dist.get_world_size())
                    tensors[key] = part[start:stop]
                else:
                    tensors[key] = file.get_tensor(key)
    except safetensors.SafetensorError as error:
        raise BadRequest(f"checkpoint {path.parent.name!r}: {path.name} is not valid safetensors: {error}") from error
    return shapes, tensors


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """‖g‖₂ over every rank's gradient shards: √(all_reduce Σ per-shard ‖gᵢ‖²), in fp32 (fp64 for fp64).

    The per-tensor norms are taken first, as `clip_grad_norm_` (and `optim.AdamW`) does, so
    that one process and N ranks sum the same per-tensor quantities.
    """
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    squares = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        squares += torch.linalg.vector_norm(grad, 2, dtype=dtype).to(torch.float64).square().cpu()
    dist.all_reduce(squares)
    return squares.sqrt().to(dtype)


def gather_bytes(data: bytes) -> list[bytes] | None:
    """Every rank's `data` on rank 0, in rank order (None on the others)."""
    world = dist.get_world_size()
    lengths = torch.zeros(world, dtype=torch.int64)
    lengths[dist.get_rank()] = len(data)
    dist.all_reduce(lengths)
    longest = int(lengths.max())
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    if dist.get_rank() != 0:
        return None
    return [part[: int(n)].numpy().tobytes() for part, n in zip(parts, lengths.tolist())]


class _WholeWeights(Mapping[str, torch.Tensor]):
    """The whole weights as a mapping that gathers each tensor when it is read: `delta.digest`
    reads them one at a time, in sorted order, on every rank alike."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return whole(self._params[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class ShardedWeights:
    """Full fine-tuning's weight sync over sharded weights: each rank's shadow of its own shards.

    Args:
        params: name -> parameter (DTensor shards, or plain tensors in a group of one).
        keep_shadow: True for weight_sync "delta" (the shadow is the shards as the sampler
            holds them), False for "full" (every sync sends every tensor whole).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], keep_shadow: bool) -> None:
        self._params = dict(params)
        self._shadow = {name: local_view(p).clone() for name, p in self._params.items()} if keep_shadow else None

    def device_tensors(self) -> list[torch.Tensor]:
        """What it keeps on the device besides the parameters: the shadow (for parking)."""
        return list(self._shadow.values()) if self._shadow is not None else []

    def digest(self) -> int:
        """`delta.digest` of the whole weights, gathered one tensor at a time (every rank computes it)."""
        return delta.digest(_WholeWeights(self._params))

    def _on_root(
        self,
        is_root: bool,
        base_version: str | None,
        tensors: list[delta.TensorDelta],
        mode: str,
        changed: int,
        total: int,
        full_bytes: int,
        started: float,
    ) -> delta.WeightDelta | None:
        """The change, on rank 0 (None on the others). Every rank takes part in the digest: it is a collective."""
        checksum = self.digest()
        if not is_root:
            return None
        return delta.WeightDelta(
            base_version=base_version, tensors=tensors, digest=checksum, mode=mode, changed_elements=changed,
            total_elements=total, full_bytes=full_bytes, compute_s=time.perf_counter() - started,
        )

    def full(self, base_version: str | None) -> delta.WeightDelta | None:
        """Every tensor whole (`delta.full_update`'s payload), on rank 0; None on the others."""
        started = time.perf_counter()
        is_root = dist.get_rank() == 0
        tensors, total, full_bytes = [], 0, 0
        for name, param in self._params.items():
            value = whole(param)
            total += value.numel()
            full_bytes += value.numel() * value.element_size()
            if is_root:
                tensors.append(delta.TensorDelta(name=name, indices=None, values=value.reshape(-1)))
        return self._on_root(is_root, base_version, tensors, "full", total, total, full_bytes, started)

    def delta(self, base_version: str | None) -> delta.WeightDelta | None:
        """The elements whose bits changed since the last sync (or the base), on rank 0 (None on
        the others); every rank's shadow then equals its shards again."""
        assert self._shadow is not None, "a delta needs the shadow that weight_sync 'delta' keeps"
        started = time.perf_counter()
        is_root = dist.get_rank() == 0
        tensors, changed_total, total, full_bytes = [], 0, 0, 0
        for name, param in self._params.items():
            part = self._changed(name, param)
            total += part.numel
            full_bytes += part.numel * part.element_size
            changed_total += part.changed
            if part.tensor is not None and is_root:
                tensors.append(part.tensor)
        return self._on_root(is_root, base_version, tensors, "delta", changed_total, total, full_bytes, started)

    def _changed(self, name: str, param: torch.Tensor) -> _ChangedTensor:
        """One tensor's change, agreed on by every rank: sparse (gathered indices and values) or dense."""
        assert self._shadow is not None
        now, old = local_view(param), self._shadow[name]
        flat = now.reshape(-1)
        local_index = torch.nonzero(delta.bits(now) != delta.bits(old)).reshape(-1)  # (changed here,) int64
        counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        counts[dist.get_rank()] = local_index.numel()
        dist.all_reduce(counts)
        changed = int(counts.sum())
        shape = tuple(param.shape)  # the whole tensor's shape (a DTensor's is global)
        numel = int(np.prod(shape)) if shape else 1
        element_size = now.element_size()
        old.copy_(now)  # the shadow is now what the sampler will hold
        if changed == 0:
            return _ChangedTensor(None, 0, numel, element_size)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        sparse_bytes = changed * (element_size + torch.empty((), dtype=index_dtype).element_size())
        if sparse_bytes >= numel * element_size:
            return _ChangedTensor(delta.TensorDelta(name, None, whole(param).reshape(-1)), changed, numel, element_size)
        # Local flat indices -> the whole tensor's: the shard starts at row `start` of dim 0.
        row_elements = numel // shape[0] if shape else 1
        start = local_rows(shape[0], dist.get_rank(), dist.get_world_size())[0] if isinstance(param, DTensor) else 0
        indices = gather_concat(local_index + start * row_elements, counts)
        values = gather_concat(flat[local_index].to("cpu"), counts)
        if indices is None or values is None:
            return _ChangedTensor(None, changed, numel, element_size)
        return _ChangedTensor(delta.TensorDelta(name, indices.to(index_dtype), values), changed, numel, element_size)


class _ChangedTensor:
    __slots__ = ("tensor", "changed", "numel", "element_size")

    def __init__(self, tensor: delta.TensorDelta | None, changed: int, numel: int, element_size: int) -> None:
        self.tensor = tensor  # None: unchanged (or, off rank 0, nothing to keep)
        self.changed = changed
        self.numel = numel
        self.element_size = element_size


def gather_concat(local: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every rank's 1-D `local` (of `counts[rank]` elements) end to end in rank order, on rank 0
    (None on the others). Without `counts`, the ranks first tell each other their sizes."""
    if counts is None:
        counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        counts[dist.get_rank()] = local.numel()
        dist.all_reduce(counts)
    dtype = local.dtype
    raw = delta.bits(local.to("cpu"))  # gloo moves integers of any width; not every float dtype
    padded = torch.zeros(int(counts.max()), dtype=raw.dtype)
    padded[: raw.numel()] = raw
    parts = [torch.empty_like(padded) for _ in range(counts.numel())]
    dist.all_gather(parts, padded)
    if dist.get_rank() != 0:
        return None
    return torch.cat([part[: int(n)] for part, n in zip(parts, counts.tolist())]).view(dtype)
