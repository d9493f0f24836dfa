"""TorchSampler against Tinker's sampling semantics, on tiny Llama and Qwen3 models on the CPU.

References are plain Hugging Face forwards over the whole sequence (no KV
cache), loaded separately from the sampler. Tolerances, all fp32:
- 1e-5 where the sampler and the reference run the same ops on the same rows
  (prompt scoring): only the matmul blocking can differ;
- 1e-4 where the sampler decodes with a KV cache and the reference does not:
  the attention sums run in a different order (observed differences ~1e-6);
- exact equality where the same request runs twice.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

from openrld.batches import LoraSpec, SampleJob, SamplingSpec
from openrld.errors import BadRequest
from openrld.gpu import models
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TOPK_EMPTY_LOGPROB, TorchSampler

CPU = torch.device("cpu")
PROMPT_TEXT = "User: what is two plus two? Assistant:"
SHARPEN = 12.0  # lm_head x12: logit std 0.16 -> ~1.9, so that temperature visibly changes q
CHI_SQUARE_ALPHA = 1e-3  # the false-alarm rate of each chi-square acceptance test


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampler") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampler") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def sharp_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a scaled lm_head: its random logits are nearly flat otherwise."""
    out = tmp_path_factory.mktemp("sampler") / "sharp"
    model = models.load_causal_lm(llama_dir, CPU)
    model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(llama_dir)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> TorchSampler:
    return TorchSampler(llama_dir, CPU)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> TorchSampler:
    return TorchSampler(qwen3_dir, CPU)


@pytest.fixture(scope="module")
def sharp(sharp_dir: Path) -> TorchSampler:
    return TorchSampler(sharp_dir, CPU)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def prompt(tokenizer: transformers.PreTrainedTokenizerBase) -> np.ndarray:
    return np.asarray(tokenizer.encode(PROMPT_TEXT), dtype=np.int64)


