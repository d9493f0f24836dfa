"""The torch sampler at long context: chunked prefill, windowed prefill, bounded KV, the context limit.

A long prompt is prefilled in chunks whose attention mask and logits fit a byte budget
(`prefill_chunks.chunk_spans`); whatever the chunks, a request samples the same tokens,
and its logprobs and prompt logprobs agree within fp32 rounding (1e-5), in every family
of `tiny_models.FAMILIES` (sliding windows of 8, linear-attention state, shared KV, MoE).
Tests force tiny chunks so that 45-token prompts cross many of them. Sliding-window
models prefill long prompts windowed: the same results, less KV, no prefix-cache entry.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from openrld.batches import SampleJob, SampleResult, SamplingSpec
from openrld.errors import BadRequest
from openrld.gpu import models
from openrld.gpu.kv_batch import KvBatch, prefill_cache
from openrld.gpu.prefill_chunks import chunk_spans
from openrld.gpu.tiny_models import FAMILIES, SLIDING_WINDOW, build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler

CPU = torch.device("cpu")
WINDOWED_FAMILIES = ("gemma3", "gemma4")  # sliding layers beside full ones


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_model(tmp_path_factory.mktemp("long") / arch, arch, seed=3)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("long") / "gemma3", "gemma3", seed=3)


def prompt_of(length: int, offset: int = 1) -> list[int]:
    return [(7 * i + offset) % 300 + 3 for i in range(length)]


def long_job(prompt: list[int], max_tokens: int = 12, **kwargs) -> SampleJob:
    params = SamplingSpec(max_tokens=max_tokens, seed=17, stop_at_eos=False)
    return SampleJob(prompt=np.asarray(prompt, dtype=np.int64), num_samples=2, params=params, **kwargs)


def assert_same_result(got: SampleResult, expected: SampleResult, label: str) -> None:
    if expected.prompt_logprobs is not None:
        assert np.isnan(got.prompt_logprobs[0]), label
        np.testing.assert_allclose(got.prompt_logprobs, expected.prompt_logprobs, rtol=0, atol=1e-5, err_msg=label)
    for seq, want in zip(got.sequences, expected.sequences, strict=True):
        np.testing.assert_array_equal(seq.tokens, want.tokens, err_msg=label)
        np.testing.assert_allclose(seq.logprobs, want.logprobs, rtol=0, atol=1e-5, err_msg=label)


# ---------------------------------------------------------------------------
# Chunk spans: pure arithmetic


def test_chunks_shrink_as_the_mask_over_cached_positions_grows() -> None:
    # 5 bytes a query per key column, 1,000 bytes a chunk: at most 200 // (columns it reaches).
    spans = list(chunk_spans(0, 40, cap_tokens=16, budget_bytes=1000, key_bytes=5, logit_bytes=0, first_scored=40))
    # [0, 16) reaches 16 columns: 200 // 16 = 12; [12, 28): 200 // 28 = 7; [19, 35): 5; [24, 40): 5; ...
    assert spans == [(0, 12), (12, 19), (19, 24), (24, 29), (29, 34), (34, 39), (39, 40)]


def test_chunks_that_score_their_positions_count_the_logits_too() -> None:
    spans = list(chunk_spans(0, 20, cap_tokens=10, budget_bytes=300, key_bytes=1, logit_bytes=20, first_scored=0))
    # per query: the columns reached plus 20 bytes of logits; [0, 10): 300 // 30 = 10; [10, 20): 300 // 40 = 7.
    assert spans == [(0, 10), (10, 17), (17, 20)]


def test_chunks_start_after_the_cached_prefix_and_stop_at_the_cap() -> None:
    spans = list(chunk_spans(32, 45, cap_tokens=5, budget_bytes=2**30, key_bytes=5, logit_bytes=0, first_scored=45))
    assert spans == [(32, 37), (37, 42), (42, 45)]


def test_a_budget_too_small_for_one_position_still_advances_one_at_a_time() -> None:
    spans = list(chunk_spans(0, 3, cap_tokens=8, budget_bytes=1, key_bytes=5, logit_bytes=100, first_scored=0))
    assert spans == [(0, 1), (1, 2), (2, 3)]


# ---------------------------------------------------------------------------
# Chunked prefill: the same results in every family


def test_a_prompt_prefilled_in_chunks_of_five_samples_and_scores_as_in_one_chunk(family: tuple[str, Path]) -> None:
    arch, directory = family
    request = long_job(prompt_of(45), prompt_logprobs=True)
    whole = TorchSampler(directory, CPU, prefill_chunk_tokens=1024).sample(None, request)
    chunked = TorchSampler(directory, CPU, prefill_chunk_tokens=5).sample(None, request)
    assert_same_result(chunked, whole, arch)


def test_a_prompt_prefilled_one_position_at_a_time_by_a_tiny_budget_samples_as_in_one_chunk(
    family: tuple[str, Path],
) -> None:
    arch, directory = family
    request = long_job(prompt_of(45, offset=2), prompt_logprobs=True)
    whole = TorchSampler(directory, CPU, prefill_chunk_tokens=1024).sample(None, request)
    starved = TorchSampler(directory, CPU, prefill_budget_bytes=1)
    assert_same_result(starved.sample(None, request), whole, arch)
    assert starved.statistics().prompt_tokens_prefilled == 45


def test_a_prompt_after_a_cached_prefix_prefills_the_rest_in_chunks_as_in_one(family: tuple[str, Path]) -> None:
    arch, directory = family
    prompt = prompt_of(45, offset=3)
    chunked = TorchSampler(directory, CPU, prefill_chunk_tokens=5)
    chunked.sample(None, long_job(prompt[:32]))  # caches blocks 0-31 (unless linear layers keep it off)
    again = chunked.sample(None, long_job(prompt))
    whole = TorchSampler(directory, CPU, prefill_chunk_tokens=1024, prefix_cache_bytes=0).sample(None, long_job(prompt))
    assert_same_result(again, whole, arch)


# ---------------------------------------------------------------------------
# Windowed prefill of sliding-window models


def test_a_windowed_prefill_keeps_each_sliding_layers_window_and_every_position_of_full_ones(
    gemma3_dir: Path,
) -> None:
    model = models.load_causal_lm(gemma3_dir, CPU)
    cache = prefill_cache(model.config, windowed=True)
    ids = torch.as_tensor(prompt_of(40), dtype=torch.int64)[None]
    with torch.inference_mode():
        for start in range(0, 40, 6):
            model(input_ids=ids[:, start : start + 6], cache=cache, use_cache=True)
    # layer_types: sliding, sliding, sliding, full
    assert [layer.keys.shape[2] for layer in cache.layers] == [SLIDING_WINDOW - 1] * 3 + [40]


@pytest.mark.parametrize("arch", WINDOWED_FAMILIES)
def test_a_prompt_past_the_windowed_bound_samples_as_a_full_prefill_and_skips_the_prefix_cache(
    arch: str, tmp_path: Path
) -> None:
    directory = build_tiny_model(tmp_path / arch, arch, seed=3)
    request = long_job(prompt_of(45, offset=4), prompt_logprobs=True)
    full = TorchSampler(directory, CPU, prefill_chunk_tokens=5)
    windowed = TorchSampler(directory, CPU, prefill_chunk_tokens=5, windowed_prefill_tokens=44)
    assert_same_result(windowed.sample(None, request), full.sample(None, request), arch)
    assert full.statistics().prefix_cache.blocks_held == 2  # 45 positions: 2 blocks of 16
    assert windowed.statistics().prefix_cache.blocks_held == 0


@pytest.mark.parametrize("arch", WINDOWED_FAMILIES)
def test_a_windowed_prefill_takes_a_cached_prefix_and_samples_as_a_full_prefill(arch: str, tmp_path: Path) -> None:
    directory = build_tiny_model(tmp_path / arch, arch, seed=3)
    prompt = prompt_of(45, offset=5)
    windowed = TorchSampler(directory, CPU, prefill_chunk_tokens=5, windowed_prefill_tokens=44)
    windowed.sample(None, long_job(prompt[:33]))  # within the bound: its 2 blocks are cached
    again = windowed.sample(None, long_job(prompt))
    whole = TorchSampler(directory, CPU, prefix_cache_bytes=0).sample(None, long_job(prompt))
    assert windowed.statistics().prefix_cache.hit_tokens == 32
    assert_same_result(again, whole, arch)


# ---------------------------------------------------------------------------
# The running batch's KV, the context


def test_a_decode_append_makes_room_for_a_quarter_more_columns_not_a_doubling() -> None:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=32,
    )
    row = [(torch.ones(1, 1, 1000, 8), torch.ones(1, 1, 1000, 8)) for _ in range(2)]
    batch = KvBatch(config, CPU)
    batch.join([(row, 1)])
    for layer in range(2):
        batch.append(layer, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    batch.advance()
    # 2 layers x (keys, values) x 1,250 columns x 1 head x 8 floats of 4 bytes
    assert batch.nbytes() == 2 * 2 * 1250 * 8 * 4


def test_a_prompt_as_long_as_the_context_is_refused_naming_the_context(family: tuple[str, Path]) -> None:
    _arch, directory = family
    sampler = TorchSampler(directory, CPU)
    with pytest.raises(BadRequest, match=r"prompt: expected fewer than the model's context of 1024 tokens, got '1024 tokens'"):
        sampler.add("long", None, long_job(prompt_of(1024)))


def test_max_tokens_past_the_context_ends_each_sample_at_the_context_with_length(family: tuple[str, Path]) -> None:
    arch, directory = family
    result = TorchSampler(directory, CPU).sample(None, long_job(prompt_of(1020), max_tokens=10))
    for seq in result.sequences:
        assert len(seq.tokens) == 4 and seq.stop_reason == "length", arch
