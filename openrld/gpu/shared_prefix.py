"""Shared-prefix training: a group of datums that begin with the same tokens runs them once.

In GRPO-style RL requests, a group of G datums (often 8) holds one prompt (often 150-400
tokens) and G sampled completions (often 20-60 tokens). Run whole, each datum pays for the
prompt's forward and backward again; here the prompt runs once.

What it owns:
- grouping (`find_prefix_groups`): which datums share a prefix, and how long a one, chosen
  to save the most prefix tokens; a pure function of the token arrays;
- packing groups into micro-batches by their padded cost, prefixes + suffixes
  (`shared_cost`, `pack_groups`);
- the two-pass forward (`two_pass_features`): the groups' prefixes as one right-padded
  batch with Hugging Face's cache, the cache's rows selected for the datums
  (`Cache.batch_select_indices`), then the datums' suffixes as one right-padded batch that
  attends to their prefix's keys and values (position ids continue from the prefix length;
  the mask covers prefix and suffix), so that backward flows through each suffix into its
  prefix, which it reaches once;
- whether a model can take that path (`cache_supports_sharing`).

Guarantee: features, log-probabilities, losses and gradients equal those of running every
datum whole, within the rounding of the model's dtype (the same positions see the same keys
and values; only the reduction order of attention and of the gradient sums differs).

Why by hand: no library trains a shared prefix once for a group of completions. Hugging Face
reuses a prefix's cache for generation (no grad), and training libraries pack or pad whole
sequences; backpropagating through a cache repeated to a batch is this module's.

What it does not do: log-probabilities, losses or backward (`gpu/scoring.py` drives those),
or any cache but one growing DynamicLayer per layer. Those models take the unshared path,
with the same results: sliding-window layers (Gemma 3 and 4, a Mistral or Phi-3 with a
window) keep only the window of the prefix, Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE)
keep a recurrent state whose rows the cache cannot select, and Gemma 4's KV-shared layers
read another layer's cache. Dense and MoE models with full attention everywhere (Llama,
Qwen2/3, Mistral, OLMo 2, Phi-3, Qwen3-MoE) share (tests/gpu/test_trainer_families.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

# The most datums one group may hold: bounds the grouping's search at n x MAX_GROUP_SIZE steps.
# A larger set sharing a prefix becomes several groups, each running the prefix once; a group
# this large (256 suffixes of 60 tokens ~ 15k tokens) would be split by the budget anyway.
MAX_GROUP_SIZE = 256

# (input_ids (B, T), attention_mask (B, kv) or None, position_ids (B, T) or None, cache) -> (B, T, F)
Forward = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None, Cache], torch.Tensor]


class PrefixGroup(msgspec.Struct, frozen=True):
    """Datums that run their first `prefix_len` tokens once, together."""

    members: tuple[int, ...]  # indices into the caller's datum list, ascending; at least 2
    prefix_len: int  # tokens every member shares; shorter than each member, so each has a suffix


class SharedPrefixes(msgspec.Struct, frozen=True):
    """How one micro-batch's datums (in the caller's order) find their prefix."""

    rows: tuple[int, ...]  # per datum: its prefix's row in the prefix batch
    lengths: tuple[int, ...]  # per prefix row: its length in tokens


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def find_prefix_groups(tokens: Sequence[np.ndarray], min_shared_prefix: int) -> list[PrefixGroup]:
    """The groups that save the most prefix tokens; datums in no group run whole.

    Datums sorted by their tokens put every set that shares a prefix next to each other, so
    the groups are runs of that order; a run of k datums sharing p tokens saves (k - 1) × p
    tokens, and a dynamic programme over the order picks the runs whose savings sum highest.
    A run shares at least `min_shared_prefix` tokens (0 turns grouping off), holds at most
    MAX_GROUP_SIZE datums, and its prefix stops one token short of its shortest datum, so
    that every member has a suffix.

    Returns:
        The groups, in the order of their first member; each member in at most one.
    """
    n = len(tokens)
    if min_shared_prefix < 1 or n < 2:
        return []
    # Bytes of the int64 ids order sequences token by token (by each token's bytes), and a
    # sequence before any it is a prefix of: sets sharing a prefix are runs of this order.
    order = sorted(range(n), key=lambda i: np.asarray(tokens[i], np.int64).tobytes())
    adjacent = [common_prefix_len(np.asarray(tokens[a]), np.asarray(tokens[b])) for a, b in itertools.pairwise(order)]
    # best[end]: the most tokens saved over order[:end]; begin[end], shared[end]: its last run.
    best, begin, shared = [0] * (n + 1), list(range(-1, n)), [0] * (n + 1)
    for end in range(1, n + 1):
        best[end] = best[end - 1]  # order[end - 1] alone
        prefix = len(tokens[order[end - 1]]) - 1
        for start in range(end - 2, max(end - MAX_GROUP_SIZE, 0) - 1, -1):
            prefix = min(prefix, adjacent[start], len(tokens[order[start]]) - 1)
            if prefix < min_shared_prefix:
                break  # a longer run shares no more
            saved = best[start] + (end - start - 1) * prefix
            if saved > best[end]:
                best[end], begin[end], shared[end] = saved, start, prefix
    groups = []
    end = n
    while end > 0:
        start = begin[end]
        if end - start >= 2:
            groups.append(PrefixGroup(tuple(sorted(order[start:end])), shared[end]))
        end = start
    return sorted(groups, key=lambda group: group.members[0])


def shared_cost(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> int:
    """Padded tokens of running `groups` as one micro-batch: K prefixes padded to the longest,
    plus all their members' suffixes padded to the longest."""
    longest_prefix = max(group.prefix_len for group in groups)
    longest_suffix = max(lengths[i] - group.prefix_len for group in groups for i in group.members)
    return len(groups) * longest_prefix + sum(len(group.members) for group in groups) * longest_suffix


