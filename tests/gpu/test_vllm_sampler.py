"""The vLLM sampler engine without vLLM: the clear error when it is absent, and the engine glue.

vLLM is not installed here (it needs CUDA). The glue (fan-out of samples, versions as
adapter directories under fresh names, cancel, sleep) runs against a small fake of
vLLM's `LLM` surface, the edge we cannot reach; the real engine runs in
bench/gpu_check.py on a GPU. The pure mapping is tested in test_vllm_mapping.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from openrld.batches import LoraSpec
from openrld.gpu import offload, vllm_mapping, vllm_sampler
from openrld.gpu.lora_io import read_tensors
from openrld.gpu.sample_alone import ALONE_REQUEST_ID
from openrld.gpu.sampling_math import stream_seed
from openrld.gpu.vllm_sampler import VllmSampler, VllmUnavailable

# vLLM's output types, the edge we cannot reach (built in vllm_outputs.py).
from vllm_outputs import PROMPT, VOCAB, Completion, Logprob, Output, job


def completion(tokens: list[int], finish_reason: str = "length") -> Completion:
    return Completion(token_ids=tokens, logprobs=[{t: Logprob(-0.25)} for t in tokens], finish_reason=finish_reason)


# ---------------------------------------------------------------------------
# Lazy import


def test_module_imports_without_vllm_and_require_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, even where it is
    with pytest.raises(VllmUnavailable, match=r"needs the 'vllm' package, which is not installed .*pip install vllm"):
        vllm_sampler.require_vllm()


def test_building_the_engine_without_vllm_names_the_package(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VllmUnavailable, match="'vllm' package"):
        VllmSampler(tiny_llama, torch.device("cuda:0"))


def test_building_the_engine_on_a_cpu_device_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(VllmUnavailable, match="runs on the process's cuda:0; this node's device is cpu"):
        VllmSampler(tiny_llama, torch.device("cpu"))


# ---------------------------------------------------------------------------
# The engine glue, against a fake of vLLM's LLM surface


class FakeEngine:
    """Finishes every request in the step after it is added: token j of a sample is
    (its seed + j) % VOCAB, stopping at a stop id; every logprob is -0.25."""

    def __init__(self, vocab: int, context: int) -> None:
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=context)
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)
        self.added: list[tuple[str, list[int], object, object]] = []
        self.live: dict[str, tuple[list[int], object]] = {}
        self.aborted: list[str] = []
        self.loras: dict[int, object] = {}
        self.calls: list[str] = []

    def add_request(self, request_id: str, prompt: dict, params: object, lora_request: object = None) -> str:
        self.added.append((request_id, prompt["prompt_token_ids"], params, lora_request))
        self.live[request_id] = (prompt["prompt_token_ids"], params)
        return request_id

    def step(self) -> list[Output]:
        outputs = []
        for request_id, (prompt, params) in self.live.items():
            kw = params.kwargs  # type: ignore[attr-defined]
            tokens = []
            for j in range(kw["max_tokens"]):
                tokens.append(((kw["seed"] or 0) + j) % VOCAB)
                if tokens[-1] in kw["stop_token_ids"]:
                    break
            rows = None
            if kw["prompt_logprobs"] is not None:
                rows = [None] + [{t: Logprob(-1.0)} for t in prompt[1:]]
            outputs.append(Output(request_id, [completion(tokens)], prompt_logprobs=rows))
        self.live.clear()
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.live.pop(request_id)

    def add_lora(self, request: object) -> bool:
        self.loras[request.int_id] = request  # type: ignore[attr-defined]
        return True

    def remove_lora(self, int_id: int) -> bool:
        del self.loras[int_id]
        return True

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


class FakeLLM:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.llm_engine = FakeEngine(VOCAB, 64)

    def sleep(self, level: int) -> None:
        self.llm_engine.calls.append(f"sleep({level})")

    def wake_up(self) -> None:
        self.llm_engine.calls.append("wake_up")


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def int_id(self) -> int:
        return self.lora_int_id


class FakeSamplingParams:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


@pytest.fixture
def engine(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> VllmSampler:
    root = types.ModuleType("vllm")
    root.LLM = FakeLLM  # type: ignore[attr-defined]
    root.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = FakeLoRARequest  # type: ignore[attr-defined]
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="final_only")  # type: ignore[attr-defined]
    for name, module in (("vllm", root), ("vllm.lora", types.ModuleType("vllm.lora")),
                         ("vllm.lora.request", lora_request), ("vllm.sampling_params", sampling_params)):
        monkeypatch.setitem(sys.modules, name, module)
    return VllmSampler(tiny_llama, torch.device("cuda:0"), adapter_root=tmp_path / "adapters")


def fake(engine: VllmSampler) -> FakeEngine:
    return engine._engine  # type: ignore[return-value]


def test_engine_is_built_with_processed_logprobs_lora_and_sleep_mode(engine: VllmSampler) -> None:
    kwargs = engine._llm.kwargs  # type: ignore[attr-defined]
    assert (kwargs["logprobs_mode"], kwargs["enable_lora"], kwargs["enable_sleep_mode"]) == ("processed_logprobs", True, True)
    assert (kwargs["enable_prefix_caching"], kwargs["max_lora_rank"], kwargs["gpu_memory_utilization"]) == (True, 128, 0.5)


def test_a_request_fans_out_one_seeded_vllm_request_per_sample(engine: VllmSampler) -> None:
    result = engine.sample(None, job(3, max_tokens=2, seed=99))
    added = fake(engine).added
    assert [a[0] for a in added] == [f"{ALONE_REQUEST_ID}#{i}" for i in range(3)]
    assert all(a[1] == PROMPT.tolist() and a[3] is None for a in added)
    assert [a[2].kwargs["output_kind"] for a in added] == ["final_only"] * 3  # type: ignore[attr-defined]
    seeds = [stream_seed(99, i) & vllm_mapping.SEED_MASK for i in range(3)]
    assert [s.tokens.tolist() for s in result.sequences] == [[s % VOCAB, (s + 1) % VOCAB] for s in seeds]


def test_a_version_loads_as_a_peft_adapter_under_a_fresh_name(engine: VllmSampler, tmp_path: Path) -> None:
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 64), 0.5),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((64, 2), 0.25),
        "base_model.model.lm_head.base_layer.weight": torch.zeros(VOCAB, 64),
    }
    spec = LoraSpec(rank=2, train_mlp=False, train_unembed=False)
    engine.load_version("v-a", tensors, spec)
    directory = tmp_path / "adapters" / "openrld-v1"
    written = read_tensors(directory / "adapter_model.safetensors")
    assert sorted(written) == sorted(k for k in tensors if "lora_" in k)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (2, 32, ["k_proj", "o_proj", "q_proj", "v_proj"])
    engine.sample("v-a", job(1, max_tokens=1))
    assert fake(engine).added[-1][3] == FakeLoRARequest("openrld-v1", 1, str(directory))
    engine.drop_version("v-a")
    engine.load_version("v-a", tensors, spec)  # the same version name comes back as a new adapter
    assert not directory.exists()
    assert list(fake(engine).loras) == [2]


def test_cancel_aborts_the_samples_still_in_vllm(engine: VllmSampler) -> None:
    engine.add("r", None, job(2, max_tokens=3))
    assert engine.cancel("r") and not engine.has_work()
    assert fake(engine).aborted == ["r#0", "r#1"]
    assert engine.step() == []


def test_sleep_drops_the_prefix_cache_first_and_refuses_live_requests(engine: VllmSampler) -> None:
    engine.add("r", None, job(1, max_tokens=3))
    with pytest.raises(offload.CannotPark, match=r"live requests \['r'\]"):
        engine.sleep()
    engine.step()
    engine.sleep()
    with pytest.raises(offload.EngineParked, match="step on a sleeping vLLM sampler"):
        engine.step()
    engine.wake()
    assert fake(engine).calls == ["reset_prefix_cache", "sleep(1)", "wake_up"]
