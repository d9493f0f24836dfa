"""The sampler_backend and vllm_* node options (openrld/config.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from openrld.config import ConfigError, load_config

ENV = {"HOME": "/home/alice"}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_the_torch_sampler_is_the_default() -> None:
    config = load_config(None, {}, ENV)
    assert (config.sampler_backend, config.vllm_gpu_memory_utilization) == ("torch", 0.5)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_backend_without_the_package_is_refused_at_startup_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "openrld.toml"
    path.write_text('sampler_backend = "vllm"\n')
    with pytest.raises(ConfigError, match=r"sampler_backend = \"vllm\" needs the 'vllm' package, which is not installed"):
        load_config(path, {}, ENV)


def test_unknown_sampler_backend_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "openrld.toml"
    path.write_text('sampler_backend = "sglang"\n')
    with pytest.raises(ConfigError, match=r"sampler_backend: Invalid enum value 'sglang'"):
        load_config(path, {}, ENV)


def test_vllm_memory_share_above_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"environment OPENRLD_VLLM_GPU_MEMORY_UTILIZATION: vllm_gpu_memory_utilization"):
        load_config(None, {}, {**ENV, "OPENRLD_VLLM_GPU_MEMORY_UTILIZATION": "1.5"})
