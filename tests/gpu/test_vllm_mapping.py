"""The vLLM mapping without vLLM: parameter translation, adapter naming, result mapping.

vLLM is not installed here (it needs CUDA). Its outputs are built in this file as
dataclasses with the fields of vllm.outputs.RequestOutput / CompletionOutput and
vllm.logprobs.Logprob, the edge we cannot reach. Expected values are exact: the
mapping copies and sorts numbers, it never computes them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

# vLLM's output types, the edge we cannot reach (built in vllm_outputs.py).
from vllm_outputs import EOS, PROMPT, VOCAB, Completion, Logprob, Output, job

from openrld.batches import SampleJob
from openrld.errors import BadRequest
from openrld.gpu import vllm_mapping
from openrld.gpu.sampling_math import TOPK_EMPTY_LOGPROB, stream_seed
from openrld.gpu.vllm_mapping import AdapterNames, AdapterSlot, ChildParams, child_params, to_sample_result

# ---------------------------------------------------------------------------
# Parameter translation


DEFAULTS = dict(
    n=1, max_tokens=10, temperature=1.0, top_p=1.0, top_k=-1, seed=None, stop=[], stop_token_ids=[],
    ignore_eos=False, include_stop_str_in_output=True, logprobs=0, prompt_logprobs=None,
    skip_special_tokens=False, spaces_between_special_tokens=False, detokenize=True,
)


@pytest.mark.parametrize(
    ("sample", "changes"),
    [
        (job(max_tokens=10), {}),
        (job(max_tokens=10, temperature=0.7, top_p=0.9, top_k=40), {"temperature": 0.7, "top_p": 0.9, "top_k": 40}),
        (job(max_tokens=10, top_k=VOCAB), {}),
        (job(max_tokens=10, top_k=0), {}),
        (job(max_tokens=10, stop_strings=("\n\n", "User:")), {"stop": ["\n\n", "User:"]}),
        (job(max_tokens=10, stop_token_ids=(3, 9)), {"stop_token_ids": [3, 9]}),
        (job(max_tokens=10, stop_at_eos=False), {"ignore_eos": True}),
        (job(max_tokens=10, topk_sample_logprobs=5), {"logprobs": 5}),
        (job(max_tokens=10, prompt_logprobs=True), {"prompt_logprobs": 0}),
        (job(max_tokens=10, prompt_logprobs=True, topk_prompt_logprobs=3), {"prompt_logprobs": 3}),
        (job(max_tokens=10, seed=1234), {"seed": stream_seed(1234, 0) & vllm_mapping.SEED_MASK}),
    ],
    ids=["defaults", "temperature-top_p-top_k", "top_k-of-whole-vocab", "top_k-0", "stop-strings",
         "stop-token-ids", "stop-empty-list-ignores-eos", "topk-sample-logprobs", "prompt-logprobs",
         "topk-prompt-logprobs", "seed"],
)
def test_child_params_translate_every_sampling_field(sample: SampleJob, changes: dict[str, object]) -> None:
    assert child_params(sample, 0, 10, VOCAB) == ChildParams(**{**DEFAULTS, **changes})


def test_each_sample_gets_its_own_seed_stream_and_only_sample_0_scores_the_prompt() -> None:
    sample = job(3, max_tokens=4, seed=2**70 + 5, prompt_logprobs=True)
    children = [child_params(sample, i, 4, VOCAB) for i in range(3)]
    assert [c.seed for c in children] == [stream_seed(2**70 + 5, i) & vllm_mapping.SEED_MASK for i in range(3)]
    assert len({c.seed for c in children}) == 3 and all(0 <= c.seed < 2**63 for c in children)  # type: ignore[operator]
    assert [c.prompt_logprobs for c in children] == [0, None, None]


def test_max_tokens_0_asks_vllm_for_one_token_to_discard() -> None:
    assert child_params(job(max_tokens=0, prompt_logprobs=True), 0, 0, VOCAB).max_tokens == 1


def test_generation_limit_is_max_tokens_or_what_the_context_leaves() -> None:
    assert vllm_mapping.generation_limit(job(max_tokens=10), context=100) == 10
    assert vllm_mapping.generation_limit(job(max_tokens=None), context=100) == 96  # 100 - 4 prompt tokens
    assert vllm_mapping.generation_limit(job(max_tokens=500), context=100) == 96


def test_topk_over_the_vllm_cap_is_400_naming_field_and_cap() -> None:
    with pytest.raises(BadRequest, match=r"topk_sample_logprobs: expected at most 20 \(this sampler's cap\), got 21"):
        vllm_mapping.check_logprob_caps(job(topk_sample_logprobs=21), 20)


# ---------------------------------------------------------------------------
# Adapter names


def test_adapter_names_are_never_reused_even_after_a_version_is_dropped() -> None:
    names = AdapterNames()
    first = names.assign("tinker://run/sampler_weights/a")
    names.release("tinker://run/sampler_weights/a")
    again = names.assign("tinker://run/sampler_weights/a")  # same version name, loaded again
    other = names.assign("session-7")
    assert (first, again, other) == (
        AdapterSlot(name="openrld-v1", int_id=1), AdapterSlot(name="openrld-v2", int_id=2), AdapterSlot(name="openrld-v3", int_id=3)
    )


def test_assigning_a_loaded_version_again_is_refused() -> None:
    names = AdapterNames()
    names.assign("v")
    with pytest.raises(ValueError, match="already loaded; versions are immutable"):
        names.assign("v")


def test_unknown_version_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="'v' is not loaded"):
        AdapterNames().get("v")


@pytest.mark.parametrize(("rank", "expected"), [(1, 8), (8, 8), (128, 128), (200, 256), (300, 320), (512, 512)])
def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts(rank: int, expected: int) -> None:
    assert vllm_mapping.vllm_max_lora_rank(rank) == expected


def test_max_lora_rank_above_vllms_largest_is_refused() -> None:
    with pytest.raises(ValueError, match="max_lora_rank 513 is above vLLM's largest, 512"):
        vllm_mapping.vllm_max_lora_rank(513)


def test_only_lora_tensors_go_to_vllm() -> None:
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(4, 2),
        "base_model.model.lm_head.base_layer.weight": torch.zeros(8, 4),
    }
    assert sorted(vllm_mapping.lora_tensors_only(tensors)) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]


# ---------------------------------------------------------------------------
# Result mapping


def completion(tokens: list[int], finish_reason: str = "length", extra: dict[int, float] | None = None) -> Completion:
    """Each position: the sampled token at -0.25 plus `extra` alternatives."""
    rows = [{t: Logprob(-0.25), **{k: Logprob(v) for k, v in (extra or {}).items() if k != t}} for t in tokens]
    return Completion(token_ids=tokens, logprobs=rows, finish_reason=finish_reason)


def test_sampled_logprobs_are_the_sampled_tokens_entries() -> None:
    result = to_sample_result(job(max_tokens=3), [Output("r#0", [completion([11, 12, 13])])], 3, frozenset({EOS}))
    sequence = result.sequences[0]
    assert sequence.tokens.tolist() == [11, 12, 13]
    assert sequence.tokens.dtype == np.int32 and sequence.logprobs.dtype == np.float32
    assert sequence.logprobs.tolist() == [-0.25, -0.25, -0.25]
    assert (sequence.stop_reason, sequence.topk, result.prompt_logprobs) == ("length", None, None)


def test_topk_rows_sort_by_logprob_then_id_and_pad_with_the_sentinel() -> None:
    # Sampled 11 (-0.25); alternatives 4 and 2 tie at -1.5; 9 is outside q's support (-inf).
    sample = job(max_tokens=1, topk_sample_logprobs=5)
    out = Output("r#0", [completion([11], extra={4: -1.5, 2: -1.5, 9: -math.inf})])
    topk = to_sample_result(sample, [out], 1, frozenset({EOS})).sequences[0].topk
    assert topk is not None
    assert topk.token_ids.tolist() == [[11, 2, 4, 0, 0]]
    assert topk.logprobs.tolist() == [[-0.25, -1.5, -1.5, TOPK_EMPTY_LOGPROB, TOPK_EMPTY_LOGPROB]]


def test_greedy_reports_zero_logprobs_and_a_point_mass() -> None:
    sample = job(max_tokens=2, temperature=0.0, topk_sample_logprobs=2)
    sequence = to_sample_result(sample, [Output("r#0", [completion([7, 8], extra={3: -2.0})])], 2, frozenset()).sequences[0]
    assert sequence.logprobs.tolist() == [0.0, 0.0]
    assert sequence.topk is not None
    assert sequence.topk.token_ids.tolist() == [[7, 0], [8, 0]]
    assert sequence.topk.logprobs.tolist() == [[0.0, TOPK_EMPTY_LOGPROB], [0.0, TOPK_EMPTY_LOGPROB]]


@pytest.mark.parametrize(
    ("tokens", "finish_reason", "stop_kwargs", "expected"),
    [
        ([11, EOS], "length", {}, "stop"),  # EOS on the last allowed token is still a stop
        ([11, EOS], "length", {"stop_at_eos": False}, "length"),  # stop=[]: EOS is an ordinary token
        ([11, 3], "stop", {"stop_token_ids": (3,)}, "stop"),
        ([11, 12], "stop", {"stop_strings": ("ab",)}, "stop"),  # vLLM matched a stop string
        ([11, 12], "length", {}, "length"),
    ],
    ids=["eos-on-last-token", "eos-ignored", "stop-id", "stop-string", "length"],
)
def test_stop_reason_follows_the_spec(tokens: list[int], finish_reason: str, stop_kwargs: dict, expected: str) -> None:
    sample = job(max_tokens=2, **stop_kwargs)
    out = Output("r#0", [completion(tokens, finish_reason)])
    assert to_sample_result(sample, [out], 2, frozenset({EOS})).sequences[0].stop_reason == expected


def test_an_aborted_sample_is_an_error_not_a_result() -> None:
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        to_sample_result(job(max_tokens=2), [Output("r#0", [completion([11], "abort")])], 2, frozenset())


def test_prompt_logprobs_are_nan_before_the_last_n_and_topk_rows_follow() -> None:
    rows = [None] + [{int(t): Logprob(-1.0 - p), 1: Logprob(-0.5)} for p, t in enumerate(PROMPT[1:], start=1)]
    sample = job(max_tokens=1, prompt_logprobs=True, prompt_logprobs_last_n=2, topk_prompt_logprobs=1)
    out = Output("r#0", [completion([11])], prompt_logprobs=rows)
    result = to_sample_result(sample, [out], 1, frozenset())
    assert result.prompt_logprobs is not None and result.topk_prompt is not None
    np.testing.assert_array_equal(result.prompt_logprobs, np.array([np.nan, np.nan, -3.0, -4.0], np.float32))
    assert result.topk_prompt.token_ids.tolist() == [[0], [0], [1], [1]]
    assert result.topk_prompt.logprobs.tolist() == [[TOPK_EMPTY_LOGPROB]] * 2 + [[-0.5], [-0.5]]


def test_prompt_cache_hit_tokens_is_the_best_sample_counted_once() -> None:
    outs = [Output(f"r#{i}", [completion([11])], num_cached_tokens=c) for i, c in enumerate((0, 4, 4))]
    assert to_sample_result(job(3, max_tokens=1), outs, 1, frozenset()).prompt_cache_hit_tokens == 4


def test_max_tokens_0_returns_empty_length_sequences_with_prompt_scores() -> None:
    rows = [None] + [{int(t): Logprob(-2.0)} for t in PROMPT[1:]]
    out = Output("r#0", [completion([11])], prompt_logprobs=rows)
    result = to_sample_result(job(2, max_tokens=0, prompt_logprobs=True), [out], 0, frozenset())
    assert [(s.tokens.tolist(), s.stop_reason) for s in result.sequences] == [([], "length"), ([], "length")]
    np.testing.assert_array_equal(result.prompt_logprobs, np.array([np.nan, -2.0, -2.0, -2.0], np.float32))


# ---------------------------------------------------------------------------
# vLLM's limits, and its share of a device in use

GIB = 1 << 30


@pytest.mark.parametrize(
    ("temperature", "refused"),
    [(0.0, False), (0.01, False), (1.0, False), (2.0, False), (2.5, True), (0.005, True), (1e-6, True)],
    ids=["greedy", "lowest", "one", "highest", "above-2", "below-0.01", "tiny"],
)
def test_vllm_temperature_range(temperature: float, refused: bool) -> None:
    if refused:
        with pytest.raises(BadRequest, match=r"^sampling_params.temperature: expected"):
            vllm_mapping.check_vllm_limits(job(temperature=temperature))
    else:
        vllm_mapping.check_vllm_limits(job(temperature=temperature))


@pytest.mark.parametrize(
    ("free_gib", "share"),
    [(139.0, 0.5), (70.0, 0.496), (40.0, 0.280)],
    ids=["idle-device", "half-taken", "replica-after-trainer"],
)
def test_memory_share_is_the_configured_one_lowered_to_what_is_free(free_gib: float, share: float) -> None:
    # 139 GiB device, 0.5 configured, 1 GiB kept for the engine's own CUDA context:
    # min(69.5, free - 1) / 139, rounded down to 1/1000.
    got = vllm_mapping.memory_share(free_bytes=int(free_gib * GIB), total_bytes=139 * GIB, wanted=0.5, weights_bytes=GIB)
    assert got == share


def test_memory_share_refuses_when_the_weights_and_a_kv_cache_do_not_fit() -> None:
    # 16 GiB of weights need 16 × 1.25 + 0.25 = 20.25 GiB; 11 GiB are free.
    expected = r"needs 20.25 GiB of device memory \(weights 16.00 GiB and a minimal KV cache\) but 11.00 of 139.00 GiB is free"
    with pytest.raises(ValueError, match=expected):
        vllm_mapping.memory_share(free_bytes=11 * GIB, total_bytes=139 * GIB, wanted=0.5, weights_bytes=16 * GIB)


def test_only_the_architectures_vllm_takes_no_lm_head_lora_on_are_refused() -> None:
    assert vllm_mapping.unembed_lora_refusal(["LlamaForCausalLM"]) is None
    assert "for Qwen2ForCausalLM" in (vllm_mapping.unembed_lora_refusal(["Qwen2ForCausalLM"]) or "")


# ---------------------------------------------------------------------------
# Model families: where each adapter tensor loads in vLLM (model_families.FAMILIES)


# The vLLM modules a LoRA on attention and MLP (and lm_head where vLLM takes one) loads into,
# per family: q/k/v pack into qkv_proj, gate/up into gate_up_proj, Qwen3.5's Gated DeltaNet
# in_proj_qkv/in_proj_z into in_proj_qkvz, and a MoE layer's two expert wrappers into experts.
VLLM_MODULES = {
    "llama": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"},
    "qwen2": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "qwen3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"},
    "mistral": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "olmo2": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"},
    "gemma3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gemma4": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "qwen3_5": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkvz", "out_proj", "lm_head"},
    "qwen3_moe": {"qkv_proj", "o_proj", "experts", "lm_head"},
    "qwen3_5_moe": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkvz", "out_proj", "experts", "lm_head"},
}
NO_LM_HEAD = ("qwen2", "mistral", "olmo2", "gemma3", "gemma4")


@pytest.fixture(scope="module")
def family_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[str]]]:
    """Per tiny family: its architecture and the keys of the adapter the LoRA trainer makes
    (attn, mlp, and lm_head where vLLM takes it)."""
    from openrld.batches import LoraSpec
    from openrld.gpu.tiny_models import FAMILIES, build_tiny_model
    from openrld.gpu.torch_trainer import TorchTrainer

    adapters = {}
    for family in FAMILIES:
        directory = build_tiny_model(tmp_path_factory.mktemp("families") / family, family)
        trainer = TorchTrainer(directory, torch.device("cpu"))
        trainer.add_adapter("job", LoraSpec(rank=2, seed=0, train_unembed=family not in NO_LM_HEAD))
        arch = json.loads((directory / "config.json").read_text())["architectures"][0]
        adapters[family] = (arch, sorted(vllm_mapping.lora_tensors_only(trainer.adapter_tensors("job"))))
    return adapters


@pytest.mark.parametrize("family", sorted(VLLM_MODULES))
def test_every_adapter_tensor_of_a_family_loads_into_a_vllm_module(family_adapters, family: str) -> None:
    arch, keys = family_adapters[family]
    modules = {key: vllm_mapping.vllm_lora_module(arch, key) for key in keys}
    assert [key for key, module in modules.items() if module is None] == []
    assert set(modules.values()) == VLLM_MODULES[family]


@pytest.mark.parametrize("family", sorted(VLLM_MODULES))
def test_lm_head_adapters_are_refused_for_exactly_the_families_vllm_takes_none_on(family_adapters, family: str) -> None:
    arch, _ = family_adapters[family]
    refusal = vllm_mapping.unembed_lora_refusal([arch])
    if family in NO_LM_HEAD:
        assert refusal is not None and f"cannot load a LoRA on lm_head for {arch};" in refusal
    else:
        assert refusal is None


def test_an_unknown_architecture_has_no_vllm_module() -> None:
    assert vllm_mapping.vllm_lora_module("MambaForCausalLM", "base_model.model.x.in_proj.lora_A.weight") is None


def test_a_module_vllm_takes_no_lora_on_maps_to_none() -> None:
    # Gemma 4's per-layer-input projections are plain Linear layers the trainer never targets.
    key = "base_model.model.model.layers.0.per_layer_projection.lora_A.weight"
    assert vllm_mapping.vllm_lora_module("Gemma4ForCausalLM", key) is None
