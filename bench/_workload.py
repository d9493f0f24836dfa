"""The work that both sides of a throughput bench do, in one place: the bare loop's process and the
SDK client's process build their token rows and hyper-parameters from here, so the two do the same
work. numpy only: both of those processes import it, and neither imports openrld or torch through it.
"""

from __future__ import annotations

import numpy as np

RANK, LR = 8, 1e-4  # LoRA rank (alpha 32, as Tinker's) and AdamW's learning rate
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-12  # the SDK's AdamParams defaults, so the bare loop takes them too
PROMPT_TOKENS = 32  # every sampling bench's prompt length


def token_rows(rows: int, length: int, vocab: int, seed: int) -> np.ndarray:
    """(rows, length) token ids drawn from the model's vocabulary (its first 32,000 ids at most)."""
    return np.random.default_rng(seed).integers(3, min(vocab, 32000), size=(rows, length))


def batch_tokens(batch: int, seq_len: int, vocab: int) -> np.ndarray:
    """An SFT batch's rows, (batch, seq_len + 1): inputs are [:, :-1], targets [:, 1:]."""
    return token_rows(batch, seq_len + 1, vocab, seed=batch * seq_len)


def prompt(vocab: int) -> list[int]:
    """The sampling prompt, PROMPT_TOKENS ids."""
    return token_rows(1, PROMPT_TOKENS, vocab, seed=1)[0].tolist()
