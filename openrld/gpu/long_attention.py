"""Attention for long training datums on models with sliding-window layers, in O(tokens × window).

Why it exists: transformers' sdpa path gives a sliding-window layer a dense (tokens × tokens)
boolean mask whenever the sequence reaches the window (`masking_utils._ignore_causal_mask_sdpa`
declines to skip it), and `scaled_dot_product_attention` then computes every query against
every key and masks most of them away. A sliding layer costs as much as a full one, in time and
in memory: a 4-layer Gemma 3 of width 256 with a window of 512 (3 sliding layers) took 12.2 s
and 0.7 GB for one forward+backward of 4,096 tokens, and 154 s and 5.2 GB at 16,384, on 2 CPU
cores. No library gives windowed attention without the dense mask on a CPU: flash-attn's
window runs on CUDA only and needs fp16/bf16, and flex attention's block masks need a compile
that the CPU path does not have here. So it is written by hand, and small.

What it does, on a model `use_long_attention` switches over:
- a sliding layer splits the queries into blocks of at most `QUERY_BLOCK` rows; each block
  attends, through SDPA with a small boolean mask, only the keys its window reaches (the block's
  own rows and the `window - 1` before it), so no tensor is larger than a block × (block + window);
- a full-attention layer calls transformers' own sdpa function, which with no mask is plain
  causal SDPA (`is_causal=True`), the flash kernel on CUDA;
- the mask builder registered beside it builds no mask at all for the trainer's batches: one
  unpadded datum, or datums right-padded to one length. Under causal attention a real position
  never reaches the padding after it, so the real positions' outputs are exactly those of the
  masked attention; only the padding's own rows differ, and the scorer drops them.
Every other case (a cache with earlier tokens, left padding, an extra mask pattern) gets
transformers' own dense mask and its sdpa function, unchanged.

Guarantee: at real positions, outputs and gradients equal transformers' sdpa path up to float
summation order (tests/gpu/test_long_attention.py, on every tiny family with sliding layers).

What it does not do: the sampler's attention (it keeps transformers' own, with its cache),
attention soft-capping (handed to the sdpa function, which refuses it as before), trio.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["ATTENTION", "QUERY_BLOCK", "use_long_attention", "windowed_attention"]

ATTENTION = "openrld_long"  # the name registered with transformers' attention and mask interfaces
# Queries per block of a sliding layer: a block's scores are QUERY_BLOCK × (QUERY_BLOCK + window - 1),
# 512 × 1,023 × heads for Gemma 3's window of 512; larger blocks only waste more masked scores.
QUERY_BLOCK = 512


def use_long_attention(model: torch.nn.Module) -> bool:
    """Switch `model` to windowed attention if any of its layers has a sliding window; returns
    whether it did. A model without one keeps its attention: there is nothing n² to save."""
    if not any(getattr(module, "sliding_window", None) for module in model.modules()):
        return False
    AttentionInterface.register(ATTENTION, windowed_attention)
    AttentionMaskInterface.register(ATTENTION, _mask_unless_plain)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise RuntimeError(f"transformers kept attention {model.config._attn_implementation!r} for {ATTENTION!r}")
    return True


def windowed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, T, D), key and value (B, Hkv, T, D);
    returns (B, T, Hq, D) and no weights. Blocks only a sliding layer's own causal self-attention
    longer than its window; anything else is the sdpa function's."""
    tokens = query.shape[2]
    plain = attention_mask is None and key.shape[2] == tokens and not kwargs.get("softcap")
    if not plain or sliding_window is None or tokens <= sliding_window:
        # Within the window, sliding attention is plain causal attention.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    block = min(QUERY_BLOCK, sliding_window)
    outputs = []
    for start in range(0, tokens, block):
        end = min(start + block, tokens)
        first_key = max(0, start - sliding_window + 1)  # the earliest key the block's first query reaches
        queries = torch.arange(start, end, device=query.device)[:, None]
        keys = torch.arange(first_key, end, device=query.device)[None, :]
        # Query q sees keys k with q - window < k <= q, as transformers' sliding_window_causal_mask_function.
        allowed = (keys <= queries) & (keys > queries - sliding_window)  # (block, keys)
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start:end],
                repeat_kv(key[:, :, first_key:end], groups),
                repeat_kv(value[:, :, first_key:end], groups),
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scaling,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _mask_unless_plain(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask builder for `ATTENTION`: none for causal self-attention from position 0 whose
    padding, if any, is all on the right; otherwise transformers' dense sdpa mask.

    A caller that forbids the causal skip (an extra mask pattern, packed sequences) gets the
    dense mask too: then the pattern is more than causal + window."""
    fresh = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if allow_is_causal_skip and fresh and _right_padded_only(attention_mask):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def _right_padded_only(padding_mask: torch.Tensor | None) -> bool:
    """Whether each row of a 2-D padding mask (B, T) is real tokens then padding, never a real
    token after padding: then causal attention alone keeps every real position off the padding."""
    if padding_mask is None:
        return True
    mask = padding_mask.bool()
    return bool((mask[:, 1:] <= mask[:, :-1]).all())
