"""Sampling under load: 429 past the queue limit, queue_state on try_again, cancel_future.

One daemon with `sample_queue_limit = 2` serves the module. "Long" requests
generate LONG tokens on a tiny Qwen3 given a long context, which takes the CPU
engine tens of seconds (1000 tokens, the default tiny context, took under the
1 s long-poll once the engine got faster), while a refused submission answers
in milliseconds; so two long requests hold the whole queue for as long as each
test needs it. Each test cancels the long requests it made.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker

from openrld.gpu.tiny_models import build_tiny_model
from tests.conftest import Daemon, write_config

HEADERS = {"X-API-Key": "tml-test"}
QUEUE_LIMIT = 2
PROMPT = [11, 12, 13]
CONTEXT = 32768
LONG = CONTEXT - 100


def long_context_qwen3(out_dir: Path) -> Path:
    model = build_tiny_model(out_dir, "qwen3", seed=1)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": CONTEXT}))
    return model


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("sampling-load")
    qwen3 = long_context_qwen3(root / "tiny-qwen3")
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": qwen3},
        f"longpoll_s = 1.0\nsample_queue_limit = {QUEUE_LIMIT}",
    )
    started = Daemon(root / "data", config, root / "daemon.log").start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def sampler_id(daemon: Daemon) -> str:
    with httpx.Client(base_url=daemon.url, headers=HEADERS, timeout=60) as client:
        session = client.post("/api/v1/create_session", json={"sdk_version": "test"}).json()["session_id"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-qwen3"}
        sampler_id = client.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        # One sample first, so that the sampler has started and the tests see its queue.
        assert isinstance(wait_done(client, asample(client, sampler_id, 0, 1).json()["request_id"]), bytes)
        return sampler_id


def asample(client: httpx.Client, sampler_id: str, seq_id: int, max_tokens: int) -> httpx.Response:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "stop": []},
        "prompt_logprobs": False,
    }
    return client.post("/api/v1/asample", json=body)


def wait_done(client: httpx.Client, request_id: str) -> dict | bytes:
    while True:
        response = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if response.headers["content-type"] == "application/x-protobuf":
            return response.content
        body = response.json()
        if body.get("type") != "try_again":
            return body


@pytest.fixture
def client(daemon: Daemon) -> httpx.Client:
    with httpx.Client(base_url=daemon.url, headers=HEADERS, timeout=60) as c:
        yield c


def test_asample_past_the_queue_limit_is_429_with_retry_after(client: httpx.Client, sampler_id: str) -> None:
    held = [asample(client, sampler_id, seq, LONG).json()["request_id"] for seq in (100, 101)]
    refused = asample(client, sampler_id, 102, 4)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "queue is full" in refused.json()["detail"]
    for request_id in held:
        client.post("/api/v1/cancel_future", json={"request_id": request_id})


def test_try_again_of_a_running_sample_says_the_queue_is_active(client: httpx.Client, sampler_id: str) -> None:
    request_id = asample(client, sampler_id, 200, LONG).json()["request_id"]
    pending = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert pending.status_code == 408
    assert pending.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    client.post("/api/v1/cancel_future", json={"request_id": request_id})


def test_cancel_future_fails_the_sample_and_frees_its_place(client: httpx.Client, sampler_id: str) -> None:
    held = [asample(client, sampler_id, seq, LONG).json()["request_id"] for seq in (300, 301)]
    assert client.post("/api/v1/cancel_future", json={"request_id": held[0]}).status_code == 200
    outcome = wait_done(client, held[0])
    assert outcome == {"error": "sample cancelled by the client (cancel_future)", "category": "user"}
    admitted = asample(client, sampler_id, 302, 4)  # the cancelled request's place is free again
    assert admitted.status_code == 200
    assert isinstance(wait_done(client, admitted.json()["request_id"]), bytes)
    client.post("/api/v1/cancel_future", json={"request_id": held[1]})


def test_cancel_future_of_an_unknown_request_is_404(client: httpx.Client) -> None:
    response = client.post("/api/v1/cancel_future", json={"request_id": "r-nope"})
    assert response.status_code == 404 and "r-nope" in response.json()["detail"]


def test_sdk_resubmits_refused_samples_and_loses_none(daemon: Daemon) -> None:
    # 6 concurrent samples against a queue of 2: most are refused at first; the SDK backs off and
    # resubmits the same seq_id until each is accepted. Each must equal the same request run alone.
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    try:
        sampling = service.create_sampling_client(base_model="tiny-qwen3").result()
        prompt = tinker.ModelInput.from_ints(PROMPT)

        def params(seed: int) -> tinker.SamplingParams:
            return tinker.SamplingParams(max_tokens=16, seed=seed, stop=[])

        futures: list[Future] = [sampling.sample(prompt, 1, params(seed)) for seed in range(6)]
        together = [f.result(timeout=300) for f in futures]
        alone = [sampling.sample(prompt, 1, params(seed)).result(timeout=300) for seed in range(6)]
    finally:
        service.close("success").result()
    for got, expected in zip(together, alone):
        assert got.sequences[0].tokens == expected.sequences[0].tokens
        np.testing.assert_allclose(got.sequences[0].logprobs, expected.sequences[0].logprobs, rtol=0, atol=1e-5)
