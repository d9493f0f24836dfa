"""log_softmax(logits)[rows, tokens] as one autograd node, whose backward builds the logits'
gradient in the one (rows, vocab) tensor that its forward saved.

`torch.log_softmax(logits, -1)[rows, tokens]` is two nodes, and its backward allocates two
(rows, vocab) float32 tensors besides the log-softmax that forward saved: indexing's
gradient, zeros with the upstream gradient put at the targets, and log_softmax's, `g - exp(lp)
* g.sum(-1)`. That gradient has a closed form, `-softmax * s` plus `g` at each (row, token)
pair, where `s` is a row's summed upstream gradient; `TokenLogprobs` computes it in place on
the saved log-softmax (`exp_`, `mul_`, `index_put_`), which backward no longer needs once it
has read it. At SmolLM2's vocabulary (49,152) each of those tensors is 75 MB for a micro-batch of
384 positions: above the heap's mmap threshold (`openrld/heap.py`), so each was a fresh mapping
whose pages the kernel zeroed on first touch, and two of them were alive at the backward's
peak. The sums are the same ones, float32 rounding apart.

torch has no gathered log-softmax, and its fused cross-entropy (`F.cross_entropy`) reduces over
one target per row, where a training request scores any number of (position, token) pairs per
position and keeps each one's log-probability; Liger's fused kernels are Triton, GPU only.

The saved log-softmax is overwritten by backward, so the node's graph runs backward once:
a second backward through it (`retain_graph=True`) raises instead of reading the gradient as
log-probabilities. Under `torch.utils.checkpoint` the saved tensor is the one recomputed for
that backward.
"""

from __future__ import annotations

from typing import Any

import torch


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(logits, -1)[rows, tokens]` for (c, V) `logits` and (n,) `rows` and `tokens`:
    (n,) log-probabilities, differentiable in `logits`."""
    return TokenLogprobs.apply(logits, rows, tokens)


class TokenLogprobs(torch.autograd.Function):
    """The node behind `token_logprobs`; its backward reuses the saved log-softmax as the gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        log_softmax = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_softmax, rows, tokens)
        ctx.spent = False
        return log_softmax[rows, tokens]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if ctx.spent:
            raise RuntimeError("token_logprobs's backward runs once: it overwrites the log-softmax it saved")
        log_softmax, rows, tokens = ctx.saved_tensors
        ctx.spent = True
        if not ctx.needs_input_grad[0]:
            return None, None, None
        row_sums = torch.zeros(log_softmax.shape[0], dtype=grad.dtype, device=grad.device).index_add_(0, rows, grad)
        grad_logits = log_softmax.exp_().mul_(row_sums.neg_().unsqueeze(1))  # -softmax * s, in the saved tensor
        return grad_logits.index_put_((rows, tokens), grad, accumulate=True), None, None
