"""What a node says it serves without a download: get_server_capabilities through the SDK, and /openrl/v1/info.

The listing is the configured models, the packaged SmolLM2 under both its
names, and the local directories and Hugging Face cache ids a client has
used on the node (also after a restart); each says whether its files are
ready or still to be converted. The SDK drops fields it does not know, so
`ready` and `source` are read from the raw JSON.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, seed_smollm2, write_config

KEY = "tml-served-models"
SMOLLM2_NAMES = ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Daemon]:
    """A node with nothing configured: what it lists, it found by itself."""
    config = write_config(tmp_path / "openrld.toml", tmp_path / "data", {})
    daemon = Daemon(tmp_path / "data", config, tmp_path / "daemon.log").start()
    yield daemon
    daemon.stop()


def _sdk_names(daemon: Daemon) -> list[str]:
    capabilities = tinker.RestClient(base_url=daemon.url, api_key=KEY).get_server_capabilities().result()
    return [m.model_name for m in capabilities.supported_models]


def _capabilities(daemon: Daemon) -> list[dict]:
    response = httpx.get(f"{daemon.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["supported_models"]


def _info_models(daemon: Daemon) -> list[dict]:
    response = httpx.get(f"{daemon.url}/openrl/v1/info", headers={"X-API-Key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["models"]


def test_a_fresh_node_lists_both_smollm2_names_still_to_convert(node: Daemon):
    assert _sdk_names(node) == SMOLLM2_NAMES
    assert _capabilities(node) == [
        {"model_name": name, "max_context_length": 8192, "trainable": True, "sampleable": True, "ready": False}
        for name in SMOLLM2_NAMES
    ]
    assert [(m["model_name"], m["source"], m["ready"]) for m in _info_models(node)] == [
        (name, "packaged", False) for name in SMOLLM2_NAMES
    ]


def test_smollm2_is_listed_ready_once_its_conversion_is_in_the_model_cache(node: Daemon, smollm2_conversion: Path):
    seed_smollm2(node.data_dir, smollm2_conversion)  # as a finished conversion publishes it
    assert [(m["model_name"], m["ready"]) for m in _capabilities(node)] == [(name, True) for name in SMOLLM2_NAMES]
    assert [m["ready"] for m in _info_models(node)] == [True, True]


def test_a_model_directory_a_client_used_is_listed_as_served_also_after_a_restart(node: Daemon, tiny_llama: Path):
    service = tinker.ServiceClient(base_url=node.url, api_key=KEY)
    service.create_sampling_client(base_model=str(tiny_llama)).result()
    service.close("success").result()
    assert _sdk_names(node) == [*SMOLLM2_NAMES, str(tiny_llama)]
    assert _capabilities(node)[2] == {
        "model_name": str(tiny_llama), "max_context_length": 1024, "trainable": True, "sampleable": True, "ready": True,
    }
    node.stop()
    node.start()
    assert _sdk_names(node) == [*SMOLLM2_NAMES, str(tiny_llama)]
    assert (_info_models(node)[2]["source"], _info_models(node)[2]["ready"]) == ("served", True)
