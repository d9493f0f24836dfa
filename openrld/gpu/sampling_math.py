"""The sampling math of the torch sampler: pure functions of logits, and the stop-string watch.

What one decode step does to one request's rows once the model has produced
their logits: q_T (logits/T, then top-k, then top-p, renormalised, as
Tinker's sampler orders them), inverse-CDF draws from
per-sample uniforms, top-k rows with the SDK's sentinel, and the incremental
stop-string check. Nothing here holds a model, a cache or a
request; nothing imports trio.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np
import torch

from openrld.batches import SamplingSpec

TOPK_EMPTY_TOKEN = 0  # the Tinker SDK's sentinel cell: token 0 with logprob -99999.0
TOPK_EMPTY_LOGPROB = -99999.0
# Candidates top-p looks among before sorting a whole row (SmolLM2: 49,152 logits; a full sort of
# 64 rows took ~700 ms on one CPU thread, more than the decode step).
TOP_P_CANDIDATES = 1024


def stream_seed(seed: int, index: int) -> int:
    """The seed of sample `index`'s RNG stream: a 64-bit hash of (seed mod 2^64, index).

    A hash rather than `seed + index`, so that the streams of (seed, 1) and
    (seed + 1, 0) are unrelated.
    """
    key = (seed % 2**64).to_bytes(8, "little") + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def processed_logprobs(logits: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """log q_T for each row: logits/T, then top-k, then top-p, then renormalise (T > 0).

    Args:
        logits: (R, V) float32.
        params: temperature > 0, top_k, top_p.

    Returns:
        (R, V) float32: log q_T, -inf for tokens that top-k or top-p removed.
    """
    assert params.temperature > 0, f"processed_logprobs needs T > 0, got {params.temperature}"
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    limits_k = 0 < params.top_k < vocab
    if not limits_k and params.top_p >= 1.0:
        # Skip the sort so that the default settings give exactly log_softmax(logits/T).
        return torch.log_softmax(scaled, dim=-1)
    if limits_k:
        # Only the k best can survive: top-p and the renormalisation run over them alone.
        # (A full sort of 64 rows of SmolLM2's 49,152 logits took ~700 ms on one CPU thread,
        # more than the decode step; torch.topk ~14 ms.)
        best, ids = best_k(scaled, params.top_k)  # (R, k), in q's order
        if params.top_p < 1.0:
            best = best.masked_fill(~_within_top_p(torch.softmax(best, dim=-1), params.top_p), -math.inf)
        logq = torch.full_like(scaled, -math.inf)
        return logq.scatter_(-1, ids, torch.log_softmax(best, dim=-1))
    # Top-p alone: the tokens it keeps are nearly always among each row's best few hundred, so
    # those are found without sorting the row, and only a row whose best TOP_P_CANDIDATES hold
    # less than top_p of its mass is sorted in full. Either way the order is a stable
    # descending sort's, so ties keep the lowest ids.
    best, ids = best_k(scaled, min(vocab, TOP_P_CANDIDATES))
    probs = torch.exp(best - torch.logsumexp(scaled, dim=-1, keepdim=True))  # the row's q_T of each
    short = probs.sum(-1) < params.top_p
    if bool(short.any()):
        rows = short.nonzero()[:, 0]
        sorted_logits, order = torch.sort(scaled[rows], dim=-1, descending=True, stable=True)
        full = _top_p_logq(sorted_logits, torch.softmax(sorted_logits, dim=-1), params.top_p)
        logq = torch.empty_like(scaled)
        logq[rows] = logq[rows].scatter_(-1, order, full)
        kept = (~short).nonzero()[:, 0]
        best, ids, probs = best[kept], ids[kept], probs[kept]
        logq[kept] = torch.full_like(scaled[kept], -math.inf).scatter_(-1, ids, _top_p_logq(best, probs, params.top_p))
        return logq
    logq = torch.full_like(scaled, -math.inf)
    return logq.scatter_(-1, ids, _top_p_logq(best, probs, params.top_p))


def _top_p_logq(sorted_logits: torch.Tensor, sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """log q over a row's best tokens (sorted descending, with their probabilities in the row):
    top-p's kept ones renormalised, -inf for the rest."""
    keep = _within_top_p(sorted_probs, top_p)
    return torch.log_softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)


