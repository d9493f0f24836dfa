"""An exclusive job's device is free again once the job ends, through the real SDK and a real daemon.

The daemon has one device, `cpu:0`, so a second exclusive job is accepted only if the
first one's booking was released: when its session finished (`ServiceClient.close`),
or when its creation failed ("broken": a model whose directory has a config.json and
no weights, so that building its engines fails).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_config

EXCLUSIVE = {"openrl.exclusive": "true"}


def _status(daemon: Daemon, model_id: str) -> dict:
    response = httpx.get(
        f"{daemon.url}/openrl/v1/models/{model_id}/status", headers={"X-API-Key": "tml-test"}, timeout=30
    )
    return response.json()


def _train_step(training) -> float:
    tokens = list(range(5, 17))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    result = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return result.metrics["loss:sum"]


@pytest.fixture(scope="module")
def one_device_daemon(tmp_path_factory, tiny_llama: Path, tiny_qwen3: Path):
    root = tmp_path_factory.mktemp("one-device")
    broken = root / "broken"
    broken.mkdir()
    shutil.copy(tiny_llama / "config.json", broken / "config.json")
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3, "broken": broken},
        'longpoll_s = 3.0\ndevices = ["cpu:0"]',
    )
    daemon = Daemon(root / "data", config, root / "daemon.log").start()
    yield daemon
    daemon.stop()


def test_a_closed_sessions_exclusive_job_frees_the_device_for_the_next(one_device_daemon):
    first = tinker.ServiceClient(base_url=one_device_daemon.url, api_key="tml-test")
    hero = first.create_lora_training_client(base_model="tiny-llama", rank=4, user_metadata=EXCLUSIVE).result()
    _train_step(hero)
    first.close("success").result()
    second = tinker.ServiceClient(base_url=one_device_daemon.url, api_key="tml-test")
    next_hero = second.create_lora_training_client(
        base_model="tiny-qwen3", rank=4, user_metadata=EXCLUSIVE
    ).result()
    _train_step(next_hero)
    status = _status(one_device_daemon, next_hero.model_id)
    second.close("success").result()
    assert (status["is_exclusive"], [w["device"] for w in status["workers"]]) == (True, ["cpu:0", "cpu:0"])
    # The first job is no longer served: its session is over.
    assert _status(one_device_daemon, hero.model_id)["state"] == "finished"


def test_an_exclusive_job_whose_creation_failed_frees_the_device(one_device_daemon):
    service = tinker.ServiceClient(base_url=one_device_daemon.url, api_key="tml-test")
    with pytest.raises(tinker.RequestFailedError) as excinfo:
        service.create_lora_training_client(base_model="broken", rank=4, user_metadata=EXCLUSIVE).result()
    hero = service.create_lora_training_client(base_model="tiny-llama", rank=4, user_metadata=EXCLUSIVE).result()
    _train_step(hero)
    service.close("success").result()
    assert str(excinfo.value).startswith(
        "Request failed: could not load base model 'broken': Error no file named model.safetensors"
    )
