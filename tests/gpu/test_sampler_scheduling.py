"""TorchSampler's step-level scheduler: requests join and leave a running batch at token boundaries.

The reference for every request is the same request run alone on an idle
engine (`sample`). Tolerance: tokens equal exactly; logprobs 1e-5, because
a row's matmuls run in a batch of a different size and its attention over a
left-padded cache sums the same terms with masked zeros (observed ~1e-7).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import LoraSpec, SampleJob, SampleResult, SamplingSpec
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler
from tests.gpu.test_torch_sampler import make_lora

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("scheduling") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def sampler(qwen3_dir: Path) -> TorchSampler:
    engine = TorchSampler(qwen3_dir, CPU)
    engine.load_version("a", make_lora(qwen3_dir, SPEC, seed=1)[1], SPEC)
    engine.load_version("b", make_lora(qwen3_dir, SPEC, seed=2)[1], SPEC)
    return engine


def job(prompt: list[int], n: int = 1, **params) -> SampleJob:
    params = {"max_tokens": 8, "seed": 5, "stop_at_eos": False} | params
    return SampleJob(prompt=np.asarray(prompt, dtype=np.int64), num_samples=n, params=SamplingSpec(**params))


def run_until_idle(engine: TorchSampler | FullSampler) -> dict[str, SampleResult]:
    results = {}
    while engine.has_work():
        results.update((f.request_id, f.result) for f in engine.step())
    return results


def assert_same_samples(got: SampleResult, expected: SampleResult) -> None:
    assert len(got.sequences) == len(expected.sequences)
    for x, y in zip(got.sequences, expected.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        assert x.stop_reason == y.stop_reason


# Three prompts of different lengths (so the batch is left-padded) on three versions.
REQUESTS = [
    ("r-a", "a", job([5, 6, 7, 8, 9, 10, 11, 12, 13], 2, seed=1)),
    ("r-base", None, job([20, 21, 22], 3, seed=2, max_tokens=5)),
    ("r-b", "b", job([30, 31, 32, 33, 34], 1, seed=3, max_tokens=12, temperature=0.7, top_k=9)),
]


def test_requests_of_different_versions_in_one_batch_sample_as_alone(sampler: TorchSampler) -> None:
    alone = {rid: sampler.sample(version, j) for rid, version, j in REQUESTS}
    for rid, version, j in REQUESTS:
        sampler.add(rid, version, j)
    sampler.step()
    assert sampler.statistics().rows_running == 2 + 3 + 1  # all three share the decode batch
    together = run_until_idle(sampler)
    assert together.keys() == alone.keys()
    for rid in alone:
        assert_same_samples(together[rid], alone[rid])


def test_rows_drawn_together_keep_their_own_top_k_sample_logprobs(sampler: TorchSampler) -> None:
    """Rows that sample alike draw in one call with the widest k asked; each keeps its own k columns."""
    wide = SampleJob(prompt=np.array([5, 6, 7]), num_samples=1, topk_sample_logprobs=5, params=job([0]).params)
    narrow = SampleJob(prompt=np.array([8, 9]), num_samples=2, topk_sample_logprobs=2, params=job([0]).params)
    plain = SampleJob(prompt=np.array([10, 11, 12, 13]), num_samples=1, params=job([0]).params)
    alone = {
        "wide": sampler.sample("a", wide), "narrow": sampler.sample(None, narrow), "plain": sampler.sample("b", plain)
    }
    sampler.add("wide", "a", wide)
    sampler.add("narrow", None, narrow)
    sampler.add("plain", "b", plain)
    together = run_until_idle(sampler)
    for rid, k in (("wide", 5), ("narrow", 2)):
        for x, y in zip(together[rid].sequences, alone[rid].sequences):
            assert x.topk.token_ids.shape == (8, k)
            np.testing.assert_array_equal(x.topk.token_ids, y.topk.token_ids)
            np.testing.assert_allclose(x.topk.logprobs, y.topk.logprobs, rtol=0, atol=1e-5)
    assert together["plain"].sequences[0].topk is None
    assert_same_samples(together["plain"], alone["plain"])


def test_prompts_scored_in_one_prefill_score_as_alone(sampler: TorchSampler) -> None:
    """Requests admitted in one step share a prefill forward; their prompt scores do not change."""
    jobs = {
        "all": ("a", SampleJob(np.array([5, 6, 7, 8, 9, 10]), 1, job([0]).params, prompt_logprobs=True)),
        "last-2": (None, SampleJob(
            np.array([20, 21, 22, 23]), 2, job([0]).params, prompt_logprobs=True, prompt_logprobs_last_n=2
        )),
        "top-3": ("b", SampleJob(np.array([30, 31, 32]), 1, job([0], max_tokens=0).params, topk_prompt_logprobs=3)),
    }
    alone = {rid: sampler.sample(version, j) for rid, (version, j) in jobs.items()}
    for rid, (version, j) in jobs.items():
        sampler.add(rid, version, j)
    together = run_until_idle(sampler)
    for rid in jobs:
        assert_same_samples(together[rid], alone[rid])
    for rid in ("all", "last-2"):
        np.testing.assert_allclose(together[rid].prompt_logprobs, alone[rid].prompt_logprobs, rtol=0, atol=1e-5)
    last_two = together["last-2"].prompt_logprobs
    assert np.isnan(last_two[:2]).all() and not np.isnan(last_two[2:]).any()
    np.testing.assert_array_equal(together["top-3"].topk_prompt.token_ids, alone["top-3"].topk_prompt.token_ids)
    np.testing.assert_allclose(together["top-3"].topk_prompt.logprobs, alone["top-3"].topk_prompt.logprobs, atol=1e-5)


def test_request_joining_a_running_batch_samples_as_alone(sampler: TorchSampler) -> None:
    (first_id, first_version, first), (late_id, late_version, late) = REQUESTS[0], REQUESTS[2]
    alone_first, alone_late = sampler.sample(first_version, first), sampler.sample(late_version, late)
    sampler.add(first_id, first_version, first)
    for _ in range(3):
        assert sampler.step() == []  # 3 of its 8 tokens
    sampler.add(late_id, late_version, late)
    results = run_until_idle(sampler)
    assert_same_samples(results[first_id], alone_first)
    assert_same_samples(results[late_id], alone_late)


def test_requests_finish_in_the_step_their_last_sample_ends(sampler: TorchSampler) -> None:
    sampler.add("long", None, job([1, 2, 3], max_tokens=6))
    sampler.add("short", None, job([1, 2, 3], max_tokens=2))
    # Step 1 prefills both (drawing token 1) and decodes token 2; each later step decodes one more.
    finished_at = {}
    for step in range(1, 7):
        for f in sampler.step():
            finished_at[f.request_id] = step
    assert finished_at == {"short": 1, "long": 5}
    assert not sampler.has_work() and sampler.statistics().rows_running == 0


def test_rows_never_exceed_the_batch_limit_and_samples_match(qwen3_dir: Path) -> None:
    engine = TorchSampler(qwen3_dir, CPU, decode_batch_rows=2)
    requests = [(f"r{i}", job([3 + i, 4, 5, 6 + i], 3, seed=i)) for i in range(3)]
    alone = {rid: engine.sample(None, j) for rid, j in requests}
    for rid, j in requests:
        engine.add(rid, None, j)
    results, most_rows = {}, 0
    while engine.has_work():
        results.update((f.request_id, f.result) for f in engine.step())
        most_rows = max(most_rows, engine.statistics().rows_running)
    assert most_rows == 2
    for rid in alone:
        assert_same_samples(results[rid], alone[rid])


def test_cancel_frees_rows_and_others_finish_unchanged(sampler: TorchSampler) -> None:
    (keep_id, keep_version, kept), (drop_id, drop_version, dropped) = REQUESTS[0], REQUESTS[1]
    alone = sampler.sample(keep_version, kept)
    sampler.add(keep_id, keep_version, kept)
    sampler.add(drop_id, drop_version, dropped)
    sampler.step()
    assert sampler.cancel(drop_id) is True
    assert sampler.statistics().rows_running == 2
    results = run_until_idle(sampler)
    assert list(results) == [keep_id]
    assert_same_samples(results[keep_id], alone)
    assert sampler.cancel(drop_id) is False


def test_cancel_of_a_queued_request_never_runs_it(sampler: TorchSampler) -> None:
    sampler.add("queued", None, job([1, 2, 3]))
    before = sampler.statistics().prompt_tokens_prefilled
    assert sampler.cancel("queued") is True
    assert run_until_idle(sampler) == {}
    assert sampler.statistics().prompt_tokens_prefilled == before


def test_num_samples_prefill_the_prompt_once_and_report_the_reuse(qwen3_dir: Path) -> None:
    engine = TorchSampler(qwen3_dir, CPU)
    prompt = [7, 8, 9, 10, 11, 12]
    four = engine.sample(None, job(prompt, 4))
    assert engine.statistics().prompt_tokens_prefilled == len(prompt)  # once, not 4 times
    assert four.prompt_cache_hit_tokens == len(prompt)  # samples 2..4 reused the whole prompt's KV
    assert engine.sample(None, job(prompt, 1)).prompt_cache_hit_tokens == 0
    assert engine.sample(None, job(prompt, 4, max_tokens=0)).prompt_cache_hit_tokens == 0


def test_version_in_use_cannot_be_dropped(sampler: TorchSampler) -> None:
    sampler.add("busy", "a", job([1, 2, 3]))
    with pytest.raises(ValueError, match="in use"):
        sampler.drop_version("a")
    run_until_idle(sampler)
    assert sampler.has_version("a")


def test_duplicate_live_request_id_is_refused(sampler: TorchSampler) -> None:
    sampler.add("twice", None, job([1, 2, 3]))
    with pytest.raises(ValueError, match="already in the sampler"):
        sampler.add("twice", None, job([1, 2, 3]))
    run_until_idle(sampler)
