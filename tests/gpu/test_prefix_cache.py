"""PrefixCache on its own: block matching, keys, the byte budget and LRU order.

The KV here is synthetic: one layer of shape (1, 1, L, 1) whose value at position p is p,
so a matched prefix's tensors say exactly which positions they came from. One block of
4 positions then takes 4 (keys) + 4 (values) fp32 = 32 bytes.
"""

from __future__ import annotations

import torch

from openrld.gpu.prefix_cache import PrefixCache

BLOCK = 4
BLOCK_BYTES = 2 * BLOCK * 4


def kv(length: int, offset: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer whose keys at position p hold p + offset and values -(p + offset)."""
    positions = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1) + offset
    return [(positions, -positions)]


def test_match_returns_the_longest_whole_block_prefix_and_its_kv() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    assert cache.insert("v", list(range(10)), kv(10)) == 2  # positions 8, 9 make no whole block
    query = list(range(9)) + [99, 98, 97]  # shares positions 0..8, so blocks 0..3 and 4..7
    hit, layers = cache.match("v", query, limit=len(query) - 1)
    assert hit == 8
    assert layers is not None
    assert layers[0][0].flatten().tolist() == list(range(8))
    assert layers[0][1].flatten().tolist() == [-float(p) for p in range(8)]


def test_match_never_reaches_past_the_limit() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    cache.insert("v", list(range(12)), kv(12))
    # The same 12 tokens again: the last must be computed (limit 11), so only blocks 0..1 serve.
    assert cache.match("v", list(range(12)), limit=11)[0] == 8


def test_a_block_reached_through_another_prefix_never_matches() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    cache.insert("v", [1, 2, 3, 4, 5, 6, 7, 8], kv(8))
    # The second block's tokens match, but after another first block: its KV would be wrong.
    assert cache.match("v", [0, 2, 3, 4, 5, 6, 7, 8, 9], limit=8) == (0, None)


def test_keys_never_share_blocks() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    cache.insert("a", list(range(8)), kv(8))
    assert cache.match("b", list(range(9)), limit=8) == (0, None)
    assert cache.match(None, list(range(9)), limit=8) == (0, None)


def test_drop_frees_only_that_keys_blocks() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    cache.insert("a", list(range(8)), kv(8))
    cache.insert("b", list(range(8)), kv(8))
    assert cache.drop("a") == 2 * BLOCK_BYTES
    assert cache.statistics().bytes_held == 2 * BLOCK_BYTES
    assert cache.match("a", list(range(9)), limit=8)[0] == 0
    assert cache.match("b", list(range(9)), limit=8)[0] == 8


def test_budget_evicts_the_least_recently_used_blocks_tail_first() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES, BLOCK)  # room for 4 blocks
    first, second = list(range(8)), list(range(100, 108))
    cache.insert("v", first, kv(8))
    cache.insert("v", second, kv(8, offset=100.0))
    cache.match("v", first + [0], limit=8)  # `first` is now the most recently used
    cache.insert("v", list(range(200, 204)), kv(4, offset=200.0))  # one more block: one must go
    stats = cache.statistics()
    assert (stats.evictions, stats.blocks_held, stats.bytes_held) == (1, 4, 4 * BLOCK_BYTES)
    assert cache.match("v", first + [0], limit=8)[0] == 8
    assert cache.match("v", second + [0], limit=8)[0] == 4  # its tail went, its head stays


def test_a_chain_longer_than_the_budget_keeps_its_head() -> None:
    cache = PrefixCache(2 * BLOCK_BYTES, BLOCK)
    assert cache.insert("v", list(range(16)), kv(16)) == 2
    assert cache.match("v", list(range(17)), limit=16)[0] == 8


def test_zero_budget_keeps_nothing() -> None:
    cache = PrefixCache(0, BLOCK)
    assert cache.insert("v", list(range(8)), kv(8)) == 0
    assert cache.match("v", list(range(9)), limit=8) == (0, None)
    assert cache.statistics().lookups == 0


def test_statistics_count_lookups_hits_and_hit_tokens() -> None:
    cache = PrefixCache(1 << 20, BLOCK)
    cache.insert("v", list(range(8)), kv(8))
    cache.match("v", list(range(9)), limit=8)
    cache.match("v", [50] * 9, limit=8)
    stats = cache.statistics()
    assert (stats.lookups, stats.hits, stats.hit_tokens, stats.blocks_held) == (2, 1, 8, 2)


def test_a_smaller_budget_evicts_the_least_recently_used_blocks_at_once() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES, BLOCK)
    cache.insert("old", list(range(8)), kv(8))
    cache.insert("new", list(range(8)), kv(8))
    assert cache.resize(2 * BLOCK_BYTES) == 2 * BLOCK_BYTES
    assert cache.match("old", list(range(9)), limit=8) == (0, None)
    assert cache.match("new", list(range(9)), limit=8)[0] == 8
    assert cache.statistics().evictions == 2


def test_a_resize_never_raises_the_budget_past_what_the_cache_was_built_with() -> None:
    cache = PrefixCache(2 * BLOCK_BYTES, BLOCK)
    cache.resize(10 * BLOCK_BYTES)
    assert cache.budget_bytes == 2 * BLOCK_BYTES
    assert PrefixCache(0, BLOCK).resize(BLOCK_BYTES) == 0  # built off: stays off


def test_a_budget_of_zero_turns_caching_off_until_a_larger_resize() -> None:
    cache = PrefixCache(4 * BLOCK_BYTES, BLOCK)
    cache.insert("v", list(range(8)), kv(8))
    assert cache.resize(0) == 0
    assert cache.insert("v", list(range(8)), kv(8)) == 0
    cache.resize(4 * BLOCK_BYTES)
    assert cache.insert("v", list(range(8)), kv(8)) == 2
    assert cache.statistics().bytes_held == 2 * BLOCK_BYTES
