"""The model bench/long_attention.py trains on: a small Gemma 3 with Gemma 3 270M's window.

Four decoder layers of width 256 (three sliding-window layers of 512 and one full-attention
layer, the real model's 5:1 mix as near as four layers get), random weights with seed 0, and
one forward+backward of its decoder on `tokens` ids. transformers and torch only: the baseline
imports this, and nothing of openrld may come with it.
"""

from __future__ import annotations

import json
import resource
import time

import torch
import transformers

WINDOW = 512


def window_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=WINDOW,
        max_position_embeddings=32768, layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def step_report(model: torch.nn.Module, tokens: int, padded: bool) -> str:
    """One forward+backward of the decoder: a JSON line of its time and the peak RSS it added.

    padded: two rows, the second half padding (a right-padded batch), instead of one row."""
    ids = torch.randint(0, 512, (2 if padded else 1, tokens), generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, tokens // 2 :] = 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    hidden.square().mean().backward()
    seconds = time.perf_counter() - start
    added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    return json.dumps({"tokens": tokens, "rows": ids.shape[0], "seconds": round(seconds, 2), "added_mb": round(added / 1024)})
