"""A full fine-tuning job sampling on vLLM: FullTrainer's syncs patched into vLLM's weights in place.

vLLM is the edge we cannot reach: fake_vllm.py stands in for it, with vLLM 0.33's
signatures, a worker whose model fuses q/k/v and gate/up as vLLM's Llama does, and vLLM's
checkpoint patch loader. What runs for real: the trainer's payloads, their cut into
patches, the msgpack crossing into the engine process, the worker extension, the read back
and the digest check, and FullSampler's versions. Comparisons are bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from fake_vllm import FakeLLM, FusedLlama, install_fake_vllm

from openrld.batches import AdamParams, ForwardBackwardBatch, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import delta, vllm_weights
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.vllm_sampler import VllmSamplerConfig, VllmUnavailable
from openrld.model_catalog import ModelEntry
from openrld.worker.engines import TorchEngineFactory, vllm_full_options

CPU = torch.device("cpu")
TOKENS = np.arange(30, 46, dtype=np.int64)
DATA = [TrainDatum(tokens=TOKENS[:-1], inputs={"target_tokens": TOKENS[1:]})]
PROMPT = np.array([40, 41, 42, 43], dtype=np.int64)


def step(trainer: FullTrainer) -> None:
    batch = ForwardBackwardBatch(data=DATA, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    trainer.forward_backward("job", batch)
    trainer.optim_step("job", AdamParams(learning_rate=1e-3))


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(delta.bits(a[k]), delta.bits(b[k])) for k in a)


def snapshot(trainer: FullTrainer) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in trainer.sampler_tensors("job").items()}


@pytest.fixture
def trainer(tiny_llama: Path) -> FullTrainer:
    trainer = FullTrainer(tiny_llama, CPU, weight_sync="delta")
    trainer.add_adapter("job")
    return trainer


@pytest.fixture
def sampler(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> FullSampler:
    install_fake_vllm(monkeypatch)
    return vllm_weights.vllm_full_sampler(tiny_llama, torch.device("cuda:0"), VllmSamplerConfig(dtype="float32"))


def llm(sampler: FullSampler) -> FakeLLM:
    return sampler._inner._llm  # type: ignore[attr-defined,return-value]


def fused(sampler: FullSampler) -> dict[str, torch.Tensor]:
    model = llm(sampler).worker.model
    assert isinstance(model, FusedLlama)
    return model.fused_weights()


def crossed_bytes(monkeypatch: pytest.MonkeyPatch, sampler: FullSampler) -> list[int]:
    """The tensor bytes each openrld_patch_weights call carries into vLLM's engine process."""
    seen: list[int] = []
    worker = llm(sampler).worker
    apply = worker.openrld_patch_weights  # type: ignore[attr-defined]

    def counting(patches: list) -> int:
        decoded = msgspec.convert(patches, list[vllm_weights.WeightPatch])
        seen.append(sum(len(p.values) + len(p.indices or b"") for p in decoded))
        return apply(patches)

    monkeypatch.setattr(worker, "openrld_patch_weights", counting)
    return seen


def test_vllm_is_built_without_lora_and_with_the_weights_extension(sampler: FullSampler) -> None:
    kwargs = llm(sampler).kwargs
    assert (kwargs["enable_lora"], kwargs["worker_extension_cls"]) == (False, "openrld.gpu.vllm_weights.WeightsExtension")
    assert (kwargs["enable_sleep_mode"], kwargs["dtype"]) == (True, "float32")


