"""A LoRA job on a shared group ends with its session (ServiceClient.close), through the real SDK.

Two sessions each train a LoRA job on the same base model and save its weights for sampling;
the first closes. The shared trainer then holds the second job's adapter alone
(`openrld_trainer_adapters_loaded` in /metrics), the second job trains and samples on, and
the first job's saved sampler weights still sample by their path, as they did before its
session finished. Once with the engines in the daemon's thread, once in worker processes
(`[workers] launcher = "process"`), where the adapter's drop crosses the worker protocol.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_config
from tests.waits import wait_for

API_KEY = "tml-test"
PROMPT = types.ModelInput.from_ints([7, 8, 9, 10])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[], seed=1)
DROP_S = 30.0  # the drop waits behind the trainer's running op; on 2 busy cores that is seconds at most


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def _trained(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
    _step(training)
    return training


def _step(training: tinker.TrainingClient) -> float:
    fb = training.forward_backward([_datum(list(range(5, 17)))], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return fb.result().metrics["loss:sum"]


def _tokens(sampler: tinker.SamplingClient) -> list[int]:
    return list(sampler.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens)


def _adapters_loaded(daemon: Daemon) -> float:
    for line in httpx.get(f"{daemon.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('openrld_trainer_adapters_loaded{base_model="tiny-llama"}'):
            return float(line.split()[-1])
    raise AssertionError("no openrld_trainer_adapters_loaded for tiny-llama in /metrics")


@pytest.fixture(params=["thread", "process"])
def daemon(request, tmp_path: Path, tiny_llama: Path):
    workers = '[workers]\nlauncher = "process"' if request.param == "process" else ""
    config = write_config(tmp_path / "openrld.toml", tmp_path / "data", {"tiny-llama": tiny_llama}, workers)
    started = Daemon(tmp_path / "data", config, tmp_path / "daemon.log").start()
    yield started
    started.stop()


def test_a_closed_sessions_lora_job_leaves_the_shared_trainer_and_its_saved_path_still_samples(daemon):
    first = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    second = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    try:
        ending = _trained(first, seed=1)
        ending_path = ending.save_weights_for_sampler("ending-final").result().path
        _tokens(ending.save_weights_and_get_sampling_client().result())  # an unnamed version too, in the sampler
        staying = _trained(second, seed=2)
        before = _tokens(second.create_sampling_client(model_path=ending_path))
        assert _adapters_loaded(daemon) == 2
        first.close("success").result()
        wait_for(lambda: _adapters_loaded(daemon) == 1, DROP_S)
        assert _adapters_loaded(daemon) == 1
        assert _step(staying) > 0.0
        _tokens(staying.save_weights_and_get_sampling_client().result())
        assert _tokens(second.create_sampling_client(model_path=ending_path)) == before
    finally:
        first.close("success").result()  # a no-op once closed
        second.close("success").result()
