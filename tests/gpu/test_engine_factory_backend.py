"""Which sampler engine the factory builds: torch by default, vLLM when configured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import SampleJob, SamplingSpec
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.vllm_sampler import VllmSamplerConfig, VllmUnavailable
from openrld.model_catalog import ModelEntry
from openrld.worker.engines import InprocSampler, TorchEngineFactory


def entry(directory: Path) -> ModelEntry:
    return ModelEntry(name="tiny-llama", directory=str(directory), arch="llama", max_context=1024)


def test_the_factory_builds_the_torch_sampler_by_default(tiny_llama: Path) -> None:
    factory = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64)
    sampler = factory.sampler(entry(tiny_llama))()
    assert isinstance(sampler, InprocSampler) and isinstance(sampler.engine, TorchSampler)


def test_the_factory_builds_the_vllm_sampler_when_configured(tiny_llama: Path) -> None:
    # On this CPU node the vLLM engine refuses to start, which shows the factory chose it.
    factory = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64, vllm=VllmSamplerConfig())
    with pytest.raises(VllmUnavailable, match=r"the vLLM sampler runs on a CUDA device; this node.s device is cpu"):
        factory.sampler(entry(tiny_llama))()


def test_the_nodes_prefix_cache_bytes_reach_the_torch_samplers(tiny_llama: Path) -> None:
    factory = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64, prefix_cache_bytes=12345)
    lora, full = factory.sampler(entry(tiny_llama))(), factory.full_sampler(entry(tiny_llama))()
    assert lora.statistics().prefix_cache.budget_bytes == 12345
    assert full.statistics().engine.prefix_cache.budget_bytes == 12345


def test_a_worker_process_builds_its_sampler_with_the_nodes_prefix_cache_bytes(tiny_llama: Path) -> None:
    from openrld.worker.builtin import build
    from openrld.worker.protocol import Start

    engine = build(Start("torch_sampler", str(tiny_llama), "cpu", options={"prefix_cache_bytes": 0}))
    assert engine.statistics().prefix_cache.budget_bytes == 0


def _packed_bytes_after_a_sample(engine) -> int:
    engine.sample(None, SampleJob(prompt=np.arange(3, 8), num_samples=1, params=SamplingSpec(max_tokens=2, seed=0)))
    return engine.statistics().packed_weight_bytes


def test_the_tiny_llamas_weights_are_too_small_to_pack(tiny_llama: Path) -> None:
    packing = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64)
    assert _packed_bytes_after_a_sample(packing.sampler(entry(tiny_llama))()) == 0


def test_the_nodes_packed_weights_setting_reaches_the_torch_samplers(small_weights_pack: None, tiny_llama: Path) -> None:
    packing = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64)
    plain = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64, packed_weights=False)
    assert _packed_bytes_after_a_sample(packing.sampler(entry(tiny_llama))()) > 0
    assert _packed_bytes_after_a_sample(plain.sampler(entry(tiny_llama))()) == 0


def test_the_full_sampler_never_packs_its_weights_which_change_in_place(small_weights_pack: None, tiny_llama: Path) -> None:
    full = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64).full_sampler(entry(tiny_llama))()
    full.sample(None, SampleJob(prompt=np.arange(3, 8), num_samples=1, params=SamplingSpec(max_tokens=2, seed=0)))
    assert full.statistics().engine.packed_weight_bytes == 0


def test_a_worker_process_builds_its_sampler_with_the_nodes_packed_weights_setting(
    small_weights_pack: None, tiny_llama: Path
) -> None:
    from openrld.worker.builtin import build
    from openrld.worker.protocol import Start

    engine = build(Start("torch_sampler", str(tiny_llama), "cpu", options={"packed_weights": False}))
    assert _packed_bytes_after_a_sample(engine) == 0
