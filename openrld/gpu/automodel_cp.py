"""Context parallelism for the Automodel trainer: one micro-batch's sequence split over C ranks.

What it owns: how a cp group of C ranks scores one micro-batch together. The micro-batch's
datums are packed into one sequence (document ids 1..n, position ids restarting at each
datum), padded to a multiple of 2C and cut into C contiguous chunks by NeMo Automodel's
block-diagonal context parallelism (`nemo_automodel.components.distributed.blockdiag_cp`,
`make_cp_blockdiag_batch_and_ctx`); each rank runs the model on its chunk only, and inside
every attention layer the ranks all-gather K and V (differentiably: the backward
reduce-scatters) and attend with per-document causal masks rebuilt from the document ids.
Each rank then takes the log-probabilities of its chunk's targets, with `BatchScorer`'s
chunked fp32 log-softmax, and the chunks' log-probabilities are all-gathered over the cp
group (differentiably: `_GatherParts`) into the micro-batch's
whole packed layout, from which `BatchScorer.score_micro_batch` computes every loss exactly
as the one-process trainers do. Activation memory per rank is that of the packed length / C.

Guarantee: the log-probabilities, losses and metrics are the one-process ones up to float
summation order (a datum attends to exactly its own earlier tokens, at its own positions),
and so is the gradient, given how `automodel_passes` backpropagates it (each cp rank
computes the same loss and backpropagates 1/C of it; see `ShardedPasses`).

The attention kernel: on a CPU the dense one (`scaled_dot_product_attention` with a boolean
mask, math or memory-efficient); on a GPU Automodel's default, FlashAttention's varlen
kernel when flash-attn is installed and the dtype is bf16/fp16, otherwise the same dense
kernel. Only the CPU path has run here (2 gloo ranks, parity within 1e-5 with one process:
`tests/gpu/test_automodel_cp.py`); the GPU path is the same code over NCCL, not run here.

Why the attention is registered by hand: Automodel 0.7.0 wires blockdiag_cp into none of
the Hugging Face models that `force_hf` loads (and forces "sdpa" whenever cp > 1), so this
module registers an attention function with transformers' public `AttentionInterface`
("openrld_cp") that routes to `cp_blockdiag_sdpa` while the context is active, and to
transformers' own sdpa function otherwise (the one-token empty passes), and switches the
loaded model to it (`set_attn_implementation`). No attention mask is built for it
(transformers builds none for an attention it does not know): under the context the mask
comes from the document ids, and outside it every forward is one unpadded sequence.

What it does not do: plan which rank scores what (`automodel_passes`), pad several datums
side by side (the packed sequence is the batch), import nemo_automodel or transformers before
it is used, trio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from openrld.gpu.scoring import BatchScorer, TrainerConfig

__all__ = ["ATTENTION", "ContextParallelScorer", "plan_packed_micro_batches", "use_cp_attention"]

ATTENTION = "openrld_cp"  # the name registered with transformers' AttentionInterface


def use_cp_attention(model: torch.nn.Module, device: torch.device) -> None:
    """Route `model`'s attention through block-diagonal CP (module docstring): register the
    attention function and switch the model to it. On a CPU, pin Automodel's kernel choice to
    the dense one (its default, flash, needs CUDA and would only warn and fall back)."""
    from nemo_automodel.components.distributed.blockdiag_cp import configure_cp_varlen
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _cp_attention)
    model.set_attn_implementation(ATTENTION)
    assert model.config._attn_implementation == ATTENTION, model.config._attn_implementation
    if device.type == "cpu":
        configure_cp_varlen(attn_backend="dense")


def _cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, L, D), key and value
    (B, Hkv, L, D), this rank's rows only; returns (B, L, Hq, D) and no weights."""
    from nemo_automodel.components.distributed.blockdiag_cp import cp_blockdiag_sdpa, current_blockdiag_cp_state
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if current_blockdiag_cp_state() is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # Whole heads for K and V, as the sdpa path does with a mask: the dense kernel takes no GQA flag.
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = cp_blockdiag_sdpa(query, key, value, dropout_p=dropout, scale=scaling)  # (B, Hq, L, D)
    return out.transpose(1, 2).contiguous(), None


def plan_packed_micro_batches(lengths: Sequence[int], max_batch_tokens: int, cp: int) -> list[list[int]]:
    """Group datum indices into packed micro-batches of at most `cp` × `max_batch_tokens` tokens.

    The budget is per rank, as for one device: a pack of P tokens is padded to a multiple of
    2·cp and each rank holds P / cp of it, less than `max_batch_tokens` + 2 tokens. So a datum
    of up to cp × `max_batch_tokens` tokens fits, which is what context parallelism is for.
    Longest first, as `plan_micro_batches`; a datum longer than the budget gets a pack of its
    own. Packing has no padding between datums, so a pack's cost is its sum of lengths.
    """
    budget = cp * max_batch_tokens
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    filled = 0
    for index in order:
        if groups and filled + lengths[index] <= budget:
            groups[-1].append(index)
            filled += lengths[index]
        else:
            groups.append([index])
            filled = lengths[index]
    return groups


