"""FusedForward: decode steps and prefills as flat torch calls, against Hugging Face's and peft's forwards.

The references run the same call through the model's own forward, on a copy of
the same left-padded KV batch for a decode step (what `TorchSampler` did
before the fused forward) and on the same prompt chunks for a prefill.
Tolerance 1e-5 in fp32: the same ops on the same rows, only kernels' blocking
and summation order may differ.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

from openrld.batches import LoraSpec, SampleJob, SamplingSpec
from openrld.gpu import fused_forward, models
from openrld.gpu.fused_forward import BASE_ADAPTER, FusedForward, unsupported_reason
from openrld.gpu.kv_batch import KvBatch, cache_tensors
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler

CPU = torch.device("cpu")
PROMPTS = ([5, 9, 13, 21, 34, 55], [7, 8], [40, 41, 42, 43])  # three rows of different lengths


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fused") / request.param, request.param)


def left_padded_batch(forward, config, adapters: list[str]) -> KvBatch:
    """Prefill each prompt alone through `forward` and join them into one KvBatch."""
    batch = KvBatch(config, CPU)
    for prompt, adapter in zip(PROMPTS, adapters):
        cache = transformers.DynamicCache(config=config)
        forward(torch.tensor([prompt]), cache, [adapter])
        batch.join([(cache_tensors(cache), 1)])
    return batch


def reference_step(forward, batch: KvBatch, tokens: torch.Tensor, adapters: list[str]) -> torch.Tensor:
    mask, positions = batch.mask_and_positions()
    return forward(tokens[:, None], batch.cache, adapters, attention_mask=mask, position_ids=positions)[:, -1]


def lora_model(model_dir: Path, adapters: dict[str, LoraSpec]) -> peft.PeftModel:
    """The base model with each named adapter, its lora_B random (as after training)."""
    torch.manual_seed(3)
    model = models.load_causal_lm(model_dir, CPU)
    wrapped = None
    for name, spec in adapters.items():
        if wrapped is None:
            wrapped = peft.get_peft_model(model, models.lora_config(spec), adapter_name=name)
        else:
            wrapped.add_adapter(name, models.lora_config(spec))
    wrapped.eval()
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return wrapped


def test_decode_step_matches_the_model_forward_on_left_padded_rows(model_dir: Path) -> None:
    model = models.load_causal_lm(model_dir, CPU)

    def forward(ids, cache, adapters, **kwargs):
        return model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits

    adapters = [BASE_ADAPTER] * len(PROMPTS)
    tokens = torch.tensor([3, 4, 5])
    with torch.inference_mode():
        batch = left_padded_batch(forward, model.config, adapters)
        reference_batch = copy.deepcopy(batch)
        expected = reference_step(forward, reference_batch, tokens, adapters)
        logits = FusedForward.for_model(model).decode(tokens, batch, adapters)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for (keys, values), layer in zip(((cached.keys, cached.values) for cached in batch.cache.layers), reference_batch.cache.layers):
        torch.testing.assert_close(keys, layer.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(values, layer.values, rtol=0, atol=1e-5)


def test_many_decode_steps_append_in_place_and_match_the_model_forward_at_every_step(model_dir: Path) -> None:
    """40 steps cross the first spare-room boundary (6 cached columns + 32 spare)."""
    model = models.load_causal_lm(model_dir, CPU)

    def forward(ids, cache, adapters, **kwargs):
        return model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits

    adapters = [BASE_ADAPTER] * len(PROMPTS)
    fused = FusedForward.for_model(model)
    moved = 0
    with torch.inference_mode():
        batch = left_padded_batch(forward, model.config, adapters)
        reference = copy.deepcopy(batch)
        for step in range(40):
            tokens = torch.tensor([step % 50 + 3, step % 7 + 3, step % 11 + 3])
            before = batch.cache.layers[0].keys.data_ptr() if step else None
            logits = fused.decode(tokens, batch, adapters)
            expected = reference_step(forward, reference, tokens, adapters)
            batch.advance()
            reference.advance()
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
            moved += before is not None and batch.cache.layers[0].keys.data_ptr() != before
    assert moved == 1  # the cache was copied once, when its first room ran out
    torch.testing.assert_close(batch.cache.layers[1].values, reference.cache.layers[1].values, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "row_adapters", [["a", BASE_ADAPTER, "b"], ["a", "a", "a"]], ids=["mixed", "one-for-all"]
)
def test_each_row_gets_its_own_adapter_as_in_peft_mixed_batch_forward(
    model_dir: Path, row_adapters: list[str]
) -> None:
    wrapped = lora_model(model_dir, {"a": LoraSpec(rank=4), "b": LoraSpec(rank=2, train_mlp=False)})

    def forward(ids, cache, adapters, **kwargs):
        return wrapped(input_ids=ids, cache=cache, use_cache=True, adapter_names=adapters, **kwargs).logits

    tokens = torch.tensor([3, 4, 5])
    with torch.inference_mode():
        batch = left_padded_batch(forward, wrapped.config, row_adapters)
        expected = reference_step(forward, copy.deepcopy(batch), tokens, row_adapters)
        logits = FusedForward.for_model(wrapped.base_model.model).decode(tokens, batch, row_adapters)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("adapter", [BASE_ADAPTER, "a"])
def test_prefill_in_chunks_matches_the_model_forward_and_fills_the_same_cache(model_dir: Path, adapter: str) -> None:
    wrapped = lora_model(model_dir, {"a": LoraSpec(rank=4)})
    prompt = torch.tensor([5, 9, 13, 21, 34, 55, 89, 3, 7, 11])
    fused = FusedForward.for_model(wrapped.base_model.model)
    with torch.inference_mode():
        expected = wrapped(input_ids=prompt[None], adapter_names=[adapter]).logits[0]
        reference_cache = transformers.DynamicCache(config=wrapped.config)
        wrapped(input_ids=prompt[None], cache=reference_cache, use_cache=True, adapter_names=[adapter])
        cache = transformers.DynamicCache(config=wrapped.config)
        first = fused.prefill(prompt[:4], cache, adapter, keep=4)  # chunks of 4, 4 and 2 tokens
        middle = fused.prefill(prompt[4:8], cache, adapter, keep=1)
        last = fused.prefill(prompt[8:], cache, adapter, keep=2)
    torch.testing.assert_close(first, expected[:4], rtol=0, atol=1e-5)
    torch.testing.assert_close(middle, expected[7:8], rtol=0, atol=1e-5)
    torch.testing.assert_close(last, expected[8:], rtol=0, atol=1e-5)
    for layer, reference in zip(cache.layers, reference_cache.layers):
        torch.testing.assert_close(layer.keys, reference.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer.values, reference.values, rtol=0, atol=1e-5)


def test_prompts_prefilled_together_match_each_prefilled_alone(model_dir: Path) -> None:
    wrapped = lora_model(model_dir, {"a": LoraSpec(rank=4)})
    fused = FusedForward.for_model(wrapped.base_model.model)
    prompts = [torch.tensor(p) for p in PROMPTS]
    adapters = ["a", BASE_ADAPTER, "a"]
    with torch.inference_mode():
        logits, caches = fused.prefill_many(prompts, adapters, keep=2)
        for row, (prompt, adapter) in enumerate(zip(prompts, adapters)):
            cache = transformers.DynamicCache(config=wrapped.config)
            alone = fused.prefill(prompt, cache, adapter, keep=2)
            torch.testing.assert_close(logits[row], alone, rtol=0, atol=1e-5)
            for (keys, values), (alone_keys, alone_values) in zip(caches[row], cache_tensors(cache)):
                assert keys.shape == alone_keys.shape == (1, wrapped.config.num_key_value_heads, len(prompt), 16)
                torch.testing.assert_close(keys, alone_keys, rtol=0, atol=1e-5)
                torch.testing.assert_close(values, alone_values, rtol=0, atol=1e-5)


def test_bfloat16_decode_and_prefill_match_the_model_forward(model_dir: Path) -> None:
    """The bf16 path (RMSNorm in fp32, cast back, as Hugging Face does), at torch's bf16 tolerance."""
    model = models.load_causal_lm(model_dir, CPU, torch.bfloat16)
    torch.manual_seed(5)
    with torch.no_grad():  # a fresh model's norm weights are all 1, which would hide their use
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    fused = FusedForward.for_model(model)
    prompt = torch.tensor(PROMPTS[0])
    with torch.inference_mode():
        expected = model(input_ids=torch.cat([prompt, torch.tensor([7])])[None]).logits[0, -1]
        cache = transformers.DynamicCache(config=model.config)
        fused.prefill(prompt, cache, BASE_ADAPTER, keep=1)
        batch = KvBatch(model.config, CPU)
        batch.join([(cache_tensors(cache), 1)])
        decoded = fused.decode(torch.tensor([7]), batch, [BASE_ADAPTER])[0]
        whole = transformers.DynamicCache(config=model.config)
        prefilled = fused.prefill(torch.cat([prompt, torch.tensor([7])]), whole, BASE_ADAPTER, keep=1)[0]
    assert decoded.dtype == prefilled.dtype == torch.bfloat16
    torch.testing.assert_close(decoded, expected)
    torch.testing.assert_close(prefilled, expected)


