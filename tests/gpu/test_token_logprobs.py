"""token_logprobs: log_softmax(logits)[rows, tokens] with the gradient of torch's two nodes,
built in the one (rows, vocab) tensor its forward saved.

Both sides compute the same float32 sums in another order; gradients are at most 1 in size here,
where one float32 ulp is ~1e-7: atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from openrld.gpu.token_logprobs import token_logprobs

ATOL = 1e-6
POSITIONS, VOCAB = 6, 50
# Position 0 has two targets (a request's (N, K) targets), one of them twice; position 4 none.
ROWS = torch.tensor([0, 0, 0, 1, 2, 3, 5])
TOKENS = torch.tensor([7, 7, 12, 49, 0, 3, 21])


def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(POSITIONS, VOCAB) * 4).requires_grad_(True)


def upstream() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(len(ROWS))


def torchs_gradient(x: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(torch.log_softmax(x, dim=-1)[ROWS, TOKENS], x, upstream())
    return grad


def test_the_log_probabilities_are_torchs_log_softmax_at_the_pairs():
    x = logits()
    assert torch.equal(token_logprobs(x, ROWS, TOKENS), torch.log_softmax(x, dim=-1)[ROWS, TOKENS])


def test_the_gradient_is_torchs_for_repeated_and_missing_positions():
    x = logits()
    (grad,) = torch.autograd.grad(token_logprobs(x, ROWS, TOKENS), x, upstream())
    torch.testing.assert_close(grad, torchs_gradient(x), rtol=0, atol=ATOL)


def test_a_position_without_pairs_gets_no_gradient():
    x = logits()
    (grad,) = torch.autograd.grad(token_logprobs(x, ROWS, TOKENS), x, upstream())
    assert torch.equal(grad[4], torch.zeros(VOCAB))


def test_under_checkpointing_the_gradient_is_torchs():
    x = logits()
    lp = torch.utils.checkpoint.checkpoint(token_logprobs, x, ROWS, TOKENS, use_reentrant=False)
    (grad,) = torch.autograd.grad(lp, x, upstream())
    torch.testing.assert_close(grad, torchs_gradient(x), rtol=0, atol=ATOL)


def test_a_second_backward_through_the_node_is_refused():
    x = logits()
    lp = token_logprobs(x, ROWS, TOKENS)
    torch.autograd.grad(lp, x, upstream(), retain_graph=True)
    with pytest.raises(RuntimeError, match="token_logprobs's backward runs once"):
        torch.autograd.grad(lp, x, upstream())


class LogitSizedOutputs(TorchDispatchMode):
    """The storages of every (positions, vocab) tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == POSITIONS * VOCAB:
            self.storages.add(out.untyped_storage().data_ptr())
        return out


def test_the_backward_builds_the_gradient_in_one_logit_sized_tensor():
    x = logits()
    lp = token_logprobs(x, ROWS, TOKENS)
    with LogitSizedOutputs() as outputs:
        torch.autograd.grad(lp, x, upstream())
    assert len(outputs.storages) == 1
