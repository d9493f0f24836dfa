"""The vLLM sampler engine without vLLM: the clear error when it is absent, and the engine glue.

vLLM is not installed here (it needs CUDA). The glue (fan-out of samples, versions as
adapter directories under fresh names, cancel, sleep) runs against a small fake of
vLLM's `LLM` surface (fake_vllm.py), the edge we cannot reach; the real engine runs in
bench/gpu_check.py on a GPU. The pure mapping is tested in test_vllm_mapping.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

# vLLM, the edge we cannot reach: its output types (vllm_outputs.py) and its engine (fake_vllm.py).
from fake_vllm import GIB, FakeEngine, FakeLoRARequest, VLLMValidationError, install_fake_vllm
from vllm_outputs import PROMPT, VOCAB, Completion, Logprob, job

from openrld.batches import LoraSpec
from openrld.errors import BadRequest
from openrld.gpu import models, offload, vllm_mapping, vllm_sampler
from openrld.gpu.checkpoint import read_tensors
from openrld.gpu.sample_alone import ALONE_REQUEST_ID
from openrld.gpu.sampling_math import stream_seed
from openrld.gpu.vllm_sampler import VllmSampler, VllmUnavailable


def completion(tokens: list[int], finish_reason: str = "length") -> Completion:
    return Completion(token_ids=tokens, logprobs=[{t: Logprob(-0.25)} for t in tokens], finish_reason=finish_reason)


# ---------------------------------------------------------------------------
# Lazy import


def test_module_imports_without_vllm_and_require_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, even where it is
    with pytest.raises(VllmUnavailable, match=r"needs the 'vllm' package, which is not installed .*`make vllm-env`"):
        vllm_sampler.require_vllm()


def test_the_install_hint_never_advises_installing_vllm_into_the_daemon() -> None:
    assert "pip install vllm" not in vllm_sampler.INSTALL_HINT
    assert "[workers] vllm_python" in vllm_sampler.INSTALL_HINT


def test_building_the_engine_without_vllm_names_the_package(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VllmUnavailable, match="'vllm' package"):
        VllmSampler(tiny_llama, torch.device("cuda:0"))


def test_building_the_engine_on_a_cpu_device_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(VllmUnavailable, match="runs on a CUDA device; this node's device is cpu"):
        VllmSampler(tiny_llama, torch.device("cpu"))


def test_a_gpu_other_than_cuda0_in_the_daemons_process_is_refused_naming_vllm_python(tiny_llama: Path) -> None:
    with pytest.raises(VllmUnavailable, match=r"asked for cuda:3 in the daemon's own process: set \[workers\] vllm_python"):
        VllmSampler(tiny_llama, torch.device("cuda:3"))


# ---------------------------------------------------------------------------
# The engine glue, against a fake of vLLM's LLM surface


@pytest.fixture
def engine(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> VllmSampler:
    install_fake_vllm(monkeypatch)
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
    # Every family's attention names (vLLM takes the safetensors keys as the truth; a name the
    # model lacks in target_modules is ignored, as peft ignores it).
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (2, 32, sorted(models.ATTN_MODULES))
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


# ---------------------------------------------------------------------------
# What vLLM refuses is a 400 for that request; the engine keeps serving


def test_temperature_above_two_is_a_400_naming_it_and_the_engine_keeps_serving(engine: VllmSampler) -> None:
    with pytest.raises(BadRequest, match=r"sampling_params.temperature: expected at most 2.0 .* got 2.5") as refused:
        engine.add("hot", None, job(1, max_tokens=2, temperature=2.5))
    assert refused.value.key == "sampling_params.temperature"
    assert not engine.has_work() and fake(engine).added == []
    assert len(engine.sample(None, job(1, max_tokens=2, temperature=2.0, stop_at_eos=False)).sequences[0].tokens) == 2


def test_temperature_below_one_hundredth_is_refused_not_sampled_at_another(engine: VllmSampler) -> None:
    # vLLM would sample at 0.01 and report log q at 0.01 (FakeSamplingParams clamps as it does).
    with pytest.raises(BadRequest, match=r"expected 0 \(greedy\) or at least 0.01 .* got 0.005"):
        engine.add("cold", None, job(1, max_tokens=2, temperature=0.005))
    assert fake(engine).added == []


def test_a_validation_error_vllm_raises_at_add_is_a_400_and_aborts_the_samples_added(engine: VllmSampler) -> None:
    fake(engine).refuse_at["r#1"] = VLLMValidationError("max_tokens must be at least 1, got 0.", parameter="max_tokens")
    with pytest.raises(BadRequest, match="the vLLM sampler refused the request: max_tokens must be at least 1") as refused:
        engine.add("r", None, job(3, max_tokens=2))
    assert refused.value.key == "sampling_params.max_tokens"
    assert fake(engine).aborted == ["r#0"] and not engine.has_work()


def test_a_stop_token_ends_a_sample_with_stop_and_the_token_kept(engine: VllmSampler) -> None:
    seed = stream_seed(11, 0) & vllm_mapping.SEED_MASK
    stop_id = (seed + 1) % VOCAB  # the sample's second token
    result = engine.sample(None, job(1, max_tokens=5, seed=11, stop_token_ids=(stop_id,)))
    assert result.sequences[0].tokens.tolist() == [seed % VOCAB, stop_id]
    assert result.sequences[0].stop_reason == "stop"


def test_cancel_mid_generation_aborts_and_step_never_waits_on_an_empty_vllm(engine: VllmSampler) -> None:
    engine.add("r", None, job(1, max_tokens=4, stop_at_eos=False))
    assert engine.step() == []  # one token of four
    assert engine.cancel("r")
    assert fake(engine).aborted == ["r#0"]
    assert engine.step() == []  # the fake's step() raises if called with nothing live


# ---------------------------------------------------------------------------
# Starting on a shared device


def test_the_engine_starts_vllm_with_spawn_not_fork(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_vllm(monkeypatch)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    sampler = VllmSampler(tiny_llama, torch.device("cuda:0"), adapter_root=tmp_path / "a")
    assert sampler._llm.environment["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # type: ignore[attr-defined]


def test_a_replica_on_a_busy_device_takes_what_is_free_not_the_configured_share(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first replica holds 0.5 of the 139 GiB and a trainer 30 GiB: 39.5 GiB free, 1 GiB kept
    # back for the new engine's CUDA context: floor(38.5 / 139, 3 places) = 0.276.
    install_fake_vllm(monkeypatch, free_bytes=int(39.5 * GIB))
    sampler = VllmSampler(tiny_llama, torch.device("cuda:0"), adapter_root=tmp_path / "a")
    assert sampler._llm.kwargs["gpu_memory_utilization"] == 0.276  # type: ignore[attr-defined]
    assert sampler.statistics().gpu_memory_utilization == 0.276


def test_a_device_too_full_for_the_weights_is_refused_with_the_figures(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_vllm(monkeypatch, free_bytes=GIB + (100 << 20))  # 100 MiB past the start margin
    with pytest.raises(VllmUnavailable, match=r"needs 0\.\d\d GiB .* but 1\.10 of 139\.00 GiB is free"):
        VllmSampler(tiny_llama, torch.device("cuda:0"), adapter_root=tmp_path / "a")


def test_the_vllm_worker_gets_its_gpu_through_cuda_visible_devices_and_sees_it_as_cuda0(tmp_path: Path) -> None:
    from openrld.worker.hosting import WorkerHosting
    from openrld.worker.launchers import WorkerSpec
    from openrld.worker.launchers.process import ProcessLauncher
    from openrld.worker.protocol import Start

    seen = tmp_path / "env"
    probe = f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])"
    hosting = WorkerHosting(vllm=ProcessLauncher(sys.executable, ("-c", probe)))
    launcher = hosting.launcher_for("vllm_sampler")
    spec = WorkerSpec(name="vllm", role="sampler", start=Start("vllm_sampler", "/m", "cuda:3"))
    worker = launcher.launch(spec, str(tmp_path / "s.sock"), {})  # type: ignore[union-attr]
    worker.stop(30)
    hosting.close()
    assert (seen.read_text(), worker.device) == ("3", "cuda:0")  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# Adapters on lm_head, for architectures vLLM takes no LoRA on it


def qwen2_labelled(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny Llama under a config.json naming Qwen2ForCausalLM, as vLLM reads architectures."""
    directory = tmp_path / "qwen2-labelled"
    shutil.copytree(tiny_llama, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    return directory


def test_a_version_training_lm_head_is_refused_for_qwen2_naming_train_unembed(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_vllm(monkeypatch)
    sampler = VllmSampler(qwen2_labelled(tiny_llama, tmp_path), torch.device("cuda:0"), adapter_root=tmp_path / "a")
    with pytest.raises(BadRequest, match=r"cannot load a LoRA on lm_head for Qwen2ForCausalLM") as refused:
        sampler.load_version("v", {}, LoraSpec(rank=2, train_unembed=True))
    assert refused.value.key == "lora_config.train_unembed"
    assert len(fake(sampler).loras) == 0


def test_a_vllm_node_refuses_an_lm_head_adapter_on_qwen2_when_the_model_is_created(tiny_llama: Path, tmp_path: Path) -> None:
    from openrld.model_catalog import ModelEntry
    from openrld.worker.engines import TorchEngineFactory

    directory = qwen2_labelled(tiny_llama, tmp_path)
    model = ModelEntry(name="qwen2", directory=str(directory), arch="llama", max_context=64)
    factory = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=512, vllm=vllm_sampler.VllmSamplerConfig())
    trainer = factory.trainer(model)()
    with pytest.raises(BadRequest, match=r"lora_config.train_unembed: this node samples LoRA adapters with vLLM") as refused:
        trainer.add_adapter("m", LoraSpec(rank=2, train_unembed=True))
    assert refused.value.key == "lora_config.train_unembed"
    trainer.add_adapter("m", LoraSpec(rank=2, train_unembed=False))  # without lm_head it trains
    torch_node = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=512).trainer(model)()
    torch_node.add_adapter("m", LoraSpec(rank=2, train_unembed=True))  # the torch sampler serves lm_head
