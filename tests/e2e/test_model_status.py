"""GET /openrl/v1/models/{model_id}/status, device time-slicing and exclusive jobs, through real daemons.

Models are created with the real SDK; the status is read with httpx. Three daemons:
the module's shared one (one CPU device), one whose only device is `cpu:0` with a
short turn (so groups and a full fine-tuning job's workers take turns on it), and
one with two devices and two users' keys (exclusive jobs, ownership).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_api_keys, write_config

HEADERS = {"X-API-Key": "tml-test"}
PROMPT = types.ModelInput.from_ints([7, 8, 9, 10])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _status(daemon: Daemon, model_id: str, key: str = "tml-test") -> httpx.Response:
    return httpx.get(f"{daemon.url}/openrl/v1/models/{model_id}/status", headers={"X-API-Key": key}, timeout=30)


def _train_step(training) -> None:
    training.forward_backward([_datum(list(range(5, 17)))], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def _workers(body: dict) -> dict[str, dict]:
    return {worker["role"]: worker for worker in body["workers"]}


def _own_daemon(tmp_path_factory, tiny_llama: Path, tiny_qwen3: Path, name: str, extra: str) -> Daemon:
    root = tmp_path_factory.mktemp(name)
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3},
        "longpoll_s = 3.0\n" + extra,
    )
    return Daemon(root / "data", config, root / "daemon.log").start()


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key="tml-test")
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def sliced_daemon(tmp_path_factory, tiny_llama, tiny_qwen3):
    """One device for everything, and a short turn, so workers of different groups take turns."""
    daemon = _own_daemon(
        tmp_path_factory, tiny_llama, tiny_qwen3, "sliced", 'devices = ["cpu:0"]\ntimeslice_quantum_s = 0.2'
    )
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def keyed_daemon(tmp_path_factory, tiny_llama, tiny_qwen3):
    """Three devices and two users (alice: tml-alice, bob: tml-bob)."""
    root = tmp_path_factory.mktemp("keys")
    keys = write_api_keys(root / "keys.toml", {"tml-alice": "alice", "tml-bob": "bob"})
    daemon = _own_daemon(
        tmp_path_factory, tiny_llama, tiny_qwen3, "keyed",
        f'devices = ["cpu:0", "cpu:1", "cpu:2"]\napi_keys_file = "{keys}"',
    )
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def gated_daemon(tmp_path_factory, tiny_llama, tiny_qwen3):
    """Engines in worker processes whose interpreter waits for a gate file, so a cold start
    stays in its load until the test has looked at it (an in-process load of a tiny model can
    finish before the next request is served)."""
    root = tmp_path_factory.mktemp("gated")
    gate = root / "gate"
    python = root / "gated-python"
    python.write_text(f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    daemon = _own_daemon(
        tmp_path_factory, tiny_llama, tiny_qwen3, "gated-node", f'\n[workers]\nlauncher = "process"\npython = "{python}"'
    )
    yield daemon, gate
    daemon.stop()


# ---------------------------------------------------------------- one device, one LoRA job


def test_a_new_lora_job_is_ready_at_step_zero_on_the_cpu(shared_daemon, service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    body = _status(shared_daemon, training.model_id).json()
    assert {k: v for k, v in body.items() if k != "workers"} == {
        "model_id": training.model_id, "base_model": "tiny-llama", "fine_tuning_type": "lora", "is_exclusive": False,
        "state": "ready", "waiting_for": None,
        "queues": {"training_ops_waiting": 0, "samples_waiting": 0, "samples_running": 0},
        "step": 0, "sampler_weight_version": None, "last_sync": None, "last_error": None, "last_checkpoint": None,
        "adopted_from": None,
    }
    workers = _workers(body)
    # One device: the group's trainer and sampler share it and never park for each other.
    assert [(w["device"], w["state"], w["parks"]) for w in (workers["trainer"], workers["sampler"])] == [
        ("cpu", "resident", 0), ("cpu", "resident", 0),
    ]


def test_a_cold_start_says_it_loads_the_base_model_then_is_ready(gated_daemon):
    daemon, gate = gated_daemon
    with httpx.Client(base_url=daemon.url, headers=HEADERS, timeout=60) as http:
        session_id = http.post(
            "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
        ).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-qwen3", "lora_config": {"rank": 4}},
        ).json()
        cold = _status(daemon, created["model_id"]).json()  # its sampler's process waits at the gate
        gate.touch()
        for _ in range(40):  # each poll is held up to the daemon's 3 s long-poll
            answer = http.post(
                "/api/v1/retrieve_future", json={"request_id": created["request_id"], "allow_metadata_only": False}
            ).json()
            if answer.get("type") != "try_again":
                break
        assert answer["model_id"] == created["model_id"]
        warm = _status(daemon, created["model_id"]).json()
    assert (cold["state"], cold["waiting_for"]) == ("loading_weights", "base model tiny-qwen3 to load onto cpu")
    assert [(w["role"], w["state"]) for w in cold["workers"]] == [
        ("trainer", "loading_weights"), ("sampler", "loading_weights"),
    ]
    assert (warm["state"], warm["waiting_for"]) == ("ready", None)


def test_step_sampler_version_and_checkpoint_follow_the_training(shared_daemon, service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    for _ in range(2):
        _train_step(training)
    saved = training.save_weights_for_sampler("v2").result().path
    state = training.save_state("step-2").result().path
    body = _status(shared_daemon, training.model_id).json()
    assert (body["step"], body["sampler_weight_version"], body["last_checkpoint"]) == (2, saved, state)
    assert _workers(body)["trainer"]["turns"] >= 5  # create, 2 x (forward_backward, optim_step), 2 saves


def test_a_failed_op_is_the_last_error(shared_daemon, service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=2).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7]})
    with pytest.raises(tinker.TinkerError):
        training.forward_backward([bad], "cross_entropy").result()
    body = _status(shared_daemon, training.model_id).json()
    assert body["state"] == "ready" and "target_tokens" in body["last_error"]


def test_status_of_an_unknown_model_is_404_naming_it(shared_daemon):
    response = _status(shared_daemon, "no-such-session:train:0")
    assert (response.status_code, response.json()) == (404, {"detail": "no model 'no-such-session:train:0'"})


# ---------------------------------------------------------------- one device, turns


def test_two_groups_on_one_device_park_and_resume_in_turns(sliced_daemon):
    service = tinker.ServiceClient(base_url=sliced_daemon.url, api_key="tml-test")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    _train_step(training)
    other = service.create_sampling_client(base_model="tiny-qwen3").result()
    other.sample(PROMPT, num_samples=1, sampling_params=GREEDY).result()  # the qwen group takes the device
    parked = _workers(_status(sliced_daemon, training.model_id).json())
    _train_step(training)  # ... and gives it back
    resumed = _status(sliced_daemon, training.model_id).json()
    metrics = httpx.get(f"{sliced_daemon.url}/metrics", timeout=30).text
    service.close("success").result()
    assert 'openrld_device_parks_total{base_model="tiny-llama",worker="trainer",device="cpu:0"} 1' in metrics
    assert [(parked[r]["device"], parked[r]["state"], parked[r]["parks"]) for r in ("trainer", "sampler")] == [
        ("cpu:0", "parked", 1), ("cpu:0", "parked", 1),
    ]
    trainer = _workers(resumed)["trainer"]
    assert (resumed["state"], trainer["state"], trainer["parks"], trainer["resumes"]) == ("ready", "resident", 1, 1)


def test_a_full_fine_tuning_jobs_trainer_and_sampler_take_turns_on_one_device(sliced_daemon):
    service = tinker.ServiceClient(base_url=sliced_daemon.url, api_key="tml-test")
    training = service.create_lora_training_client(
        base_model="tiny-llama", rank=4, seed=0, user_metadata={"openrl.fine_tuning_type": "full"}
    ).result()
    _train_step(training)
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(PROMPT, num_samples=1, sampling_params=GREEDY).result()
    sampled = _status(sliced_daemon, training.model_id).json()
    after_sampling = _workers(sampled)
    _train_step(training)
    after_training = _workers(_status(sliced_daemon, training.model_id).json())
    service.close("success").result()
    # Sampling parked the trainer; training again parked the sampler and resumed the trainer.
    assert (after_sampling["trainer"]["state"], after_sampling["sampler"]["state"]) == ("parked", "resident")
    assert (after_training["trainer"]["state"], after_training["sampler"]["state"]) == ("resident", "parked")
    assert after_training["trainer"]["resumes"] >= 1 and after_training["sampler"]["parks"] >= 1
    # The first sync of a full job (openrl.weight_sync defaults to delta) is reported once it landed.
    assert (sampled["fine_tuning_type"], sampled["last_sync"]["mode"]) == ("full", "delta")


# ---------------------------------------------------------------- exclusive jobs and ownership


def test_a_user_sees_only_their_own_models_status(keyed_daemon):
    service = tinker.ServiceClient(base_url=keyed_daemon.url, api_key="tml-alice")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    theirs = _status(keyed_daemon, training.model_id, "tml-bob")
    mine = _status(keyed_daemon, training.model_id, "tml-alice").json()
    service.close("success").result()
    assert (theirs.status_code, theirs.json()) == (404, {"detail": f"no model {training.model_id!r}"})
    # Three free devices: the LoRA group's trainer and sampler took one each.
    assert [(w["role"], w["device"]) for w in mine["workers"]] == [("trainer", "cpu:0"), ("sampler", "cpu:1")]


def test_an_exclusive_job_takes_the_free_device_and_the_next_is_refused(keyed_daemon):
    service = tinker.ServiceClient(base_url=keyed_daemon.url, api_key="tml-alice")
    hero = service.create_lora_training_client(
        base_model="tiny-llama", rank=4, user_metadata={"openrl.exclusive": "true"}
    ).result()
    _train_step(hero)
    body = _status(keyed_daemon, hero.model_id, "tml-alice").json()
    with pytest.raises(tinker.BadRequestError) as excinfo:
        service.create_lora_training_client(
            base_model="tiny-qwen3", rank=4, user_metadata={"openrl.exclusive": "true"}
        ).result()
    service.close("success").result()
    assert (body["is_exclusive"], body["step"], [w["device"] for w in body["workers"]]) == (True, 1, ["cpu:2", "cpu:2"])
    assert f"cpu:2: job {hero.model_id}" in str(excinfo.value)
    assert "openrl.exclusive=true" in str(excinfo.value)


# ---------------------------------------------------------------- after a restart


def test_a_job_dropped_by_a_restart_is_lost_and_names_its_last_checkpoint(make_daemon):
    daemon = make_daemon()
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    path = training.save_state("before-restart").result().path
    daemon.stop()
    daemon.start()
    body = _status(daemon, training.model_id).json()
    service.close("success").result()  # the session outlives the restart
    assert (body["state"], body["last_checkpoint"], body["workers"]) == ("lost", path, [])
    assert body["waiting_for"] == f"a restore with create_training_client_from_state (last checkpoint: {path})"