def _within_top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of each row's tokens (probabilities sorted descending) top-p keeps: token j iff the
    mass strictly before it is < top_p, the smallest set reaching top_p, and always the first
    token (top_p > 0)."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return mass_before < top_p


def best_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries and their ids, by value descending and ties by id ascending:
    the first k columns of a stable descending sort, without sorting the whole row.

    `torch.topk` orders ties arbitrarily and, when a tie straddles the k-th place, may keep any
    of the tied ids; the k it returns are put in order here, and the rare rows with such a
    straddling finite tie are sorted in full. Entries at -inf come last, in no set order.

    Args:
        x: (R, V) float.

    Returns:
        (values (R, k), ids (R, k) int64).
    """
    if k >= x.shape[-1]:
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[:, :k], ids[:, :k]
    values, ids = torch.topk(x, k, dim=-1)
    by_id = torch.argsort(ids, dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(-1, by_value), ids.gather(-1, by_value)
    last = values[:, -1:]
    straddles = ((x == last).sum(-1) > (values == last).sum(-1)) & torch.isfinite(last[:, 0])
    if bool(straddles.any()):
        rows = straddles.nonzero()[:, 0]
        full_values, full_ids = torch.sort(x[rows], dim=-1, descending=True, stable=True)
        values[rows], ids[rows] = full_values[:, :k], full_ids[:, :k]
    return values, ids


def draw_from(logq: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: for each row r, the tokens whose CDF interval holds uniforms[r].

    One uniform per draw (rather than torch.multinomial) keeps each sample's
    randomness in its own CPU generator while the arithmetic stays on the device.

    Args:
        logq: (R, V) float32 log-probabilities, -inf outside the support.
        uniforms: (R, M) float64 in [0, 1).

    Returns:
        (R, M) int64 token ids, each with q > 0.
    """
    probs = logq.double().exp()  # (R, V)
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms.to(cdf.device) * cdf[:, -1:]
    # right=True gives the first token whose CDF exceeds the target; that token has q > 0.
    tokens = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[-1] - 1)
    off_support = probs.gather(-1, tokens) == 0
    if bool(off_support.any()):
        # Only when rounding made target == total: take the last token of the support.
        last = probs.shape[-1] - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1, keepdim=True)
        tokens = torch.where(off_support, last.expand_as(tokens), tokens)
    return tokens


def top_k_rows(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best entries of each row, by logprob descending, ties by id ascending.

    Entries at -inf (outside q's support) become the sentinel (token 0, -99999.0).

    Returns:
        (token_ids int32 (R, k), logprobs float32 (R, k)).
    """
    assert 0 < k <= logp.shape[-1], f"k={k} must be in [1, {logp.shape[-1]}]"
    values, ids = best_k(logp, k)
    values, ids = values.float().cpu().numpy(), ids.to(torch.int32).cpu().numpy()
    empty = np.isneginf(values)
    ids[empty] = TOPK_EMPTY_TOKEN
    values[empty] = TOPK_EMPTY_LOGPROB
    return ids, values


def empty_topk(rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((rows, k), TOPK_EMPTY_TOKEN, np.int32), np.full((rows, k), TOPK_EMPTY_LOGPROB, np.float32)


class StopStringWatch:
    """Watches one sample's generated text for stop strings, one token at a time.

    The text is decoded incrementally: each step decodes only the tokens since
    the last complete character, and a tail of `longest - 1` characters is kept
    so that a match spanning earlier tokens is still seen. Text that ends in an
    incomplete character (U+FFFD) is checked as decoded but not committed until
    the character completes, which is what decoding all generated tokens gives.
    """

    def __init__(self, stop_strings: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self._stop_strings = stop_strings
        self._decode = decode
        self._keep_chars = max(len(s) for s in stop_strings) - 1
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens before this are fully reflected in _tail
        self._read_offset = 0  # tokens in [prefix, read) were committed last
        self._tail = ""

    def push(self, token: int) -> bool:
        """Add a generated token; True when the generated text now contains a stop string."""
        self._tokens.append(token)
        committed = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        current = self._decode(self._tokens[self._prefix_offset :])
        pending = current[len(committed) :]
        window = self._tail + pending
        if any(s in window for s in self._stop_strings):
            return True
        if pending and not pending.endswith("\ufffd"):
            self._tail = window[-self._keep_chars :] if self._keep_chars else ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return False
