"""The optimizers of the Automodel trainer: `gpu/optim.py`'s, stepped over sharded weights.

FSDP2 holds each weight as row shards over the group's ranks (`automodel_shards`). The
two families need different things of the shards:
- `ShardedAdamW`: AdamW is elementwise but for its clipping factor and reported norm, so
  it steps each rank's shards in place, with the norm taken over every rank's gradient
  shards; a step is the one-process step up to the order of the norm's sums;
- `WholeDimuon`: Dimuon is not elementwise (row and column statistics, a Newton-Schulz
  iteration over each matrix), so it steps whole matrices, gathered at each step, alike on
  every rank, and each rank keeps its rows. Only for LoRA, whose matrices are small.

Both keep `optim.py`'s contract: validation first (invalid params keep the gradients), a
non-finite norm drops them, the same metrics; and both export and import their state as
whole tensors (rank 0 holds the export), the files of the single-device trainers;
`ShardedAdamW` also one tensor at a time (`iter_state`), so that full fine-tuning's
checkpoint never holds the whole optimizer state on one rank.

What it does not do: compute gradients, choose the tensors, import trio.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from openrld.batches import AdamParams, DimuonParams
from openrld.errors import BadRequest
from openrld.gpu.automodel_shards import gather_concat, global_norm, local_view, shard_of
from openrld.gpu.optim import CLIP_EPS, AdamW, Dimuon, validate_adam_params, validate_dimuon_params
from openrld.gpu.safetensors_stream import TensorEntry

__all__ = ["ShardedAdamW", "WholeDimuon", "whole_on_device"]

Inner = TypeVar("Inner", AdamW, Dimuon)  # the single-device optimizer a wrapper drives


class _DrivesOptimizer(Generic[Inner]):
    """What both wrappers share: the model's parameters, whose gradients they read and drop, and the
    single-device optimizer (`inner`) that keeps the state and counts the steps."""

    _params: dict[str, torch.Tensor]
    inner: Inner

    @property
    def steps_done(self) -> int:
        return self.inner.steps_done

    def zero_grad(self) -> None:
        for param in self._params.values():
            param.grad = None
        self.inner.zero_grad()


class ShardedAdamW(_DrivesOptimizer[AdamW]):
    """`optim.AdamW` over one rank's shards, stepped with the norm of the whole gradient.

    AdamW is elementwise but for its clipping factor, min(1, c / (‖g‖ + 1e-6)), and the
    `grad_norm:mean` it reports: both need ‖g‖ over every rank's shards. So the step
    validates `params` as AdamW does, takes the global norm (`global_norm`), refuses a
    non-finite one as AdamW does (gradients dropped), scales each shard's gradient by the
    factor, and lets AdamW step the shards unclipped. Every rank sees the same norm.
    """

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self._params = params  # name -> the parameter (a DTensor of shards, or a plain tensor)
        self._shards = {name: local_view(p) for name, p in params.items()}  # plain views of the local rows
        self.inner = AdamW(self._shards)

    def step(self, params: AdamParams) -> dict[str, float]:
        validate_adam_params(params)  # invalid: BadRequest with the gradients kept, as AdamW
        grads = {name: local_view(p.grad) for name, p in self._params.items() if p.grad is not None}
        if not grads:
            return self.inner.step(params)
        norm = global_norm(list(grads.values()))
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            self.zero_grad()
            raise BadRequest("non-finite gradient norm (check loss inputs)", key="grad_norm")
        factor = None if params.grad_clip_norm <= 0 else torch.clamp(params.grad_clip_norm / (norm + CLIP_EPS), max=1.0)
        for name, grad in grads.items():
            if factor is not None:
                # As AdamW's own clipping: widened, scaled; kept in the parameter's dtype (a bf16
                # gradient rounds once more here, which a one-process bf16 step does not).
                widened = grad.to(torch.promote_types(grad.dtype, torch.float32))
                grad = (widened * factor.to(widened.dtype)).to(grad.dtype)
            self._shards[name].grad = grad
        for param in self._params.values():
            param.grad = None  # the shards' copies step; the parameters' go now
        metrics = self.inner.step(msgspec.structs.replace(params, grad_clip_norm=0.0))
        metrics["grad_norm:mean"] = grad_norm
        return metrics

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW's state of the whole tensors, on rank 0 (every rank gathers; others get {}).
        All of it at once: a checkpoint streams it instead (`state_layout`, `iter_state`)."""
        return {key: tensor for key, tensor in self.iter_state() if tensor is not None}

    def state_layout(self) -> list[TensorEntry]:
        """The keys of `state_tensors`, in its order, each with its whole tensor's dtype and shape:
        what a file's header needs, which every rank knows without a gather."""
        entries = []
        for key, local in sorted(self.inner.state_items(), key=lambda item: item[0]):
            name, _, suffix = key.rpartition(".")
            entries.append(TensorEntry(key, local.dtype, () if suffix == "step" else tuple(self._params[name].shape)))
        return entries

    def iter_state(self, keys: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """AdamW's state one whole tensor at a time, in the order of `keys` (default: `state_tensors`'):
        (key, the tensor) on rank 0, (key, None) on the others. Every rank must take every item, in
        the same order: each but a step count is a gather (`gather_concat`) of every rank's rows."""
        local = dict(self.inner.state_items())  # the live state: no copy of it is made here
        for key in sorted(local) if keys is None else keys:
            yield key, self._whole_state(key, local[key])  # bound to no name: gone once the caller drops it

    def _whole_state(self, key: str, local: torch.Tensor) -> torch.Tensor | None:
        name, _, suffix = key.rpartition(".")
        if suffix == "step":  # the same count on every rank; a copy, the caller's to drop
            return local.clone() if dist.get_rank() == 0 else None
        joined = gather_concat(local.reshape(-1))
        return None if joined is None else joined.reshape(tuple(self._params[name].shape))

    def param_of(self, key: str) -> torch.Tensor | None:
        """The parameter a state key ("<name>.exp_avg", ...) is laid out as; None for a step count."""
        name, _, suffix = key.rpartition(".")
        return None if suffix == "step" else self._params.get(name)

    def load_state_tensors(self, flat: dict[str, torch.Tensor]) -> None:
        """Take AdamW state (any trainer's), whole or already this rank's rows, each rank keeping its rows."""
        mine = {}
        for key, tensor in flat.items():
            name, _, suffix = key.rpartition(".")
            param = self._params.get(name)
            if suffix == "step" or param is None or tuple(tensor.shape) != tuple(param.shape):
                mine[key] = tensor  # AdamW refuses what does not fit, by name
            else:
                mine[key] = shard_of(tensor, param)
        self.inner.load_state_tensors(mine)

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer keeps on the device, themselves (not copies), for parking:
        AdamW's moments and master copies, and any gradient its shards still hold (the shards
        themselves are views of the parameters' storage)."""
        return self.inner.live_state() + [shard.grad for shard in self._shards.values() if shard.grad is not None]

    def reset(self) -> None:
        self.inner.reset()


class WholeDimuon(_DrivesOptimizer[Dimuon]):
    """`optim.Dimuon` over whole LoRA matrices, stepped alike on every rank.

    Dimuon is not elementwise: its direction needs each matrix whole (row and column
    statistics, a Newton-Schulz iteration), and FSDP2 shards every matrix by rows. LoRA
    matrices are small (r x n, m x r), so each step gathers every matrix and its gradient
    whole, on the device; every rank runs the same Dimuon step on the same whole tensors,
    so every rank computes the same update, and keeps its own rows of it. The momentum is
    kept whole on every rank (one r x n or m x r tensor per matrix).
    """

    def __init__(self, params: dict[str, torch.Tensor], rank: int) -> None:
        self._params = params
        self._whole = {name: whole_on_device(p) for name, p in params.items()}
        self.inner = Dimuon(self._whole, rank)

    def step(self, params: DimuonParams) -> dict[str, float]:
        validate_dimuon_params(params)  # invalid: BadRequest with the gradients kept
        with torch.no_grad():
            for name, param in self._params.items():
                self._whole[name].copy_(whole_on_device(param))  # the weights as they are now (a load may have moved them)
                self._whole[name].grad = None if param.grad is None else whole_on_device(param.grad)
        try:
            metrics = self.inner.step(params)
        finally:
            # What Dimuon did with the whole gradients (spent, dropped, or kept), the shards' follow.
            for name, param in self._params.items():
                if self._whole[name].grad is None:
                    param.grad = None
        with torch.no_grad():
            for name, param in self._params.items():
                local_view(param).copy_(shard_of(self._whole[name], param))
        return metrics

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The momentum (whole already), on rank 0; {} on the others."""
        return self.inner.state_tensors() if dist.get_rank() == 0 else {}

    def param_of(self, key: str) -> None:
        """None: the momentum is kept whole on every rank, so every rank reads it whole."""
        return None

    def load_state_tensors(self, flat: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_tensors(flat)

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer keeps on the device, themselves (not copies), for parking:
        the momentum and the whole matrices (with any gradient they hold)."""
        grads = [tensor.grad for tensor in self._whole.values() if tensor.grad is not None]
        return self.inner.live_state() + list(self._whole.values()) + grads

    def reset(self) -> None:
        self.inner.reset()


def whole_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor where its shards are (an all-gather for a DTensor; a detached copy otherwise)."""
    if isinstance(tensor, DTensor):
        return tensor.detach().full_tensor()
    return tensor.detach().clone()
