"""Which sampler engine the factory builds: torch by default, vLLM when configured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