class ContextParallelScorer(BatchScorer):
    """`BatchScorer` whose micro-batch log-probabilities come from the cp group's chunks.

    Only `_target_logprobs` differs: it returns the same (M,) float32 packed log-probabilities,
    whole on every cp rank, so `score_micro_batch` and every loss run unchanged. Every rank of
    the cp group must call it with the same micro-batch (its collectives are the group's).

    Args:
        model, device, config: as `BatchScorer`; the model's attention is `use_cp_attention`'s.
        cp_mesh: the cp group's one-dimensional DeviceMesh (Automodel's "cp" axis).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, config: TrainerConfig, cp_mesh: DeviceMesh) -> None:
        super().__init__(model, device, config)
        self._cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        # The last micro-batch's CP context (`make_cp_blockdiag_batch_and_ctx`), for its backward.
        self._context: Callable[[], contextlib.AbstractContextManager[None]] | None = None

    def _target_logprobs(
        self, tokens: Sequence[np.ndarray], targets: Sequence[np.ndarray], chunk: int | None = None
    ) -> torch.Tensor:
        """lp of one micro-batch in the packed layout of losses.py, (M,) float32, M = Σ targets.size:
        this rank's chunk scored under the CP context, then every chunk's lp gathered. `chunk`:
        log-softmax positions at a time, as `BatchScorer`'s (the memory probe's); None: the step's."""
        from nemo_automodel.components.distributed.blockdiag_cp import make_cp_blockdiag_batch_and_ctx

        lengths = [len(t) for t in tokens]
        train_ctx, batch, _ = make_cp_blockdiag_batch_and_ctx(self._cp_mesh, None, self._packed(tokens))
        self._context = train_ctx
        rows = batch["input_ids"].shape[1]
        with train_ctx():
            logits = self._model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        counts, positions, chunk_targets = _chunk_targets(lengths, targets, rows, self.cp)
        local = self._chunk_target_logprobs(logits[0], positions[self.cp_rank], chunk_targets[self.cp_rank], chunk)
        return self._gathered_logprobs(local, counts)

    def recompute_context(self) -> contextlib.AbstractContextManager[None]:
        """The CP context of the micro-batch scored last, for its backward: a checkpointed layer
        recomputes its attention in backward, and outside the context attention is plain sdpa on
        this rank's chunk (Automodel keeps it over forward and backward alike)."""
        assert self._context is not None, "recompute_context before any micro-batch was scored"
        return self._context()

    def _packed(self, tokens: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """The datums as one sequence (1, P): ids, positions restarting at each datum, document
        ids 1..n (0 is the padding `make_cp_blockdiag_batch_and_ctx` adds)."""
        columns = {
            "input_ids": np.concatenate([np.asarray(t) for t in tokens]),
            "position_ids": np.concatenate([np.arange(len(t)) for t in tokens]),
            "_packed_seq_ids": np.concatenate([np.full(len(t), d + 1) for d, t in enumerate(tokens)]),
        }
        return {key: torch.from_numpy(v.astype(np.int64))[None].to(self.device) for key, v in columns.items()}

    def _chunk_target_logprobs(
        self, logits: torch.Tensor, positions: list[np.ndarray], targets: list[np.ndarray], chunk: int | None
    ) -> torch.Tensor:
        """`_logprobs_at` over this chunk's logits (rows, V); a chunk of padding only scores
        nothing but stays in the graph, so its backward (and its collectives) still run."""
        if not positions:
            return logits[:0, 0].float()
        return self._logprobs_at(logits, positions, targets, False, chunk or self._chunk_positions(self._checkpointed))

    def _gathered_logprobs(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's lp in rank order, which is packed order (the chunks are contiguous).
        all_gather wants equal sizes: each rank pads its part to the largest, then cuts."""
        size = max(counts)
        padded = torch.nn.functional.pad(local, (0, size - local.numel()))
        gathered = _GatherParts.apply(padded, self._cp_mesh.get_group())
        return torch.cat([gathered[rank * size : rank * size + count] for rank, count in enumerate(counts)])


class _GatherParts(torch.autograd.Function):
    """All-gather equal-sized 1-D parts over `group`, concatenated in group-rank order; backward:
    each rank's part gets the sum over the ranks of its slice of their gradients.

    Not `torch.distributed.nn.functional.all_gather`: on gloo its backward scatters with the group
    rank as a global one (`_AlltoAll`), which fails for a cp group without global rank 0 (ranks 2
    and 3 of dp = 2 × cp = 2: "Global rank 0 is not part of group")."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        size = summed.numel() // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return summed[rank * size : (rank + 1) * size], None


def _chunk_targets(
    lengths: list[int], targets: Sequence[np.ndarray], rows: int, cp: int
) -> tuple[list[int], list[list[np.ndarray]], list[list[np.ndarray]]]:
    """Which targets each rank's chunk of `rows` packed positions holds, known to every rank.

    Returns, per rank: how many lp it scores (a (N, K) target counts K per position), and, for
    each datum its chunk touches, the chunk rows and the targets read there.
    """
    starts = np.cumsum([0] + lengths)
    counts, positions, chunk_targets = [], [], []
    for rank in range(cp):
        low, high = rank * rows, (rank + 1) * rows
        rank_positions, rank_targets = [], []
        for datum, target in enumerate(targets):
            first, last = max(low, starts[datum]), min(high, starts[datum + 1])
            if first < last:
                rank_positions.append(np.arange(first, last) - low)
                rank_targets.append(target[first - starts[datum] : last - starts[datum]])
        counts.append(sum(t.size for t in rank_targets))
        positions.append(rank_positions)
        chunk_targets.append(rank_targets)
    return counts, positions, chunk_targets

