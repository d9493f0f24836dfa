"""How many CPU threads one engine call computes on, chosen from the size of its work.

Torch's intra-op pool (OpenMP) pays a fixed cost at every parallel region: the
waiting threads are woken (once their short spin is over, openrld/__init__.py)
and joined again. A large matmul repays it many times over; the tiny Llama's ops,
each a few microseconds, do not. Measured on the 2-core VM (an engine-like worker
thread, passive waits, the machine loaded by other work), the tiny Llama (width
64, 0.10 M weights past the embedding): fwd+bwd of 8 x 128 tokens 56 ms on one
thread against 119 ms on two, a decode step of 64 rows 2.7 against 4.4 ms, and no
size of its work faster on two; an SDK client's sample of 8 x 32 took 0.204 s with
every core against 0.033 s on one (issue 36). SmolLM2 (135 M weights) runs its
large matmuls on every core.

So each call takes one thread per `WORK_PER_THREAD` multiply-adds of its forward
(the weights a token multiplies by x the tokens in the call), at least one and at
most the node's ceiling (`set_ceiling`: config `cpu_threads`, else the device's
share of the cores). The tiny Llama's calls (at most ~100 M, an 8 x 128 step) stay
on one thread; SmolLM2's decode step of 8 rows (1,080 M) and its training steps
take the ceiling. A switch costs 0.1-1.4 microseconds (`torch.set_num_threads`),
and a step on two threads right after one on one thread ran no slower than after
another on two.

The count is set at the top of each call that computes: a training pass
(`scoring.BatchScorer`), a prefill and a decode step (`fused_forward`,
`torch_sampler`). What follows it in the same engine call keeps it (the draw after
a decode, the optim_step after its pass), and so does a lone optim_step (a LoRA
update is small; a full model's follows its pass's count). Torch's count is the
process's, and the engines of a CPU device compute one at a time
(actors/device_pool.py), so a call's count holds while it runs. With no ceiling
(a node without a CPU device) torch is left alone.
"""

from __future__ import annotations

import torch

# Multiply-adds that repay one more thread. Between the tiny Llama's largest call
# (102 M, and one thread was faster at every size measured, up to 404 M) and
# SmolLM2's decode step of 8 rows (1,080 M); its decode of one row (135 M) stays on one.
WORK_PER_THREAD = 256 * 2**20

_ceiling: int | None = None  # this process's, from `set_ceiling`


def threads_for(work: int, ceiling: int) -> int:
    """One thread per WORK_PER_THREAD multiply-adds of `work`, at least one, at most `ceiling`."""
    return max(1, min(ceiling, work // WORK_PER_THREAD))


def set_ceiling(threads: int | None) -> None:
    """The most threads a call of this process takes (None: leave torch's own count)."""
    global _ceiling
    _ceiling = threads


def weights(model: torch.nn.Module) -> int:
    """The elements a token's forward multiplies by: every parameter but the input
    embedding, of which a token reads one row, unless the output head is that matrix."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is counted once
    return total if head is not None and head.weight is embedding else total - embedding.numel()


def compute_on(weights: int, tokens: int) -> None:
    """Set torch's threads for a call that runs `tokens` tokens through `weights` elements."""
    if _ceiling is not None:
        torch.set_num_threads(threads_for(weights * tokens, _ceiling))
