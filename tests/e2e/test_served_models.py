"""What a node says it serves without a download: get_server_capabilities through the SDK, and /openrl/v1/info.

The listing is the configured models, the packaged SmolLM2 and Gemma 3 270M
under both their names, and the local directories and Hugging Face cache ids a client has
used on the node (also after a restart); each says whether its files are
ready or still to be converted. The SDK drops fields it does not know, so
`ready` and `source` are read from the raw JSON.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import ServeCommand, seed_smollm2, write_config

KEY = "tml-served-models"
SMOLLM2_NAMES = ["SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"]
GEMMA3_NAMES = ["gemma-3-270m", "google/gemma-3-270m"]  # make install-test installs its part packages
PACKAGED_NAMES = [*SMOLLM2_NAMES, *GEMMA3_NAMES]
HF_ID = "org/tiny-llama"  # in the node's Hugging Face cache, as a download by the operator left it


class Node:
    """`openrld serve` with nothing configured and a Hugging Face cache of its own."""

    def __init__(self, root: Path, hf_cache: Path) -> None:
        self.data_dir = root / "data"
        config = write_config(root / "openrld.toml", self.data_dir, {})
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_CACHE=str(hf_cache))
        argv = [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--config", str(config)]
        self.command = ServeCommand(argv, root / "daemon.log", env=env)
        self.url = ""

    def start(self) -> Node:
        self.url = self.command.start()
        return self

    def stop(self) -> None:
        self.command.stop()


def _hf_cache_with(root: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding `model_dir` as `repo_id`'s main revision."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    return root


@pytest.fixture
def node(tmp_path: Path, tiny_llama: Path) -> Iterator[Node]:
    started = Node(tmp_path, _hf_cache_with(tmp_path / "hf-hub", HF_ID, tiny_llama)).start()
    yield started
    started.stop()


def _sdk_names(daemon: Node) -> list[str]:
    capabilities = tinker.RestClient(base_url=daemon.url, api_key=KEY).get_server_capabilities().result()
    return [m.model_name for m in capabilities.supported_models]


def _capabilities(daemon: Node) -> list[dict]:
    response = httpx.get(f"{daemon.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["supported_models"]


def _info_models(daemon: Node) -> list[dict]:
    response = httpx.get(f"{daemon.url}/openrl/v1/info", headers={"X-API-Key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["models"]


def test_a_fresh_node_lists_the_packaged_names_still_to_convert_and_none_of_its_hf_cache(node: Node):
    assert _sdk_names(node) == PACKAGED_NAMES  # HF_ID is in its cache, but no client has used it yet
    assert _capabilities(node) == [
        {"model_name": name, "max_context_length": context, "trainable": True, "sampleable": True, "ready": False}
        for names, context in ((SMOLLM2_NAMES, 8192), (GEMMA3_NAMES, 32768))
        for name in names
    ]
    assert [(m["model_name"], m["source"], m["ready"]) for m in _info_models(node)] == [
        (name, "packaged", False) for name in PACKAGED_NAMES
    ]


def test_smollm2_is_listed_ready_once_its_conversion_is_in_the_model_cache(node: Node, smollm2_conversion: Path):
    seed_smollm2(node.data_dir, smollm2_conversion)  # as a finished conversion publishes it
    assert [(m["model_name"], m["ready"]) for m in _capabilities(node)] == [
        *((name, True) for name in SMOLLM2_NAMES), *((name, False) for name in GEMMA3_NAMES)
    ]
    assert [m["ready"] for m in _info_models(node)] == [True, True, False, False]


def test_a_model_directory_and_a_cache_id_clients_used_are_listed_as_served_also_after_a_restart(
    node: Node, tiny_llama: Path
):
    service = tinker.ServiceClient(base_url=node.url, api_key=KEY)
    service.create_sampling_client(base_model=str(tiny_llama)).result()
    service.create_lora_training_client(base_model=HF_ID, rank=4).result()
    service.close("success").result()
    served = sorted([str(tiny_llama), HF_ID])
    assert _sdk_names(node) == [*PACKAGED_NAMES, *served]
    assert _capabilities(node)[4:] == [
        {"model_name": name, "max_context_length": 1024, "trainable": True, "sampleable": True, "ready": True}
        for name in served
    ]
    node.stop()
    node.start()
    assert _sdk_names(node) == [*PACKAGED_NAMES, *served]
    assert [(m["source"], m["ready"]) for m in _info_models(node)[4:]] == [("served", True), ("served", True)]
