"""TorchSampler across model families: continuous batching, the prefix cache and LoRA mixes.

Every family of `tiny_models.FAMILIES`, among them Gemma 3 and 4 (sliding
windows of 8 beside global layers; Gemma 4 also shares KV across its last
layers), Qwen3.5 (linear-attention layers between full ones) and the
mixture-of-experts models. Sequences run well past the window. References are
plain Hugging Face forwards over the whole sequence, with no cache; tolerance
1e-4 in fp32, as in test_torch_sampler.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_torch_sampler import make_lora  # a peft model with random lora_B, and its tensors

from openrld.batches import LoraSpec, SampleJob, SamplingSpec
from openrld.gpu import models, packed_linear
from openrld.gpu.fused_forward import unsupported_reason
from openrld.gpu.tiny_models import FAMILIES, SLIDING_WINDOW, build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler

CPU = torch.device("cpu")
LINEAR_FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", autouse=True)
def small_weights_pack_here() -> Iterator[None]:
    """Every sampler of this module packs the tiny weights (`packed_linear.MIN_PACKED_ELEMENTS`
    keeps a node from it), so that its logprobs check the packed path on every family."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_model(tmp_path_factory.mktemp("families") / arch, arch, seed=3)


def test_every_family_samples_through_its_linear_weights_packed_on_the_cpu(family: tuple[str, Path]):
    """Every logprob this file checks against Hugging Face's forward runs through the packed
    copies: the fused forward's where the family has it, Hugging Face's own forward's elsewhere
    (every nn.Linear of the model; a mixture of experts' expert tensors are not linears)."""
    directory = family[1]
    sampler = TorchSampler(directory, CPU)
    sampler.sample(None, job(prompt_of(5, 1), 1, 2, seed=0))
    model = sampler._model
    if unsupported_reason(model) is None:
        linears = [model.get_output_embeddings()] + [
            module for name, module in model.model.layers.named_modules() if name.endswith("_proj")
        ]
    else:
        linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    weights = {id(module.weight): module.weight for module in linears}  # a tied head is its embedding
    assert sampler.statistics().packed_weight_bytes == sum(w.numel() * 4 for w in weights.values())


def job(prompt: list[int], n: int, max_tokens: int, seed: int, **kwargs) -> SampleJob:
    params = SamplingSpec(max_tokens=max_tokens, seed=seed, stop_at_eos=False)
    return SampleJob(prompt=np.asarray(prompt, dtype=np.int64), num_samples=n, params=params, **kwargs)


def prompt_of(length: int, offset: int) -> list[int]:
    return [(7 * i + offset) % 300 + 3 for i in range(length)]


def reference_picked(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """log p of each of `tokens` after `prompt` (and the tokens before it), from one uncached forward."""
    ids = torch.as_tensor(np.concatenate([prompt, tokens]), dtype=torch.int64)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
    rows = logp[len(prompt) - 1 : -1]
    return rows.gather(-1, torch.as_tensor(tokens, dtype=torch.int64)[:, None])[:, 0].numpy()


def run(sampler: TorchSampler, requests: dict[str, tuple[str | None, SampleJob]], join_after: int = 0) -> dict:
    """Add the first request, step `join_after` times, add the rest, step until all finish."""
    names = list(requests)
    results = {}
    sampler.add(names[0], *requests[names[0]])
    for _ in range(join_after):
        for done in sampler.step():
            results[done.request_id] = done.result
    for name in names[1:]:
        sampler.add(name, *requests[name])
    while sampler.has_work():
        for done in sampler.step():
            results[done.request_id] = done.result
    return results


def test_rows_that_join_a_running_batch_sample_as_a_full_forward_scores(family: tuple[str, Path]) -> None:
    arch, directory = family
    sampler = TorchSampler(directory, CPU)
    reference = models.load_causal_lm(directory, CPU)
    prompts = {"long": prompt_of(21, 1), "short": prompt_of(5, 2), "late": prompt_of(13, 3)}
    requests = {name: (None, job(p, n=2, max_tokens=30, seed=i)) for i, (name, p) in enumerate(prompts.items())}
    results = run(sampler, requests, join_after=6)
    assert sorted(results) == sorted(prompts)
    for name, result in results.items():
        for seq in result.sequences:
            assert len(prompts[name]) + len(seq.tokens) > 4 * SLIDING_WINDOW
            expected = reference_picked(reference, prompts[name], seq.tokens)
            np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4, err_msg=f"{arch} {name}")


