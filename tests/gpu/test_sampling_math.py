"""sampling_math's top-k without a full sort, against the full stable sort it replaces.

The reference is `torch.sort(..., descending=True, stable=True)`: its first k columns are
the k best by value with ties by id ascending (the SDK's order). Inputs are
built with ties on purpose (values drawn from a few levels), so that the tie-breaking is
what is tested; the comparison is exact, since both pick the same entries of one tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from openrld.batches import SamplingSpec
from openrld.gpu.sampling_math import best_k, processed_logprobs, top_k_rows


def tied_rows(rows: int, vocab: int, levels: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, (rows, vocab), generator=generator).float() / levels


def sorted_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


@pytest.mark.parametrize("levels", [3, 40, 100_000], ids=["ties-everywhere", "some-ties", "few-ties"])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_best_k_equals_the_first_k_of_a_stable_sort(levels: int, k: int) -> None:
    x = tied_rows(16, 300, levels, seed=k)
    values, ids = best_k(x, k)
    expected_values, expected_ids = sorted_reference(x, k)
    assert torch.equal(values, expected_values)
    assert torch.equal(ids, expected_ids)


def test_top_k_rows_keep_the_lowest_ids_of_a_tie_at_the_kth_place() -> None:
    logp = torch.tensor([[0.0, -1.0, -1.0, -1.0, -2.0, -1.0]])
    ids, lps = top_k_rows(logp, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert lps.tolist() == [[0.0, -1.0, -1.0]]


def test_top_k_rows_order_a_tie_inside_the_k_by_id() -> None:
    logp = torch.tensor([[-1.0, 0.0, -1.0, -3.0, -1.0, -2.0, -1.0]])
    ids, lps = top_k_rows(logp, 6)  # every -1.0 is in: no tie straddles the 6th place
    assert ids.tolist() == [[1, 0, 2, 4, 6, 5]]
    assert lps.tolist() == [[0.0, -1.0, -1.0, -1.0, -1.0, -2.0]]


@pytest.mark.parametrize("top_p", [1.0, 0.5], ids=["top-k", "top-k-then-top-p"])
def test_top_k_q_equals_the_sorted_definition(top_p: float) -> None:
    logits = tied_rows(8, 300, 40, seed=3) * 6
    params = SamplingSpec(temperature=0.7, top_k=20, top_p=top_p)
    got = processed_logprobs(logits, params)
    # The definition over a full stable sort: keep the first 20, then top-p.
    sorted_logits, order = torch.sort(logits / 0.7, dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(sorted_logits, dtype=torch.bool)
    keep[:, :20] = True
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    keep &= (torch.cumsum(probs, dim=-1) - probs) < top_p
    expected = torch.empty_like(logits).scatter_(
        -1, order, torch.log_softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    )
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-6)  # fp32 sums of <= 20 terms


def top_p_definition(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by its definition, over a full stable sort: the smallest set reaching top_p, renormalised."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    keep = (torch.cumsum(probs, dim=-1) - probs) < top_p
    sorted_logq = torch.log_softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logq)


@pytest.mark.parametrize(
    "spread", [[8.0] * 4, [0.01] * 4, [8.0, 0.01, 8.0, 0.01]], ids=["peaked", "flat", "mixed-rows"]
)
def test_top_p_alone_over_a_large_vocabulary_equals_the_sorted_definition(spread: list[float]) -> None:
    # 5,000 tokens: a peaked row keeps its few best (found among the first 1,024 candidates), a
    # flat one keeps most of its vocabulary (sorted in full); ties from 1,000 levels.
    levels = tied_rows(4, 5000, 1000, seed=7)
    logits = levels * torch.tensor(spread).unsqueeze(1) * 10
    got = processed_logprobs(logits, SamplingSpec(temperature=1.0, top_p=0.9))
    expected = top_p_definition(logits, 0.9)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-5)