def reference_logprobs(model: torch.nn.Module, ids: np.ndarray) -> torch.Tensor:
    """(L, V) fp32 log_softmax of one uncached forward; row j predicts ids[j + 1]."""
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids, dtype=torch.int64)[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def picked(logp: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    """logp[j, targets[j]] for each row j."""
    return logp.gather(-1, torch.as_tensor(targets, dtype=torch.int64)[:, None])[:, 0].numpy()


def job(prompt: np.ndarray, n: int = 1, **kwargs) -> SampleJob:
    scoring = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(("prompt_logprobs", "topk_"))}
    return SampleJob(prompt=prompt, num_samples=n, params=SamplingSpec(**kwargs), **scoring)


def greedy_reference(model: torch.nn.Module, prompt: np.ndarray, steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(torch.argmax(reference_logprobs(model, np.asarray(ids))[-1])))
    return ids[len(prompt) :]


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of counts against probs; cells expecting < 5 draws are pooled into one.

    The p-value is the chi-square survival function, Q(df/2, stat/2) (the upper
    regularised gamma function), with df = cells - 1.
    """
    total = counts.sum()
    expected = probs * total
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def first_token_counts(sampler: TorchSampler, prompt: np.ndarray, temperature: float, vocab: int) -> np.ndarray:
    """How often each token came first among 2000 seeded samples (one request, max_tokens=1)."""
    result = sampler.sample(None, job(prompt, 2000, max_tokens=1, temperature=temperature, seed=1234))
    drawn = np.concatenate([s.tokens for s in result.sequences])
    return np.bincount(drawn, minlength=vocab)


# ---------------------------------------------------------------------------
# The distribution sampled from


@pytest.mark.parametrize("temperature", [0.7, 1.5], ids=["T0.7", "T1.5"])
def test_first_token_frequencies_match_softmax_at_temperature(
    sharp: TorchSampler, sharp_dir: Path, prompt: np.ndarray, temperature: float
) -> None:
    logits = reference_logprobs(models.load_causal_lm(sharp_dir, CPU), prompt)[-1]
    probs = torch.softmax(logits / temperature, dim=-1).double().numpy()
    counts = first_token_counts(sharp, prompt, temperature, len(probs))
    assert chi_square_p_value(counts, probs) > CHI_SQUARE_ALPHA


def test_chi_square_test_rejects_the_unscaled_distribution(
    sharp: TorchSampler, sharp_dir: Path, prompt: np.ndarray
) -> None:
    # The acceptance test above has power: draws at T=1.5 are not softmax(logits) at T=1.
    logits = reference_logprobs(models.load_causal_lm(sharp_dir, CPU), prompt)[-1]
    probs = torch.softmax(logits, dim=-1).double().numpy()
    counts = first_token_counts(sharp, prompt, 1.5, len(probs))
    assert chi_square_p_value(counts, probs) < 1e-9


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sampled_logprobs_at_t1_equal_a_full_forward(
    request: pytest.FixtureRequest, arch: str, prompt: np.ndarray
) -> None:
    sampler: TorchSampler = request.getfixturevalue(arch)
    reference = models.load_causal_lm(request.getfixturevalue(f"{arch}_dir"), CPU)
    result = sampler.sample(None, job(prompt, 3, max_tokens=12, seed=7, stop_at_eos=False))
    for seq in result.sequences:
        assert len(seq.tokens) == 12 and seq.logprobs.dtype == np.float32
        logp = reference_logprobs(reference, np.concatenate([prompt, seq.tokens]))
        # Row P-1+i predicts generated token i.
        expected = picked(logp[len(prompt) - 1 : -1], seq.tokens)
        np.testing.assert_allclose(seq.logprobs, expected, rtol=0, atol=1e-4)


def test_sampled_logprobs_are_the_truncated_renormalised_q(
    sharp: TorchSampler, sharp_dir: Path, prompt: np.ndarray
) -> None:
    # T=0.7, top_k=5, top_p=0.8: top-p runs on the top-k result, so q keeps the smallest prefix
    # of the 5 best tokens whose mass *within those 5* reaches 0.8, renormalised; logprob = log q.
    temperature, top_k, top_p = 0.7, 5, 0.8
    reference = models.load_causal_lm(sharp_dir, CPU)
    result = sharp.sample(
        None, job(prompt, 4, max_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, seed=3, stop_at_eos=False)
    )
    for seq in result.sequences:
        logits = reference_logprobs(reference, np.concatenate([prompt, seq.tokens]))[len(prompt) - 1 : -1]
        for row, token, logprob in zip(logits, seq.tokens, seq.logprobs):
            p = torch.softmax(row.double() / temperature, dim=-1).numpy()
            best = np.argsort(-p, kind="stable")[:top_k]
            p_k = p[best] / p[best].sum()
            mass_before = np.cumsum(p_k) - p_k
            kept = best[mass_before < top_p]
            assert token in kept
            assert logprob == pytest.approx(math.log(p[token] / p[kept].sum()), abs=1e-4)


def test_sample_topk_rows_list_q_in_order_and_hold_the_sampled_logprob(
    sharp: TorchSampler, prompt: np.ndarray
) -> None:
    # top_k=3 sampling with 5 requested columns: columns 4 and 5 lie outside q's support.
    result = sharp.sample(None, job(prompt, 2, max_tokens=4, top_k=3, seed=5, topk_sample_logprobs=5))
    for seq in result.sequences:
        assert seq.topk is not None and seq.topk.token_ids.shape == (len(seq.tokens), 5)
        for token, logprob, ids, lps in zip(seq.tokens, seq.logprobs, seq.topk.token_ids, seq.topk.logprobs):
            assert list(ids[3:]) == [0, 0] and list(lps[3:]) == [TOPK_EMPTY_LOGPROB] * 2
            assert np.all(np.diff(lps[:3]) <= 0)
            assert np.exp(lps[:3].astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-5)  # q renormalised
            assert lps[list(ids).index(token)] == logprob


# ---------------------------------------------------------------------------
# Prompt scoring


def test_prompt_logprobs_equal_a_full_forward_with_nan_at_zero(
    llama: TorchSampler, llama_dir: Path, prompt: np.ndarray
) -> None:
    result = llama.sample(None, job(prompt, max_tokens=1, temperature=0.5, prompt_logprobs=True))
    logp = reference_logprobs(models.load_causal_lm(llama_dir, CPU), prompt)
    expected = picked(logp[:-1], prompt[1:])  # raw, T=1
    assert result.prompt_logprobs is not None and result.prompt_logprobs.dtype == np.float32
    assert np.isnan(result.prompt_logprobs[0])
    np.testing.assert_allclose(result.prompt_logprobs[1:], expected, rtol=0, atol=1e-5)


def test_prompt_logprobs_last_n_score_only_the_suffix(llama: TorchSampler, prompt: np.ndarray) -> None:
    full = llama.sample(None, job(prompt, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=2))
    last3 = llama.sample(
        None, job(prompt, max_tokens=1, prompt_logprobs=True, prompt_logprobs_last_n=3, topk_prompt_logprobs=2)
    )
    p = len(prompt)
    assert np.isnan(last3.prompt_logprobs[: p - 3]).all()
    np.testing.assert_allclose(last3.prompt_logprobs[p - 3 :], full.prompt_logprobs[p - 3 :], rtol=0, atol=1e-5)
    assert last3.topk_prompt is not None
    assert (last3.topk_prompt.token_ids[: p - 3] == 0).all()
    assert (last3.topk_prompt.logprobs[: p - 3] == TOPK_EMPTY_LOGPROB).all()
    np.testing.assert_array_equal(last3.topk_prompt.token_ids[p - 3 :], full.topk_prompt.token_ids[p - 3 :])


def test_topk_prompt_rows_are_the_best_raw_logprobs(llama: TorchSampler, llama_dir: Path, prompt: np.ndarray) -> None:
    result = llama.sample(None, job(prompt, max_tokens=0, topk_prompt_logprobs=4))
    logp = reference_logprobs(models.load_causal_lm(llama_dir, CPU), prompt)
    values, ids = torch.topk(logp[:-1], 4, dim=-1)
    assert result.prompt_logprobs is None and result.topk_prompt is not None
    assert result.topk_prompt.token_ids.shape == (len(prompt), 4)
    assert (result.topk_prompt.token_ids[0] == 0).all() and (result.topk_prompt.logprobs[0] == TOPK_EMPTY_LOGPROB).all()
    np.testing.assert_array_equal(result.topk_prompt.token_ids[1:], ids.numpy())
    np.testing.assert_allclose(result.topk_prompt.logprobs[1:], values.numpy(), rtol=0, atol=1e-5)


def test_chunked_prefill_scores_and_samples_like_one_chunk(
    llama: TorchSampler, llama_dir: Path, prompt: np.ndarray
) -> None:
    chunked = TorchSampler(llama_dir, CPU, prefill_chunk_tokens=3)
    request = job(prompt, 2, max_tokens=5, seed=11, prompt_logprobs=True)
    a, b = llama.sample(None, request), chunked.sample(None, request)
    np.testing.assert_allclose(b.prompt_logprobs, a.prompt_logprobs, rtol=0, atol=1e-5)
    for x, y in zip(a.sequences, b.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# Seeds and batching


def test_same_seed_reproduces_tokens_and_logprobs_exactly(llama: TorchSampler, prompt: np.ndarray) -> None:
    request = job(prompt, 3, max_tokens=10, seed=42, stop_at_eos=False)
    a, b = llama.sample(None, request), llama.sample(None, request)
    for x, y in zip(a.sequences, b.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_sample_zero_does_not_depend_on_num_samples(llama: TorchSampler, prompt: np.ndarray) -> None:
    three = llama.sample(None, job(prompt, 3, max_tokens=10, seed=42, stop_at_eos=False))
    one = llama.sample(None, job(prompt, 1, max_tokens=10, seed=42, stop_at_eos=False))
    np.testing.assert_array_equal(three.sequences[0].tokens, one.sequences[0].tokens)
    # Batch size 3 vs 1 changes the CPU matmul blocking: rounding-level differences only.
    np.testing.assert_allclose(three.sequences[0].logprobs, one.sequences[0].logprobs, rtol=0, atol=1e-5)


def test_samples_of_one_request_draw_different_streams(llama: TorchSampler, prompt: np.ndarray) -> None:
    result = llama.sample(None, job(prompt, 3, max_tokens=10, seed=42, stop_at_eos=False))
    assert len({tuple(s.tokens) for s in result.sequences}) == 3


def test_decoding_in_groups_gives_the_same_samples(llama: TorchSampler, llama_dir: Path, prompt: np.ndarray) -> None:
    grouped = TorchSampler(llama_dir, CPU, decode_batch_rows=2)  # 5 samples decode as 2 + 2 + 1
    request = job(prompt, 5, max_tokens=8, seed=9, stop_at_eos=False)
    for x, y in zip(llama.sample(None, request).sequences, grouped.sample(None, request).sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# Greedy and truncation


def test_temperature_zero_is_greedy_with_zero_logprobs(
    llama: TorchSampler, llama_dir: Path, prompt: np.ndarray
) -> None:
    result = llama.sample(None, job(prompt, 2, max_tokens=8, temperature=0.0, stop_at_eos=False))
    expected = greedy_reference(models.load_causal_lm(llama_dir, CPU), prompt, 8)
    for seq in result.sequences:
        assert seq.tokens.tolist() == expected
        assert seq.logprobs.tolist() == [0.0] * 8


@pytest.mark.parametrize(
    "truncation", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=1e-6"]
)
def test_single_token_truncation_equals_greedy(llama: TorchSampler, prompt: np.ndarray, truncation: dict) -> None:
    greedy = llama.sample(None, job(prompt, max_tokens=8, temperature=0.0, stop_at_eos=False))
    result = llama.sample(None, job(prompt, 2, max_tokens=8, seed=1, stop_at_eos=False, **truncation))
    for seq in result.sequences:
        np.testing.assert_array_equal(seq.tokens, greedy.sequences[0].tokens)
        assert seq.logprobs.tolist() == [0.0] * 8  # q renormalised onto one token: log 1


# ---------------------------------------------------------------------------
# Stopping


def test_stop_string_spanning_a_token_boundary_stops_after_the_completing_token(
    llama: TorchSampler, tokenizer: transformers.PreTrainedTokenizerBase, prompt: np.ndarray
) -> None:
    free = llama.sample(None, job(prompt, max_tokens=24, temperature=0.0, stop_at_eos=False)).sequences[0].tokens

    def text(n: int) -> str:
        return tokenizer.decode(free[:n].tolist(), clean_up_tokenization_spaces=False)

    # Find tokens i, i+1 and a two-character string made of the last character of token i and
    # the first of token i+1, which first appears in the generated text once token i+1 is added.
    for i in range(len(free) - 1):
        left, right = text(i + 1)[len(text(i)) :], text(i + 2)[len(text(i + 1)) :]
        if not left or not right or "\ufffd" in left + right:
            continue
        stop = left[-1] + right[0]
        if stop not in text(i + 1) and stop not in right:  # only token i + 1 completes it
            break
    else:
        pytest.fail(f"no boundary-spanning stop string in {text(len(free))!r}")
    result = llama.sample(None, job(prompt, max_tokens=24, temperature=0.0, stop_strings=(stop,)))
    seq = result.sequences[0]
    assert seq.tokens.tolist() == free[: i + 2].tolist()
    assert seq.stop_reason == "stop"


def test_stop_token_id_stops_and_is_returned(llama: TorchSampler, prompt: np.ndarray) -> None:
    free = llama.sample(None, job(prompt, max_tokens=10, temperature=0.0, stop_at_eos=False)).sequences[0].tokens
    stop_id = int(free[4])
    first = free.tolist().index(stop_id)  # it may occur before position 4
    result = llama.sample(None, job(prompt, max_tokens=10, temperature=0.0, stop_token_ids=(stop_id,)))
    seq = result.sequences[0]
    assert seq.tokens.tolist() == free[: first + 1].tolist() and seq.tokens[-1] == stop_id
    assert len(seq.logprobs) == first + 1 and seq.stop_reason == "stop"


@pytest.fixture(scope="module")
def eos_setup(
    llama: TorchSampler,
    llama_dir: Path,
    tokenizer: transformers.PreTrainedTokenizerBase,
    prompt: np.ndarray,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TorchSampler, int]:
    """The tiny Llama with a generation_config that adds the 4th greedy token as an EOS id."""
    free = llama.sample(None, job(prompt, max_tokens=10, temperature=0.0, stop_at_eos=False)).sequences[0].tokens
    eos_position = next(i for i in range(3, 10) if free[i] not in free[:i])
    out = tmp_path_factory.mktemp("sampler") / "eos"
    shutil.copytree(llama_dir, out)
    config = transformers.GenerationConfig.from_pretrained(out)
    config.eos_token_id = [int(tokenizer.eos_token_id), int(free[eos_position])]
    config.save_pretrained(out)
    return TorchSampler(out, CPU), eos_position


def test_generation_config_eos_ids_stop(eos_setup: tuple[TorchSampler, int], prompt: np.ndarray) -> None:
    sampler, eos_position = eos_setup
    seq = sampler.sample(None, job(prompt, max_tokens=10, temperature=0.0)).sequences[0]
    assert len(seq.tokens) == eos_position + 1 and seq.stop_reason == "stop"


def test_empty_stop_list_disables_eos_and_runs_to_max_tokens(
    eos_setup: tuple[TorchSampler, int], prompt: np.ndarray
) -> None:
    sampler, _ = eos_setup
    seq = sampler.sample(None, job(prompt, max_tokens=10, temperature=0.0, stop_at_eos=False)).sequences[0]
    assert len(seq.tokens) == 10 and seq.stop_reason == "length"


def test_max_tokens_zero_returns_empty_length_sequences(llama: TorchSampler, prompt: np.ndarray) -> None:
    result = llama.sample(None, job(prompt, 2, max_tokens=0, topk_sample_logprobs=3))
    for seq in result.sequences:
        assert len(seq.tokens) == 0 and len(seq.logprobs) == 0 and seq.stop_reason == "length"
        assert seq.topk is not None and seq.topk.token_ids.shape == (0, 3)


def test_generation_ends_at_the_context_window_with_length(llama: TorchSampler, llama_dir: Path) -> None:
    context = transformers.AutoConfig.from_pretrained(llama_dir).max_position_embeddings  # 1024
    prompt = np.full(context - 2, 5, dtype=np.int64)
    seq = llama.sample(None, job(prompt, max_tokens=None, seed=0, stop_at_eos=False)).sequences[0]
    assert len(seq.tokens) == 2 and seq.stop_reason == "length"


# ---------------------------------------------------------------------------
# LoRA versions


def make_lora(model_dir: Path, spec: LoraSpec, seed: int) -> tuple[peft.PeftModel, dict[str, torch.Tensor]]:
    """A peft model with random nonzero lora_B (as after training), and its saved tensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference = peft.get_peft_model(models.load_causal_lm(model_dir, CPU), models.lora_config(spec))
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
    reference.eval()
    return reference, peft.get_peft_model_state_dict(reference, adapter_name="default")


@pytest.mark.parametrize(
    "spec", [LoraSpec(rank=4), LoraSpec(rank=2, train_mlp=False, train_unembed=False)], ids=["all", "attn"]
)
def test_lora_version_scores_and_samples_as_its_peft_model(
    qwen3_dir: Path, prompt: np.ndarray, spec: LoraSpec
) -> None:
    sampler = TorchSampler(qwen3_dir, CPU)
    reference, tensors = make_lora(qwen3_dir, spec, seed=spec.rank)
    version = "tinker://run-1/sampler_weights:7"  # ':' and '/' are no valid peft adapter name
    sampler.load_version(version, tensors, spec)
    result = sampler.sample(version, job(prompt, 2, max_tokens=6, seed=2, stop_at_eos=False, prompt_logprobs=True))
    logp = reference_logprobs(reference, prompt)
    expected = picked(logp[:-1], prompt[1:])
    np.testing.assert_allclose(result.prompt_logprobs[1:], expected, rtol=0, atol=1e-5)
    for seq in result.sequences:
        logp = reference_logprobs(reference, np.concatenate([prompt, seq.tokens]))
        np.testing.assert_allclose(seq.logprobs, picked(logp[len(prompt) - 1 : -1], seq.tokens), rtol=0, atol=1e-4)


def test_lora_version_changes_the_distribution_and_none_stays_the_base(
    qwen3_dir: Path, prompt: np.ndarray
) -> None:
    sampler = TorchSampler(qwen3_dir, CPU)
    spec = LoraSpec(rank=4)
    sampler.load_version("a", make_lora(qwen3_dir, spec, seed=1)[1], spec)
    sampler.load_version("b", make_lora(qwen3_dir, spec, seed=2)[1], spec)
    request = job(prompt, max_tokens=1, prompt_logprobs=True)
    base = reference_logprobs(models.load_causal_lm(qwen3_dir, CPU), prompt)
    expected_base = picked(base[:-1], prompt[1:])
    a = sampler.sample("a", request).prompt_logprobs[1:]
    none = sampler.sample(None, request).prompt_logprobs[1:]
    np.testing.assert_allclose(none, expected_base, rtol=0, atol=1e-5)
    # lora_B ~ N(0, 0.02) with scale alpha/r = 8 moves the logprobs by far more than 0.05.
    assert np.abs(a - expected_base).max() > 0.05


def test_loading_a_version_twice_raises(qwen3_dir: Path) -> None:
    sampler = TorchSampler(qwen3_dir, CPU)
    spec = LoraSpec(rank=2)
    tensors = make_lora(qwen3_dir, spec, seed=0)[1]
    sampler.load_version("model:1/v", tensors, spec)
    with pytest.raises(ValueError, match="already loaded"):
        sampler.load_version("model:1/v", tensors, spec)


def test_dropped_version_is_no_longer_served(qwen3: TorchSampler, qwen3_dir: Path, prompt: np.ndarray) -> None:
    spec = LoraSpec(rank=2)
    qwen3.load_version("dropme", make_lora(qwen3_dir, spec, seed=0)[1], spec)
    assert qwen3.has_version("dropme") and qwen3.has_version(None)
    qwen3.drop_version("dropme")
    assert not qwen3.has_version("dropme")
    with pytest.raises(KeyError, match="dropme"):
        qwen3.sample("dropme", job(prompt, max_tokens=1))


def test_version_whose_base_weight_differs_is_refused(qwen3: TorchSampler, qwen3_dir: Path) -> None:
    spec = LoraSpec(rank=2)
    tensors = make_lora(qwen3_dir, spec, seed=0)[1]
    key = next(k for k in tensors if "lora_" not in k)  # lm_head's base weight, saved by peft
    tensors[key] = tensors[key] + 1.0
    with pytest.raises(ValueError, match="differs from the shared base weight"):
        qwen3.load_version("bad-base", tensors, spec)
    assert not qwen3.has_version("bad-base")


# ---------------------------------------------------------------------------
# Bad requests


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n": 0}, "num_samples"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"stop_token_ids": (100_000,)}, "stop"),
        ({"stop_strings": ("",)}, "stop"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
        ({"topk_prompt_logprobs": 100_000}, "topk_prompt_logprobs"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_request_names_the_field(llama: TorchSampler, prompt: np.ndarray, change: dict, field: str) -> None:
    kwargs = {"n": 1, "max_tokens": 1} | change
    n = kwargs.pop("n")
    with pytest.raises(BadRequest, match=field) as info:
        llama.sample(None, job(prompt, n, **kwargs))
    assert info.value.key is not None and info.value.key.endswith(field)


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        (np.array([], dtype=np.int64), "empty"),
        (np.array([1, 384], dtype=np.int64), "384"),  # the tiny vocabulary is 384 tokens
        (np.full(1024, 1, dtype=np.int64), "1024"),  # a prompt filling the whole context
    ],
    ids=["empty", "id-out-of-range", "at-context"],
)
def test_bad_prompt_is_refused(llama: TorchSampler, prompt: np.ndarray, reason: str) -> None:
    with pytest.raises(BadRequest, match=f"prompt: .*{reason}"):
        llama.sample(None, job(prompt, max_tokens=1))


def test_statistics_count_requests_samples_and_tokens(llama_dir: Path, prompt: np.ndarray) -> None:
    sampler = TorchSampler(llama_dir, CPU)
    sampler.sample(None, job(prompt, 3, max_tokens=4, seed=0, stop_at_eos=False))
    stats = sampler.statistics()
    assert (stats.requests_done, stats.samples_done, stats.tokens_generated) == (1, 3, 12)
    assert stats.prompt_tokens_prefilled == len(prompt) and stats.versions_loaded == 0


def test_a_version_loaded_into_a_dropped_versions_adapter_samples_as_a_fresh_load(
    qwen3_dir: Path, prompt: np.ndarray
) -> None:
    spec = LoraSpec(rank=4)
    _, first = make_lora(qwen3_dir, spec, seed=1)
    _, second = make_lora(qwen3_dir, spec, seed=2)
    reused, fresh = TorchSampler(qwen3_dir, CPU), TorchSampler(qwen3_dir, CPU)
    long_prompt = np.tile(prompt, 48 // len(prompt) + 1)[:48]  # whole blocks for the prefix cache to hold
    sample = job(long_prompt, 2, max_tokens=6, seed=3, stop_at_eos=False)
    reused.load_version("first", first, spec)
    reused.sample("first", sample)  # its prompt's KV is cached under the adapter the second version takes
    reused.drop_version("first")
    reused.load_version("second", second, spec)
    fresh.load_version("second", second, spec)
    fresh.sample("second", sample)  # both engines then hold the prompt's prefix, each its own
    got, expected = reused.sample("second", sample), fresh.sample("second", sample)
    for x, y in zip(got.sequences, expected.sequences, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    stats = reused.statistics()
    assert (stats.adapters_made, stats.adapters_reused, stats.adapters_free) == (1, 1, 0)


def test_a_version_of_another_shape_gets_an_adapter_of_its_own(qwen3_dir: Path) -> None:
    sampler = TorchSampler(qwen3_dir, CPU)
    sampler.load_version("rank 4", make_lora(qwen3_dir, LoraSpec(rank=4), seed=1)[1], LoraSpec(rank=4))
    sampler.drop_version("rank 4")
    sampler.load_version("rank 2", make_lora(qwen3_dir, LoraSpec(rank=2), seed=1)[1], LoraSpec(rank=2))
    stats = sampler.statistics()
    assert (stats.adapters_made, stats.adapters_reused, stats.adapters_free) == (2, 0, 1)


def test_at_most_four_dropped_versions_keep_their_adapters(qwen3_dir: Path) -> None:
    spec = LoraSpec(rank=2)
    tensors = make_lora(qwen3_dir, spec, seed=1)[1]
    sampler = TorchSampler(qwen3_dir, CPU)
    for n in range(6):
        sampler.load_version(f"v{n}", tensors, spec)
    for n in range(6):
        sampler.drop_version(f"v{n}")
    stats = sampler.statistics()
    assert (stats.versions_loaded, stats.adapters_free) == (0, 4)


def test_misshapen_tensors_are_refused_by_a_free_adapter_and_the_next_version_loads(qwen3_dir: Path) -> None:
    spec = LoraSpec(rank=2)
    tensors = make_lora(qwen3_dir, spec, seed=1)[1]
    sampler = TorchSampler(qwen3_dir, CPU)
    sampler.load_version("first", tensors, spec)
    sampler.drop_version("first")
    key = next(k for k in tensors if "lora_A" in k)
    bad = dict(tensors) | {key: torch.zeros(3, tensors[key].shape[1])}
    with pytest.raises(ValueError, match=rf"tensors do not match LoraSpec .*misshapen \['{key}'\]"):
        sampler.load_version("bad", bad, spec)
    sampler.load_version("good", tensors, spec)
    assert (sampler.has_version("bad"), sampler.has_version("good")) == (False, True)