@pytest.mark.parametrize("sync", ["full", "delta"])
def test_the_first_version_lands_in_vllms_fused_weights_with_the_trainers_bits(
    sampler: FullSampler, tiny_llama: Path, sync: str
) -> None:
    trainer = FullTrainer(tiny_llama, CPU, weight_sync=sync)
    trainer.add_adapter("job")
    step(trainer)
    payload = trainer.sampler_payload("job", "v1")
    # "full": every tensor whole; "delta" from the base vLLM started on: dense tensors where most
    # elements moved, and the embedding's rows of tokens the batch never saw left out.
    kinds = {t.indices is None for t in payload.tensors}
    assert (payload.mode, kinds) == (sync, {True} if sync == "full" else {True, False})
    sampler.load_version("v1", payload)
    weights = trainer.sampler_tensors("job")
    layer = "model.layers.0.self_attn."
    qkv = torch.cat([weights[f"{layer}{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(delta.bits(fused(sampler)[f"{layer}qkv_proj.weight"]), delta.bits(qkv))
    assert same_bits(sampler.live_weights(), weights)


def test_after_the_first_version_only_the_changed_elements_cross_into_vllm(
    sampler: FullSampler, trainer: FullTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    seen = crossed_bytes(monkeypatch, sampler)
    step(trainer)
    payload = trainer.sampler_payload("job", "v2")
    assert payload.mode == "delta" and any(t.indices is not None for t in payload.tensors)
    sampler.load_version("v2", payload)
    assert seen == [payload.bytes_moved]  # one chunk: the changed values and their int32 indices, nothing more
    assert payload.bytes_moved < payload.full_bytes
    assert same_bits(sampler.live_weights(), trainer.sampler_tensors("job"))


def test_a_corrupted_delta_is_a_weight_mismatch_and_the_version_is_not_loaded(
    sampler: FullSampler, trainer: FullTrainer
) -> None:
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    step(trainer)
    payload = trainer.sampler_payload("job", "v2")
    part = next(t for t in payload.tensors if t.indices is not None)
    part.values[0] += 1.0  # one element off: vLLM's read-back digest differs from the trainer's
    with pytest.raises(delta.WeightMismatch, match=r"weight version 'v2': sampler digest 0x[0-9a-f]{16} != trainer digest"):
        sampler.load_version("v2", payload)
    assert not sampler.has_version("v2")


def test_every_weight_change_drops_vllms_cached_prefixes(sampler: FullSampler, trainer: FullTrainer) -> None:
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    step(trainer)
    sampler.load_version("v2", trainer.sampler_payload("job", "v2"))
    assert llm(sampler).llm_engine.calls == ["reset_prefix_cache", "reset_prefix_cache"]


def test_a_change_that_arrives_while_asleep_lands_at_the_first_step_after_wake(
    sampler: FullSampler, trainer: FullTrainer
) -> None:
    step(trainer)
    sampler.park()  # vLLM's sleep: its weights are off the device, so nothing may patch them
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    sampler.resume()
    assert (llm(sampler).rpc_calls, sampler.has_work()) == ([], True)
    assert sampler.step() == []
    assert llm(sampler).rpc_calls == ["openrld_patch_weights", "openrld_weights_digest"]
    assert same_bits(sampler.live_weights(), trainer.sampler_tensors("job"))


def test_a_request_made_while_asleep_reaches_vllm_only_after_wake(sampler: FullSampler, trainer: FullTrainer) -> None:
    for version in ("v1", "v2"):
        step(trainer)
        sampler.load_version(version, trainer.sampler_payload("job", version))
    sampler.park()
    sampler.add("r", "v1", SampleJob(prompt=PROMPT, num_samples=1, params=SamplingSpec(max_tokens=1)))  # v2 is live
    assert (llm(sampler).llm_engine.added, sampler.statistics().requests_waiting_for_switch) == ([], 1)
    sampler.resume()
    finished = sampler.step()  # switches vLLM's weights to v1, then runs the request
    assert [f.request_id for f in finished] == ["r"] and sampler.statistics().live_version == "v1"


def test_an_older_version_samples_its_own_weights_after_a_delta(sampler: FullSampler, trainer: FullTrainer) -> None:
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    first = snapshot(trainer)
    step(trainer)
    sampler.load_version("v2", trainer.sampler_payload("job", "v2"))
    sampler.sample("v1", SampleJob(prompt=PROMPT, num_samples=1, params=SamplingSpec(max_tokens=2)))
    assert sampler.statistics().live_version == "v1"
    assert same_bits(sampler.live_weights(), first)


def test_nan_in_a_sparse_change_is_refused_by_name_before_vllm_sees_it() -> None:
    change = delta.compute_delta({"w": torch.tensor([1.0, float("nan"), 3.0])}, {"w": torch.tensor([1.0, 2.0, 3.0])}, None)
    with pytest.raises(ValueError, match=r"^w: the trainer's new values hold NaN"):
        list(vllm_weights.patches_of(change, {"w": (3,)}))


def test_patches_are_cut_into_chunks_of_at_most_the_bound() -> None:
    tensors = {name: torch.zeros(100) for name in ("a", "b", "c")}  # 400 bytes each, dense
    chunks = list(vllm_weights.patches_of(delta.full_update(tensors, None), dict.fromkeys(tensors, (100,)), chunk_bytes=800))
    assert [[p.name for p in chunk] for chunk in chunks] == [["a", "b"], ["c"]]


def test_a_patch_survives_msgpack_as_vllms_engine_process_decodes_it() -> None:
    values = torch.tensor([0.5, -2.0], dtype=torch.bfloat16)
    change = delta.WeightDelta(
        base_version="v1", tensors=[delta.TensorDelta("w", torch.tensor([3, 0], dtype=torch.int32), values)],
        digest=0, mode="delta", changed_elements=2, total_elements=6, full_bytes=12, compute_s=0.0,
    )
    (chunk,) = vllm_weights.patches_of(change, {"w": (2, 3)})
    (patch,) = msgspec.convert(msgspec.msgpack.decode(msgspec.msgpack.encode(chunk)), list[vllm_weights.WeightPatch])
    assert (patch.name, patch.shape, patch.dtype, patch.index_dtype) == ("w", [2, 3], "bfloat16", "int32")
    assert vllm_weights.tensor_from(patch.values, patch.dtype, [-1]).tolist() == [0.5, -2.0]
    assert vllm_weights.tensor_from(patch.indices or b"", patch.index_dtype, [-1]).tolist() == [3, 0]


class ScalingLoader(torch.nn.Module):
    """A model whose loader transforms the weight before its copy (as a loader that folds a
    scale in would): nothing it holds is a checkpoint tensor's bits."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        for _, tensor in weights:
            self.w.data.copy_(tensor * 2)
        return {"w"}


def test_reading_back_refuses_a_loader_that_transforms_the_weight_before_its_copy() -> None:
    with pytest.raises(vllm_weights.UnsupportedLoader, match=r"^w: vLLM's loader writes \[4\] torch.float32 from a tensor"):
        vllm_weights.read_back(ScalingLoader(), "w", (4,), torch.float32, CPU)


def test_a_vllm_node_gives_full_fine_tuning_the_vllm_sampler(tiny_llama: Path) -> None:
    # On this CPU node the vLLM engine refuses to start, which shows the factory chose it.
    factory = TorchEngineFactory(CPU, max_batch_tokens=64, vllm=VllmSamplerConfig())
    model = ModelEntry(name="tiny-llama", directory=str(tiny_llama), arch="llama", max_context=1024)
    with pytest.raises(VllmUnavailable, match=r"the vLLM sampler runs on a CUDA device; this node.s device is cpu"):
        factory.full_sampler(model)()


def test_the_full_samplers_vllm_holds_the_trainers_dtype_where_the_node_says_auto() -> None:
    assert vllm_full_options(VllmSamplerConfig(), CPU)["dtype"] == "float32"  # models.pick_dtype on the CPU
    assert vllm_full_options(VllmSamplerConfig(dtype="bfloat16"), CPU)["dtype"] == "bfloat16"  # the node's choice stands