def test_rms_norm_on_the_cpu_equals_hugging_faces() -> None:
    """On the CPU, RMSNorm is computed as a layer norm of [x, -x]; it is the same function."""
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-6)
    torch.manual_seed(6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(3, 5, 48) * 4 + 1  # a mean far from 0, which a plain layer norm would remove
    with torch.inference_mode():
        got = fused_forward._rms(fused_forward._norm(norm), x)
        torch.testing.assert_close(got, norm(x), rtol=0, atol=1e-6)


def test_models_outside_the_llama_family_keep_the_hugging_face_forward() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    assert unsupported_reason(gpt2) == "model type 'gpt2' is not one of ['llama', 'mistral', 'qwen2', 'qwen3']"
    assert FusedForward.for_model(gpt2) is None


def test_sliding_window_attention_keeps_the_hugging_face_forward() -> None:
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
    )
    assert unsupported_reason(transformers.MistralForCausalLM(config)) == "sliding-window attention"


def test_the_engine_samples_the_same_tokens_fused_or_not(model_dir: Path) -> None:
    """Two requests of different prompt lengths decode together; a seed fixes every token."""
    results = []
    for fused in (True, False):
        engine = TorchSampler(model_dir, CPU, fused_forward=fused)
        params = SamplingSpec(max_tokens=12, temperature=0.9, seed=11, stop_at_eos=False)
        engine.add("long", None, SampleJob(prompt=np.array(PROMPTS[0]), num_samples=3, params=params))
        engine.add("short", None, SampleJob(prompt=np.array(PROMPTS[1]), num_samples=2, params=params))
        finished = {}
        while engine.has_work():
            finished.update((done.request_id, done.result) for done in engine.step())
        results.append(finished)
    fused, plain = results
    for request_id in ("long", "short"):
        for a, b in zip(fused[request_id].sequences, plain[request_id].sequences):
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