def pack_groups(
    groups: Sequence[PrefixGroup], lengths: Sequence[int], max_batch_tokens: int
) -> list[list[PrefixGroup]]:
    """Groups into micro-batches whose `shared_cost` stays within `max_batch_tokens`.

    Longest suffix first (then longest prefix), so that similar groups share a micro-batch and
    padding stays small; a group over the budget on its own gets a micro-batch of its own
    (the caller splits those first). Every group appears exactly once.
    """

    def longest_suffix(group: PrefixGroup) -> int:
        return max(lengths[i] for i in group.members) - group.prefix_len

    order = sorted(groups, key=lambda group: (-longest_suffix(group), -group.prefix_len, group.members[0]))
    packs: list[list[PrefixGroup]] = []
    for group in order:
        if packs and shared_cost(packs[-1] + [group], lengths) <= max_batch_tokens:
            packs[-1].append(group)
        else:
            packs.append([group])
    return packs


def cache_supports_sharing(config: object) -> bool:
    """Whether `config`'s model keeps a plain growing cache whose rows can be selected: a
    sliding window (or any other layer kind) keeps only part of the prefix, so no."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    cache = DynamicCache(config=config)
    return hasattr(cache, "batch_select_indices") and all(type(layer) is DynamicLayer for layer in cache.layers)


def two_pass_features(
    forward: Forward, config: object, tokens: Sequence[np.ndarray], shared: SharedPrefixes, device: torch.device
) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Features of every real position of `tokens`, each shared prefix run once.

    Args:
        forward: the model (or its decoder) on one padded batch with a cache; returns (B, T, F).
        config: the model's config, for its cache.
        tokens: the datums, each starting with its prefix (`shared.rows`, `shared.lengths`).
    Returns:
        rows: (P, F), the prefix rows (each prefix once, row by row) then the suffix rows
            (datum by datum); positions: per datum, the row of each of its positions.
    """
    prefix_tokens: list[np.ndarray] = [np.empty(0, np.int64)] * len(shared.lengths)
    for datum, row in enumerate(shared.rows):
        prefix_tokens[row] = np.asarray(tokens[datum][: shared.lengths[row]])
    prefix_ids, prefix_mask = _right_padded(prefix_tokens, device)
    cache = DynamicCache(config=config)
    # Without padding, no mask: attention then takes its plain causal path, which is faster.
    equal = min(shared.lengths) == max(shared.lengths)
    prefix_features = forward(prefix_ids, None if equal else prefix_mask, None, cache)  # (K, Lmax, F)

    suffixes = [np.asarray(t[shared.lengths[row] :]) for t, row in zip(tokens, shared.rows)]
    suffix_ids, suffix_mask = _right_padded(suffixes, device)
    index = torch.tensor(shared.rows, device=device)
    cache.batch_select_indices(index)  # (B, heads, Lmax, D) per layer: each datum its prefix's keys and values
    mask = torch.cat([prefix_mask[index], suffix_mask], dim=1)  # (B, Lmax + Smax): prefix holes and padding off
    starts = torch.tensor([shared.lengths[row] for row in shared.rows], device=device)
    positions = starts[:, None] + torch.arange(suffix_ids.shape[1], device=device)  # (B, Smax)
    suffix_features = forward(suffix_ids, mask, positions, cache)  # (B, Smax, F)

    rows = torch.cat([prefix_features[prefix_mask.bool()], suffix_features[suffix_mask.bool()]])
    prefix_offsets = np.cumsum([0, *shared.lengths])
    suffix_offsets = prefix_offsets[-1] + np.cumsum([0, *(len(s) for s in suffixes)])
    positions_rows = [
        np.concatenate(
            [
                prefix_offsets[row] + np.arange(shared.lengths[row]),
                suffix_offsets[datum] + np.arange(len(suffixes[datum])),
            ]
        )
        for datum, row in enumerate(shared.rows)
    ]
    return rows, positions_rows


def _right_padded(sequences: Sequence[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, longest) int64 on `device`."""
    ids = np.zeros((len(sequences), max(len(s) for s in sequences)), np.int64)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
