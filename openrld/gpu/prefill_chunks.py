"""How a long prompt is cut into prefill chunks: each chunk's transient memory within a budget.

A chunk of T prompt positions after C cached ones costs, besides the KV it adds:
- its attention mask, (T, C + T): a boolean one and the additive one built from
  it in the model's dtype (`fused_forward` and Hugging Face's mask builders both
  hold both), so (1 + dtype bytes) per query per key column; the attention
  kernels themselves (torch's SDPA, flash on CPU) never hold the (T, C + T) scores;
- its logits, (T, V), only where they are needed: every scored position, in the
  model's dtype, as fp32 and as fp32 log-softmax (so `logit_bytes` ~ 3 x 4 x V
  a position); a chunk that scores nothing keeps one row.
The mask grows with the columns already cached, so the chunks shrink as the
prompt goes on: `chunk_spans` keeps each chunk's mask and logits under
`budget_bytes`, and never makes a chunk longer than `cap_tokens` or shorter than
one position (a prompt always progresses, however small the budget).

Pure arithmetic; no torch, no state.
"""

from __future__ import annotations

from collections.abc import Iterator


def chunk_spans(
    start: int,
    end: int,
    *,
    cap_tokens: int,
    budget_bytes: int,
    key_bytes: int,
    logit_bytes: int,
    first_scored: int,
) -> Iterator[tuple[int, int]]:
    """The (lo, hi) position spans that prefill positions start .. end-1, in order.

    Args:
        start: the first position to compute (those before it are cached).
        end: one past the last prompt position.
        cap_tokens: the longest chunk, whatever the budget.
        budget_bytes: what one chunk's mask and logits may hold.
        key_bytes: mask bytes per query per key column.
        logit_bytes: logits bytes per scored position.
        first_scored: the first position whose logits every later position's chunk keeps
            (`end` when only the last position's are needed).
    """
    lo = start
    while lo < end:
        # Priced at the longest chunk the cap allows: its mask spans the most columns.
        widest = min(lo + cap_tokens, end)
        scored = logit_bytes if widest > first_scored else 0
        per_query = widest * key_bytes + scored
        tokens = max(1, min(cap_tokens, budget_bytes // per_query))
        hi = min(lo + tokens, end)
        yield lo, hi
        lo = hi
