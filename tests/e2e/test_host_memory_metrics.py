"""The node's host-memory budget on a real daemon: /metrics and the console's node view show it by part.

One daemon (CPU, so the engines' weights and optimizer state are host memory) with a
configured budget; the real SDK trains a LoRA job one step and samples a prompt of whole
prefix-cache blocks from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

from openrld.gpu.torch_sampler import TorchSampler
from tests.conftest import Daemon, write_config
from tests.e2e.console_support import datum

BUDGET = 1_000_000_000
CAP = 268435456  # sampler_prefix_cache_bytes's default
BLOCK = 16  # the prefix cache's block
PROMPT = list(range(20, 60))  # 40 tokens: two whole blocks, and with 3 sampled tokens still two


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("host-memory")
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama}, f"host_memory_budget_bytes = {BUDGET}"
    )
    node = Daemon(root / "data", config, root / "daemon.log").start()
    yield node
    node.stop()


def scrape(daemon: Daemon) -> dict[str, float]:
    """{series with its labels: value} of every openrld_*host_memory* sample."""
    text = httpx.get(f"{daemon.url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(openrld_\w*host_memory\w*(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def block_bytes(model_dir: Path) -> int:
    """Bytes of one prefix-cache block of the tiny Llama in fp32: keys and values of every layer."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BLOCK * 4


def test_a_fresh_node_shows_its_budget_and_nothing_held(daemon: Daemon):
    series = scrape(daemon)
    rss = series.pop("openrld_host_memory_rss_bytes")
    assert 50e6 < rss < 4e9  # a live Python process with torch loaded
    assert series == {
        "openrld_host_memory_budget_bytes": BUDGET,
        'openrld_host_memory_bytes{part="prefix_cache"}': 0,
        'openrld_host_memory_bytes{part="parked_state"}': 0,
        'openrld_host_memory_bytes{part="engine_state"}': 0,
        "openrld_host_memory_prefix_cache_share_bytes": CAP,
        "openrld_host_memory_spilled_bytes": 0,
        "openrld_host_memory_over_budget_parks_total": 0,
    }


@pytest.fixture(scope="module")
def trained(daemon: Daemon) -> None:
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-host-memory")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    training.forward_backward([datum(list(range(5, 17)))], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1, stop=[])
    sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
    yield
    service.close("success").result()


def test_the_gauges_show_what_the_engines_hold_by_part(daemon: Daemon, tiny_llama: Path, trained: None):
    series = scrape(daemon)
    weights = TorchSampler(tiny_llama, torch.device("cpu")).host_state_bytes()
    engine = 'openrld_engine_host_memory_bytes{base_model="tiny-llama",worker="%s",part="%s"}'
    sampler_state = series[engine % ("sampler", "engine_state")]
    trainer_state = series[engine % ("trainer", "engine_state")]
    assert weights < sampler_state < trainer_state  # the sampler adds the version's adapter; the trainer
    # adds the adapter, its gradients and Adam's moments
    assert series['openrld_host_memory_bytes{part="engine_state"}'] == sampler_state + trainer_state
    assert series[engine % ("sampler", "prefix_cache")] == 2 * block_bytes(tiny_llama)
    assert series['openrld_host_memory_bytes{part="prefix_cache"}'] == 2 * block_bytes(tiny_llama)
    assert series['openrld_host_memory_bytes{part="parked_state"}'] == 0  # on the CPU a park moves nothing
    assert series["openrld_host_memory_prefix_cache_share_bytes"] == min(CAP, BUDGET - sampler_state - trainer_state)


def test_the_console_shows_the_same_budget_and_parts(daemon: Daemon, trained: None):
    series = scrape(daemon)
    node = httpx.get(f"{daemon.url}/openrl/v1/node", headers={"X-API-Key": "tml-host-memory"}, timeout=30).json()
    memory = node["host_memory"]
    assert (memory["budget_bytes"], memory["prefix_cache_bytes"], memory["state_bytes"], memory["parked_bytes"]) == (
        BUDGET, series['openrld_host_memory_bytes{part="prefix_cache"}'],
        series['openrld_host_memory_bytes{part="engine_state"}'], 0,
    )
    [group] = node["groups"]
    assert (group["prefix_cache_bytes"], group["engine_state_bytes"]) == (
        memory["prefix_cache_bytes"], memory["state_bytes"],
    )


def test_a_fresh_node_with_no_budget_set_takes_half_the_machines_memory(make_daemon):
    from openrld.actors.host_memory import read_machine_memory_bytes

    assert scrape(make_daemon())["openrld_host_memory_budget_bytes"] == read_machine_memory_bytes() // 2
