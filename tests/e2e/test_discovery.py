"""GET /openrl/v1/info against a real daemon: what it reports, and that it agrees with the Tinker routes."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import tinker

from openrld import __version__
from openrld.api.capabilities import SUPPORTED_LOSSES
from openrld.settings import settings_json_schema

HEADERS = {"X-API-Key": "tml-test"}


@pytest.fixture(scope="module")
def info(shared_daemon) -> dict:
    response = httpx.get(f"{shared_daemon.url}/openrl/v1/info", headers=HEADERS, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_info_reports_the_server_and_sdk_versions_and_open_mode(info):
    assert (info["version"], info["tinker_sdk_version"], info["auth"]) == (__version__, tinker.__version__, "open")


def test_info_limits_are_the_node_config(info):
    # shared_daemon sets longpoll_s = 3.0; everything else is the default of config/openrld.toml.
    assert info["limits"] == {
        "max_batch_tokens": 8192,
        "max_num_samples": 128,
        "max_lora_rank": 128,
        "sample_queue_limit": 256,
        "max_body_bytes": 67108864,
        "longpoll_s": 3.0,
    }


def test_info_settings_schema_is_the_one_settings_validate_with(info):
    assert info["settings_schema"] == settings_json_schema()
    keys = info["settings_schema"]["$defs"]["JobSettings"]["properties"]
    assert sorted(keys) == sorted(
        [
            "fine_tuning_type", "weight_sync", "exclusive", "trainer_backend", "trainer_gpus", "trainer_cp",
            "sampler_replicas", "sampler_backend", "autosave_steps",
        ]
    )


def test_info_lists_losses_and_backends(info):
    assert info["losses"] == list(SUPPORTED_LOSSES)
    assert info["refused_losses"] == ["custom"]
    assert [(b["name"], b["built"]) for b in info["trainer_backends"]] == [  # no [workers] automodel_python
        ("pytorch", True), ("automodel", False), ("image", True),
    ]
    assert [(b["name"], b["built"]) for b in info["sampler_backends"]] == [("torch", True), ("vllm", True)]


def test_info_models_agree_with_get_server_capabilities(shared_daemon, info):
    capabilities = tinker.RestClient(base_url=shared_daemon.url, api_key="tml-test").get_server_capabilities().result()
    listed = [(m.model_name, m.max_context_length) for m in capabilities.supported_models]
    assert [(m["model_name"], m["max_context_length"]) for m in info["models"]] == listed
    # The configured models, then the packaged SmolLM2 under both its names (make install installs it),
    # then the packaged Gemma 3 270M under both of its (make install-test installs it).
    assert listed == [
        ("tiny-llama", 1024), ("tiny-qwen3", 1024),
        ("SmolLM2-135M-Instruct", 8192), ("HuggingFaceTB/SmolLM2-135M-Instruct", 8192),
        ("gemma-3-270m", 32768), ("google/gemma-3-270m", 32768),
    ]
    assert [m["arch"] for m in info["models"]] == [
        "LlamaForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "LlamaForCausalLM",
        "Gemma3ForCausalLM", "Gemma3ForCausalLM",
    ]


def test_info_says_why_each_model_is_listed_and_whether_it_is_ready(info):
    assert [(m["source"], m["ready"]) for m in info["models"]] == [
        ("configured", True), ("configured", True), ("packaged", False), ("packaged", False),
        ("packaged", False), ("packaged", False),
    ]


def test_info_reports_the_cpu_device_with_the_machine_memory(info):
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert info["devices"] == [{"name": "cpu", "kind": "cpu", "memory_bytes": memory}]


# ---------------------------------------------------------------- /metrics

_SAMPLE_LINE = r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)+\})? (-?[0-9.e+-]+|\+Inf)$'


def _metrics(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = {}
    for line in response.text.splitlines():
        if line.startswith("#"):
            continue
        assert re.match(_SAMPLE_LINE, line), line
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


def test_metrics_counts_quart_routes_by_template_and_status(shared_daemon):
    counter = 'openrld_http_requests_total{endpoint="/api/v1/training_runs/<run_id>",method="GET",status="404"}'
    before = _metrics(shared_daemon.url).get(counter, 0.0)
    for run_id in ("nope-1", "nope-2"):
        assert httpx.get(f"{shared_daemon.url}/api/v1/training_runs/{run_id}", headers=HEADERS).status_code == 404
    assert _metrics(shared_daemon.url)[counter] == before + 2


def test_metrics_counts_the_fast_path_routes(shared_daemon):
    counter = 'openrld_http_requests_total{endpoint="/api/v1/retrieve_future",method="POST",status="400"}'
    before = _metrics(shared_daemon.url).get(counter, 0.0)
    response = httpx.post(f"{shared_daemon.url}/api/v1/retrieve_future", content=b"{not json", headers=HEADERS)
    assert response.status_code == 400
    after = _metrics(shared_daemon.url)
    assert after[counter] == before + 1
    count = 'openrld_http_request_duration_seconds_count{endpoint="/api/v1/retrieve_future",method="POST"}'
    assert after[count] >= 1


def test_metrics_reports_the_trainer_queue_of_a_started_group(shared_daemon):
    service = tinker.ServiceClient(base_url=shared_daemon.url, api_key="tml-test")
    try:
        service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=0).result()
        samples = _metrics(shared_daemon.url)
    finally:
        service.close("success").result()
    assert samples['openrld_trainer_queue_depth{base_model="tiny-qwen3"}'] == 0
    assert samples['openrld_sampler_queue_depth{base_model="tiny-qwen3"}'] == 0
    assert samples["openrld_store_sessions"] >= 1


def test_metrics_reports_relaying_at_zero_on_a_node_outside_a_cluster(shared_daemon):
    # The series exist before anything is counted (a dashboard panel reads 0, not "No data"); a node
    # outside a cluster never relays, so they stay 0 whatever the other tests did to it.
    samples = _metrics(shared_daemon.url)
    relay = {name: value for name, value in samples.items()
             if name.startswith(("openrld_relayed_", "openrld_lost_", "openrld_placements_"))}
    assert relay == {
        'openrld_relayed_requests_total{outcome="answered"}': 0,
        'openrld_relayed_requests_total{outcome="unreachable"}': 0,
        "openrld_lost_answers_total": 0,
        'openrld_placements_total{outcome="placed"}': 0,
        'openrld_placements_total{outcome="refused"}': 0,
    }
