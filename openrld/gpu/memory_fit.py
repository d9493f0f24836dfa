"""Whether a training datum's step fits in the memory its device can give, before it runs.

A datum too long for the device would otherwise run until the allocator fails: on CUDA an
out-of-memory error mid-step, on a CPU the kernel's OOM killer taking the whole daemon. So
`BatchScorer` estimates each datum's step and refuses one over the limit with a 400 that names
both figures (`fit_refusal`).

The estimate assumes activation checkpointing where the model has it (`BatchScorer` turns it on
for any micro-batch large enough to matter; without it, the whole graph is kept): each decoder
layer keeps only its input hidden states for backward, and one layer at a time holds its whole
activations while it is recomputed; the log-softmax holds a chunk of logits. Per token, with `per_token` the bytes the full graph keeps (measured on the
model, `BatchScorer._measure_activation_bytes_per_token`) over `layers` layers of width `hidden`:

    bytes = tokens × (per_token / layers + layers × hidden × element_size) + logits_bytes

It is an estimate, not a bound: it leaves out the allocator's fragmentation, the backward's
gradients of the recomputed layer, and what the 32- and 64-token probes cannot see (attention
scores past a sliding window). Measured against the peak RSS a step adds on 2 CPU cores, it is
low: Gemma 3 270M, 0.46 GiB estimated against 1.4 GiB at 2,048 tokens and 1.08 against 4.06 at
8,192; so it refuses what cannot fit by far, and a datum near the limit may still not fit.

What it does not do: plan micro-batches, or decide whether to checkpoint (`scoring.py` does).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")


def step_bytes(
    tokens: int, per_token: float, checkpointed_layers: int, hidden: int, element_size: int, logits_bytes: int
) -> int:
    """The module docstring's estimate of one step over `tokens` tokens. With no checkpointed
    layers (checkpointing off, or a model without it) the whole graph is kept: tokens × per_token."""
    if checkpointed_layers == 0:
        return int(tokens * per_token) + logits_bytes
    kept_inputs = checkpointed_layers * hidden * element_size  # each layer's input, kept for its recompute
    one_layer = per_token / checkpointed_layers  # the layer being recomputed holds its whole graph
    return int(tokens * (one_layer + kept_inputs)) + logits_bytes


def available_memory(device: torch.device) -> int:
    """The bytes the device can give to a new allocation now.

    CUDA: what the driver has free plus what torch's caching allocator holds but does not use.
    CPU: MemAvailable from /proc/meminfo (free memory plus the page cache the kernel can drop);
    where that file does not exist, the free pages sysconf reports.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    if MEMINFO.exists():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in KiB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fit_refusal(index: int, tokens: int, estimate: int, limit: int) -> str | None:
    """The 400's message for datum `index` when its `estimate` passes `limit`; None when it fits."""
    if estimate <= limit:
        return None
    return (
        f"datum {index}: model_input has {tokens} tokens, whose training step needs about "
        f"{_gib(estimate)} of memory; the device can give {_gib(limit)} "
        f"({estimate} > {limit} bytes); send a shorter datum"
    )


def _gib(size: int) -> str:
    return f"{size / 1024**3:.2f} GiB"
