"""TorchSampler's cross-request prefix cache, on the tiny Llama on the CPU.

Blocks are 16 positions (the default), so the hit counts below are whole multiples of 16,
derived in each test. The reference for exactness is the same engine with the cache off
(`prefix_cache_bytes=0`): tokens must be equal, and logprobs within 1e-5 (fp32), because a
cached prefix's KV was computed in a forward of another shape (another chunk, another batch)
and only the matmul blocking differs (observed 0 to ~5e-7).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import LoraSpec, SampleJob, SamplingSpec
from openrld.gpu import torch_sampler
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler
from tests.gpu.test_sampler_scheduling import assert_same_samples, run_until_idle
from tests.gpu.test_torch_sampler import make_lora

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4)
BLOCK = 16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("prefix") / "llama", "llama")


def tokens(count: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 370, count).tolist()


def job(prompt: list[int], n: int = 1, **params) -> SampleJob:
    scoring = {k: params.pop(k) for k in list(params) if k.startswith("prompt_logprobs")}
    params = {"max_tokens": 8, "seed": 5, "stop_at_eos": False} | params
    return SampleJob(prompt=np.asarray(prompt, dtype=np.int64), num_samples=n, params=SamplingSpec(**params), **scoring)




def test_a_prompt_sharing_a_cached_prefix_reuses_its_whole_blocks(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    shared = tokens(40, seed=1)
    engine.sample(None, job(shared + tokens(10, seed=2)))  # caches blocks 0..15, 16..31, 32..47
    second = engine.sample(None, job(shared + tokens(10, seed=3)))
    # The two prompts agree on positions 0..39: blocks 0..15 and 16..31 are whole, 32..47 is not.
    assert second.prompt_cache_hit_tokens == 32
    stats = engine.statistics()
    assert stats.prompt_tokens_prefilled == 50 + (50 - 32)
    assert (stats.prefix_cache.lookups, stats.prefix_cache.hits, stats.prefix_cache.hit_tokens) == (2, 1, 32)


def test_the_same_prompt_again_computes_only_its_last_block(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    prompt = tokens(48, seed=4)
    engine.sample(None, job(prompt))
    # 48 positions are 3 whole blocks, but position 47's logits draw the first token, so it
    # is computed: the cache serves blocks 0..15 and 16..31.
    assert engine.sample(None, job(prompt)).prompt_cache_hit_tokens == 32


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hugging-face"])
def test_cached_and_uncached_prefixes_sample_the_same_tokens(llama_dir: Path, fused: bool) -> None:
    cached = TorchSampler(llama_dir, CPU, fused_forward=fused)
    uncached = TorchSampler(llama_dir, CPU, fused_forward=fused, prefix_cache_bytes=0)
    shared = tokens(70, seed=5)
    jobs = [job(shared + tokens(9, seed=6 + i), n=2, seed=i, max_tokens=12) for i in range(3)]
    for engine in (cached, uncached):
        engine.sample(None, jobs[0])
    for engine in (cached, uncached):
        for i, j in enumerate(jobs):
            engine.add(f"r{i}", None, j)
    got, expected = run_until_idle(cached), run_until_idle(uncached)
    for rid in expected:
        assert_same_samples(got[rid], expected[rid])
    assert cached.statistics().prefix_cache.hit_tokens == 3 * 64  # positions 0..63 of 70 shared, each time
    assert uncached.statistics().prefix_cache.hits == 0


def test_prompts_admitted_together_compute_their_shared_blocks_once(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    shared = tokens(40, seed=7)
    prompts = [shared + tokens(8, seed=8 + i) for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", None, job(prompt, n=8))
    results = run_until_idle(engine)
    # The first prompt computes all 48 positions and caches blocks 0..31 of the shared 40; the
    # other three (second wave) reuse those 32 and compute 16 each.
    assert engine.statistics().prompt_tokens_prefilled == 48 + 3 * 16
    assert engine.statistics().prefix_cache.hit_tokens == 3 * 32
    assert [results[f"r{i}"].prompt_cache_hit_tokens for i in range(4)] == [48] * 4  # n = 8: the whole prompt


def test_the_next_turn_of_an_episode_reuses_the_last_prompt_and_its_completion(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    first_prompt = tokens(30, seed=9)
    first = engine.sample(None, job(first_prompt, max_tokens=20))
    completion = first.sequences[0].tokens.tolist()
    assert len(completion) == 20
    second_prompt = first_prompt + completion + tokens(6, seed=10)
    second = engine.sample(None, job(second_prompt))
    # The finished row cached 30 + 19 positions (its last token was never fed): 3 whole blocks.
    assert second.prompt_cache_hit_tokens == 48
    reference = TorchSampler(llama_dir, CPU, prefix_cache_bytes=0).sample(None, job(second_prompt))
    assert_same_samples(second, reference)


def held_bytes(engine: TorchSampler) -> int:
    return engine.statistics().prefix_cache.bytes_held


def test_single_turn_samples_stop_keeping_their_completions_after_the_trial(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_sampler, "COMPLETION_TRIAL_ROWS", 4)
    engine = TorchSampler(llama_dir, CPU)
    # 30 + 19 positions a finished sample: its prompt's block, and 2 blocks that hold its completion.
    engine.sample(None, job(tokens(30, seed=20), n=4, max_tokens=20))  # the trial: all 4 keep theirs
    assert held_bytes(engine) == (1 + 4 * 2) * BLOCK * 512
    before = held_bytes(engine)
    engine.sample(None, job(tokens(30, seed=21), n=16, max_tokens=20))  # no prompt reached into one
    assert held_bytes(engine) - before == (1 + 1 * 2) * BLOCK * 512  # one sample in 16 keeps its completion


def test_a_next_turn_after_the_trial_turns_keeping_completions_back_on(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_sampler, "COMPLETION_TRIAL_ROWS", 1)
    engine = TorchSampler(llama_dir, CPU)
    first_prompt = tokens(30, seed=9)
    completion = engine.sample(None, job(first_prompt, max_tokens=20)).sequences[0].tokens.tolist()
    second = engine.sample(None, job(first_prompt + completion + tokens(6, seed=10)))
    assert second.prompt_cache_hit_tokens == 48  # into the first turn's completion
    before = held_bytes(engine)
    engine.sample(None, job(tokens(30, seed=22), n=4, max_tokens=20))
    assert held_bytes(engine) - before == (1 + 4 * 2) * BLOCK * 512  # every sample keeps its completion again


def test_a_version_never_reuses_another_versions_prefixes(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    engine.load_version("a", make_lora(llama_dir, SPEC, seed=1)[1], SPEC)
    engine.load_version("b", make_lora(llama_dir, SPEC, seed=2)[1], SPEC)
    prompt = tokens(40, seed=11)
    engine.sample("a", job(prompt))
    assert engine.sample("b", job(prompt)).prompt_cache_hit_tokens == 0
    assert engine.sample(None, job(prompt)).prompt_cache_hit_tokens == 0
    assert engine.sample("a", job(prompt)).prompt_cache_hit_tokens == 32


def test_dropping_a_version_drops_its_prefixes(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    engine.load_version("a", make_lora(llama_dir, SPEC, seed=1)[1], SPEC)
    prompt = tokens(40, seed=12)
    engine.sample(None, job(prompt))
    base_bytes = engine.statistics().prefix_cache.bytes_held
    engine.sample("a", job(prompt))
    assert engine.statistics().prefix_cache.bytes_held == 2 * base_bytes  # the same 2 blocks, under each key
    engine.drop_version("a")
    assert engine.statistics().prefix_cache.bytes_held == base_bytes
    engine.load_version("a", make_lora(llama_dir, SPEC, seed=3)[1], SPEC)  # the name again, other weights
    assert engine.sample("a", job(prompt)).prompt_cache_hit_tokens == 0


def test_the_budget_evicts_the_least_recently_used_prefix(llama_dir: Path) -> None:
    # The tiny Llama's KV: 2 layers x (keys + values) x 2 heads x 16 dims x 4 bytes = 512 bytes
    # a position, 8 KiB a block. Room for 4 blocks: two prompts of 2 blocks each.
    engine = TorchSampler(llama_dir, CPU, prefix_cache_bytes=4 * BLOCK * 512)
    old, recent, new = tokens(33, seed=13), tokens(33, seed=14), tokens(33, seed=15)
    for prompt in (old, recent):
        engine.sample(None, job(prompt, max_tokens=1))
    engine.sample(None, job(old, max_tokens=1))  # `old` becomes the most recently used
    engine.sample(None, job(new, max_tokens=1))  # needs 2 blocks: `recent`'s go
    assert engine.statistics().prefix_cache.evictions == 2
    assert engine.sample(None, job(old, max_tokens=1)).prompt_cache_hit_tokens == 32
    assert engine.sample(None, job(recent, max_tokens=1)).prompt_cache_hit_tokens == 0


def test_parking_drops_the_prefix_cache(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    prompt = tokens(40, seed=16)
    engine.sample(None, job(prompt, max_tokens=1))
    held = engine.statistics().prefix_cache.bytes_held
    assert held == 2 * BLOCK * 512
    report = engine.park()
    assert report.cache_bytes_dropped >= held
    assert engine.statistics().prefix_cache.bytes_held == 0
    engine.resume()
    assert engine.sample(None, job(prompt, max_tokens=1)).prompt_cache_hit_tokens == 0


def test_scored_prompt_positions_are_computed_not_served(llama_dir: Path) -> None:
    engine = TorchSampler(llama_dir, CPU)
    prompt = tokens(40, seed=17)
    engine.sample(None, job(prompt, max_tokens=1))
    # Every position is scored: its logits are needed from position 0, so nothing is reused.
    assert engine.sample(None, job(prompt, max_tokens=1, prompt_logprobs=True)).prompt_cache_hit_tokens == 0
    # Scoring the last 20 needs logits from position 19: only block 0..15 may come from the cache.
    last_20 = engine.sample(None, job(prompt, max_tokens=1, prompt_logprobs=True, prompt_logprobs_last_n=20))
    assert last_20.prompt_cache_hit_tokens == 16
    reference = TorchSampler(llama_dir, CPU, prefix_cache_bytes=0).sample(
        None, job(prompt, max_tokens=1, prompt_logprobs=True, prompt_logprobs_last_n=20)
    )
    assert last_20.prompt_logprobs is not None and reference.prompt_logprobs is not None
    np.testing.assert_allclose(last_20.prompt_logprobs, reference.prompt_logprobs, rtol=0, atol=1e-5)


def test_full_sampler_never_serves_prefixes_of_replaced_weights(llama_dir: Path) -> None:
    engine = FullSampler(llama_dir, CPU)
    prompt = tokens(40, seed=18)
    engine.sample(None, job(prompt))
    changed = {key: weight * 1.5 for key, weight in engine.live_weights().items()}
    engine.load_version("v1", changed)
    got = engine.sample("v1", job(prompt))
    assert got.prompt_cache_hit_tokens == 0
    reference = FullSampler(llama_dir, CPU, prefix_cache_bytes=0)
    reference.load_version("v1", changed)
    assert_same_samples(got, reference.sample("v1", job(prompt)))
