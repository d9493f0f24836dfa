"""KvBatch: rows of different lengths, left-padded to one width.

The caches are synthetic (random keys and values, two layers), so every
assertion is on exact values: joining only pads and copies.
"""

from __future__ import annotations

import torch
import transformers

from openrld.gpu.kv_batch import KvBatch, KvLayers

CPU = torch.device("cpu")
CONFIG = transformers.LlamaConfig(
    hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=32,
)


def prefill(length: int, seed: int) -> KvLayers:
    """A batch-1 cache of `length` positions: per layer (keys, values), (1, 1, length, 8)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 1, length, 8, generator=generator), torch.randn(1, 1, length, 8, generator=generator))
            for _ in range(2)]


def layers_of(batch: KvBatch) -> KvLayers:
    return [(layer.keys, layer.values) for layer in batch.cache.layers]


def test_rows_joined_in_one_call_equal_rows_joined_one_by_one() -> None:
    running, short, long = prefill(3, seed=1), prefill(2, seed=2), prefill(5, seed=3)
    together, one_by_one = KvBatch(CONFIG, CPU), KvBatch(CONFIG, CPU)
    together.join([(running, 1)])
    together.join([(short, 2), (long, 1)])
    for layers, copies in ((running, 1), (short, 2), (long, 1)):
        one_by_one.join([(layers, copies)])
    assert together.lengths == one_by_one.lengths == [3, 2, 2, 5]
    for (keys, values), (expected_keys, expected_values) in zip(layers_of(together), layers_of(one_by_one)):
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_a_joined_row_is_its_prefill_right_aligned_behind_zeros() -> None:
    short, long = prefill(2, seed=2), prefill(5, seed=3)
    batch = KvBatch(CONFIG, CPU)
    batch.join([(short, 2), (long, 1)])
    keys = batch.cache.layers[1].keys  # (3, 1, 5, 8)
    assert keys.shape == (3, 1, 5, 8)
    for row in (0, 1):
        assert torch.equal(keys[row, :, 3:], short[1][0][0]) and not keys[row, :, :3].any()
    assert torch.equal(keys[2], long[1][0][0])


def test_joined_rows_never_alias_the_prefill_cache() -> None:
    cache = prefill(4, seed=4)
    batch = KvBatch(CONFIG, CPU)
    batch.join([(cache, 2)])
    cache[0][0].zero_()
    assert batch.cache.layers[0].keys.abs().sum() > 0


def decode_one(batch: KvBatch) -> None:
    """One decode step's appends (a column of ones in every row), as the fused forward makes them."""
    for layer in range(2):
        batch.append(layer, torch.ones(batch.rows, 1, 1, 8), torch.ones(batch.rows, 1, 1, 8))
    batch.advance()


def test_a_join_leaves_the_joined_rows_alone_in_memory() -> None:
    batch = KvBatch(CONFIG, CPU)
    batch.join([(prefill(5, seed=7), 1)])
    decode_one(batch)  # the appends keep spare room behind the row's 6 positions
    batch.join([(prefill(2, seed=8), 1)])
    assert batch.nbytes() == 2 * 2 * 2 * 6 * 8 * 4  # layers x (keys, values) x rows x width x head dim x fp32


def test_rows_that_leave_take_their_room_with_them() -> None:
    batch = KvBatch(CONFIG, CPU)
    batch.join([(prefill(5, seed=5), 2), (prefill(3, seed=6), 1)])
    decode_one(batch)
    batch.keep([2])
    assert batch.lengths == [4]
    assert batch.nbytes() == 2 * 2 * 1 * 4 * 8 * 4  # the kept row alone, trimmed to its 4 positions
    assert torch.equal(batch.cache.layers[0].keys[0, :, :3], prefill(3, seed=6)[0][0][0])
    assert torch.equal(batch.cache.layers[0].keys[0, :, 3], torch.ones(1, 8))
