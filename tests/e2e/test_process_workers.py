"""`[workers] launcher = "process"`: trainers and samplers in worker processes, driven by the real SDK.

The numbers must be those of the engines in the daemon's process (the `shared_daemon`,
default config): the engines are the same code with the same torch thread count, and
everything crosses the worker protocol bit for bit, so losses, tokens and logprobs are
compared with `==`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from conftest import Daemon, engine_processes, write_config
from tinker import types

API_KEY = "tml-test"
ADAM = types.AdamParams(learning_rate=1e-2)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def train(service: tinker.ServiceClient, steps: int, seed: int) -> tuple[tinker.TrainingClient, list[float]]:
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
    rng = np.random.default_rng(seed)
    data = [datum(list(rng.integers(3, 300, size=20))) for _ in range(3)]
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    return training, losses


def start_process_daemon(root: Path, tiny_llama: Path) -> Daemon:
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama}, '[workers]\nlauncher = "process"'
    )
    return Daemon(root / "data", config, root / "daemon.log").start()


@pytest.fixture(scope="module")
def process_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    daemon = start_process_daemon(tmp_path_factory.mktemp("trainer-process"), tiny_llama)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def service(process_daemon):
    client = tinker.ServiceClient(base_url=process_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def test_training_in_a_process_gives_the_in_process_trainers_losses(service, shared_daemon):
    in_process = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    try:
        _, expected = train(in_process, steps=4, seed=11)
    finally:
        in_process.close("success").result()
    _, losses = train(service, steps=4, seed=11)
    assert losses == expected
    assert losses[-1] < losses[0]


def test_the_trainer_and_the_sampler_run_in_children_of_the_daemon(service, process_daemon):
    training, _ = train(service, steps=1, seed=12)
    training.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=1, seed=1)
    ).result()
    pid = process_daemon.proc.pid
    assert (len(engine_processes(pid, "trainer")), len(engine_processes(pid, "sampler"))) == (1, 1)


def sample_twice(service: tinker.ServiceClient, seed: int) -> list[tuple[list[int], list[float]]]:
    """Base-model samples with prompt logprobs: what a sampler in a process must give as one in the daemon does."""
    sampler = service.create_sampling_client(base_model="tiny-llama").result()
    result = sampler.sample(
        types.ModelInput.from_ints([5, 6, 7, 8, 9]), 2,
        types.SamplingParams(max_tokens=6, seed=seed, temperature=0.9), include_prompt_logprobs=True,
    ).result()
    return [(s.tokens, s.logprobs) for s in result.sequences] + [([], result.prompt_logprobs[1:])]


def test_sampling_in_a_process_gives_the_in_process_samplers_tokens_and_logprobs(service, shared_daemon):
    in_process = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    try:
        expected = sample_twice(in_process, seed=21)
    finally:
        in_process.close("success").result()
    assert sample_twice(service, seed=21) == expected


def test_a_bad_sample_request_fails_alone_and_the_sampler_serves_on(service):
    sampler = service.create_sampling_client(base_model="tiny-llama").result()
    with pytest.raises(tinker.RequestFailedError, match="token"):
        sampler.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2, seed=1)).result()
    ok = sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2, seed=1)).result()
    assert len(ok.sequences[0].tokens) == 2


def test_a_sampler_takes_the_weights_the_process_trained(service):
    training, _ = train(service, steps=2, seed=13)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [7, 8, 9, 10]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[]),
    ).result()
    tokens = list(result.sequences[0].tokens)
    forward = training.forward([datum(prompt + tokens)], "cross_entropy").result()
    forward_lp = np.asarray(forward.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1 :]
    np.testing.assert_allclose(np.asarray(result.sequences[0].logprobs), forward_lp, atol=1e-3)


def test_a_state_saved_by_the_process_resumes_the_run(service):
    training, _ = train(service, steps=2, seed=14)
    state = training.save_state("process-state").result().path
    continued = train_more(training, seed=14)
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    again = train_more(resumed, seed=14)
    assert again == continued


def train_more(training: tinker.TrainingClient, seed: int) -> list[float]:
    """Two more steps on fixed data; their losses."""
    rng = np.random.default_rng(seed + 100)
    data = [datum(list(rng.integers(3, 300, size=20))) for _ in range(3)]
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(ADAM).result()
    return losses


LOST = (
    "openrld-trainer tiny-llama died (exit status -9); the weights and optimizer "
    "state it held are gone: resume from a saved state"
)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    """(client, training client, its state saved before the kill, daemon): its trainer process was
    SIGKILLed after two steps, and the kill has been seen by one forward_backward. One daemon for
    the tests below (each start costs a daemon and two trainer processes); only the last of them
    brings the lost job back."""
    daemon = start_process_daemon(tmp_path_factory.mktemp("killed"), tiny_llama)
    client = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    training, _ = train(client, steps=2, seed=15)
    state = training.save_state("before-the-kill").result().path
    (engine,) = engine_processes(daemon.proc.pid, "trainer")
    os.kill(engine, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as raised:
        training.forward_backward([datum([3, 4, 5, 6])], "cross_entropy").result()
    assert LOST in str(raised.value)
    yield client, training, state, daemon
    client.close("success").result()
    daemon.stop()


def test_a_lost_jobs_later_calls_fail_with_the_same_error(killed):
    _, training, _, _ = killed
    with pytest.raises(tinker.RequestFailedError) as raised:
        training.optim_step(ADAM).result()
    assert LOST in str(raised.value)


def test_a_new_trainer_process_takes_the_place_of_the_killed_one(killed):
    client, _, _, daemon = killed
    _, losses = train(client, steps=2, seed=16)
    assert len(losses) == 2
    assert len(engine_processes(daemon.proc.pid, "trainer")) == 1


def test_a_killed_sampler_worker_fails_its_request_and_a_new_one_serves_the_next(killed):
    client, _, _, daemon = killed
    sampler = client.create_sampling_client(base_model="tiny-llama").result()
    params = types.SamplingParams(max_tokens=2, seed=1)
    sampler.sample(types.ModelInput.from_ints([3, 4]), 1, params).result()
    (engine,) = engine_processes(daemon.proc.pid, "sampler")
    os.kill(engine, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError, match="openrld-sampler tiny-llama died"):
        sampler.sample(types.ModelInput.from_ints([3, 4]), 1, params).result()
    again = sampler.sample(types.ModelInput.from_ints([3, 4]), 1, params).result()
    assert len(again.sequences[0].tokens) == 2
    assert engine_processes(daemon.proc.pid, "sampler") not in ([], [engine])


def test_the_daemon_samples_on_after_the_kill(killed):
    client, _, _, _ = killed
    sampler = client.create_sampling_client(base_model="tiny-llama").result()
    sampled = sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2, seed=1)).result()
    assert len(sampled.sequences[0].tokens) == 2


def test_a_lost_job_resumes_from_its_saved_state(killed):
    client, training, state, _ = killed
    training.load_state_with_optimizer(state).result()
    resumed = train_more(training, seed=15)
    from_state = train_more(client.create_training_client_from_state_with_optimizer(state).result(), seed=15)
    assert resumed == from_state


def wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def test_a_stopped_daemon_leaves_no_worker_process(tmp_path: Path, tiny_llama: Path):
    daemon = start_process_daemon(tmp_path, tiny_llama)
    client = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    train(client, steps=1, seed=16)
    client.close("success").result()
    workers = engine_processes(daemon.proc.pid)
    assert len(workers) == 2
    assert daemon.stop() == 0
    assert wait_gone(workers) == []


def test_a_killed_daemons_workers_exit_on_their_own(tmp_path: Path, tiny_llama: Path):
    daemon = start_process_daemon(tmp_path, tiny_llama)
    client = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    train(client, steps=1, seed=17)
    client.close("success").result()  # the base model's group, and its workers, outlive the session
    workers = engine_processes(daemon.proc.pid)
    assert len(workers) == 2
    daemon.proc.kill()  # the daemon alone, as the OOM killer would: its workers see their sockets close
    daemon.proc.wait()
    assert wait_gone(workers) == []