def test_prompts_prefilled_in_chunks_score_as_one_full_forward(family: tuple[str, Path]) -> None:
    arch, directory = family
    sampler = TorchSampler(directory, CPU, prefill_chunk_tokens=7)  # 38 positions: 6 chunks, window 8
    reference = models.load_causal_lm(directory, CPU)
    prompt = prompt_of(38, 7)
    result = sampler.sample(None, job(prompt, n=2, max_tokens=10, seed=4, prompt_logprobs=True))
    expected = reference_picked(reference, prompt[:1], np.asarray(prompt[1:]))
    assert np.isnan(result.prompt_logprobs[0])
    np.testing.assert_allclose(result.prompt_logprobs[1:], expected, rtol=0, atol=1e-4, err_msg=arch)
    for seq in result.sequences:
        np.testing.assert_allclose(seq.logprobs, reference_picked(reference, prompt, seq.tokens), rtol=0, atol=1e-4)


def test_a_prompt_sampled_again_takes_its_prefix_from_the_cache_unless_the_model_has_linear_layers(
    family: tuple[str, Path],
) -> None:
    arch, directory = family
    sampler = TorchSampler(directory, CPU)
    prompt = prompt_of(40, 5)
    first = sampler.sample(None, job(prompt, n=1, max_tokens=12, seed=9))
    again = sampler.sample(None, job(prompt, n=1, max_tokens=12, seed=9))
    # 40 positions, blocks of 16: the first 32 come from the cache.
    assert again.prompt_cache_hit_tokens == (0 if arch in LINEAR_FAMILIES else 32)
    assert np.array_equal(again.sequences[0].tokens, first.sequences[0].tokens)
    np.testing.assert_allclose(again.sequences[0].logprobs, first.sequences[0].logprobs, rtol=0, atol=1e-5)


def test_rows_of_two_adapters_and_the_base_sample_as_their_peft_models_score(family: tuple[str, Path]) -> None:
    arch, directory = family
    spec = LoraSpec(rank=4)
    sampler = TorchSampler(directory, CPU)
    references = {None: models.load_causal_lm(directory, CPU)}
    for version, seed in (("a", 1), ("b", 2)):
        references[version], tensors = make_lora(directory, spec, seed)
        sampler.load_version(version, tensors, spec)
    prompt = prompt_of(9, 6)
    requests = {str(version): (version, job(prompt, n=2, max_tokens=24, seed=8)) for version in references}
    results = run(sampler, requests)
    for version, reference in references.items():
        for seq in results[str(version)].sequences:
            expected = reference_picked(reference, prompt, seq.tokens)
            np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4, err_msg=f"{arch} {version}")


def test_a_batch_mixing_two_adapters_samples_as_each_alone(family: tuple[str, Path]) -> None:
    arch, directory = family
    spec = LoraSpec(rank=4)
    mixed = TorchSampler(directory, CPU)
    for version, seed in (("a", 1), ("b", 2)):
        mixed.load_version(version, make_lora(directory, spec, seed)[1], spec)
    prompt = prompt_of(11, 4)
    requests = {
        version: (version, job(prompt, n=2, max_tokens=20, seed=5)) for version in ("a", "b")
    } | {"base": (None, job(prompt, n=1, max_tokens=20, seed=5))}
    together = run(mixed, requests)
    for name, (version, request) in requests.items():
        alone = mixed.sample(version, request)
        for seq, expected in zip(together[name].sequences, alone.sequences):
            assert np.array_equal(seq.tokens, expected.tokens), f"{arch} {name}"
            np.testing.assert_allclose(seq.logprobs, expected.logprobs, rtol=0, atol=1e-5, err_msg=f"{arch} {name}")
    assert not np.array_equal(together["a"].sequences[0].tokens, together["b"].sequences[0].tokens)
