"""A killed daemon loses no session, run or checkpoint, and never leaves a future polling forever."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def test_tinker_paths_still_work_after_kill_9_and_restart(make_daemon):
    daemon = make_daemon()
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    data = [_datum(list(range(40, 60)))]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state_path = training.save_state("kept").result().path
    sampler_path = training.save_weights_for_sampler("kept").result().path
    loss = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    prompt = types.ModelInput.from_ints([40, 41, 42, 43])
    logprobs = service.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
    service.close("success").result()

    daemon.kill()
    restarted = make_daemon(data_dir=daemon.data_dir)
    service = tinker.ServiceClient(base_url=restarted.url, api_key="tml-test")
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == loss
    assert service.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result() == logprobs
    service.close("success").result()


def test_a_future_pending_at_the_crash_answers_410(make_daemon, tiny_llama):
    daemon = make_daemon()
    headers = {"X-API-Key": "tml-test"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as http:
        session_id = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
        ).json()
        while http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json().get("type") == "try_again":
            pass
        # seq 5 can never run (1-4 never come), so it is pending when the daemon dies.
        pending = http.post(
            "/api/v1/optim_step", json={"model_id": created["model_id"], "seq_id": 5, "adam_params": {}}
        ).json()
    daemon.kill()
    restarted = make_daemon(data_dir=daemon.data_dir)
    with httpx.Client(base_url=restarted.url, headers=headers, timeout=60) as http:
        response = http.post("/api/v1/retrieve_future", json={"request_id": pending["request_id"]})
    assert response.status_code == 410
    assert "restart" in response.json()["detail"]


def test_resuming_after_kill_9_reproduces_the_losses_of_an_uninterrupted_run(make_daemon):
    data = [_datum(list(range(60, 84))), _datum(list(range(100, 116)))]
    adam = types.AdamParams(learning_rate=1e-2)

    def train(client, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(adam).result()
        return losses

    daemon = make_daemon()
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
    train(training, 2)
    state = training.save_state("step2").result().path
    uninterrupted = train(training, 3)
    train(training, 1)  # work after the checkpoint that the crash loses
    service.close("success").result()

    daemon.kill()
    restarted = make_daemon(data_dir=daemon.data_dir)
    service = tinker.ServiceClient(base_url=restarted.url, api_key="tml-test")
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert train(resumed, 3) == pytest.approx(uninterrupted, abs=1e-5)
    service.close("success").result()
