"""A GGUF base model through a real daemon: converted once in the background, served like its original."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, write_config
from tinker import types

HEADERS = {"X-API-Key": "tml-test"}
PROMPT = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def gguf_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_llama_gguf: Path):
    root = tmp_path_factory.mktemp("gguf-daemon")
    config = write_config(root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-gguf": tiny_llama_gguf})
    daemon = Daemon(root / "data", config, root / "daemon.log").start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def service(gguf_daemon):
    client = tinker.ServiceClient(base_url=gguf_daemon.url, api_key="tml-test")
    yield client
    client.close("success").result()


def _greedy(service, base_model: str) -> types.SampledSequence:
    sampler = service.create_sampling_client(base_model=base_model).result()
    result = sampler.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
    ).result()
    return result.sequences[0]


def _info_models(daemon: Daemon) -> dict[str, dict]:
    response = httpx.get(f"{daemon.url}/openrl/v1/info", headers=HEADERS, timeout=30)
    assert response.status_code == 200, response.text
    return {m["model_name"]: m for m in response.json()["models"]}


def test_a_gguf_model_samples_exactly_like_the_model_it_was_written_from(service):
    converted, original = _greedy(service, "tiny-gguf"), _greedy(service, "tiny-llama")
    assert (list(converted.tokens), list(converted.logprobs)) == (list(original.tokens), list(original.logprobs))


def test_a_lora_job_trains_on_a_gguf_model(service):
    training = service.create_lora_training_client(base_model="tiny-gguf", rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)},
    )
    losses = []
    for _ in range(3):
        losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[2] < losses[0], losses


def test_info_shows_the_finished_conversion_and_nothing_for_a_plain_model(gguf_daemon, service):
    _greedy(service, "tiny-gguf")  # returns only once the model's files are ready
    models = _info_models(gguf_daemon)
    done = models["tiny-gguf"]["preparing"]
    assert (done["operation"], done["stage"], done["fraction"]) == ("gguf_conversion", "ready", 1.0)
    assert models["tiny-llama"]["preparing"] is None


def test_the_conversion_is_logged_with_its_stages(gguf_daemon, service):
    _greedy(service, "tiny-gguf")
    stages = [line.split(" stage=")[1].split()[0] for line in gguf_daemon.log().splitlines() if "key=tiny-gguf" in line]
    assert stages == ["reading", "converting", "writing", "publishing", "ready"]


def test_a_restarted_daemon_reuses_the_conversion(gguf_daemon, service):
    _greedy(service, "tiny-gguf")
    # The last test here: the session ends before its daemon stops. Closed after the restart
    # instead, the SDK's close once hung in CI for minutes after its finish was answered.
    service.close("success").result()
    gguf_daemon.stop()
    log_before = len(gguf_daemon.log())
    gguf_daemon.start()
    assert "key=tiny-gguf" not in gguf_daemon.log()[log_before:]
    assert _info_models(gguf_daemon)["tiny-gguf"]["preparing"] is None
    cache = gguf_daemon.data_dir / "models" / "gguf"
    assert [p.name.startswith("tiny-llama-") for p in cache.iterdir()] == [True]
