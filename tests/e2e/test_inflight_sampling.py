"""Inflight sampling clients with the real SDK.

A fixed continuation is scored with `compute_logprobs` (raw T = 1 logprobs) under each
client and compared with the trainer's `forward` under the weights of the moment: an
inflight client follows the newest inflight save, a snapshot client keeps its weights,
and optim_step alone publishes nothing.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

API_KEY = "tml-test"
TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
TRAIN = [types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
)]
AGREE_ATOL = 1e-3  # sampler vs trainer logprobs (issue 04)


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def scored(sampler: tinker.SamplingClient) -> np.ndarray:
    return np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:], np.float64)


def trained_now(training: tinker.TrainingClient) -> np.ndarray:
    return np.asarray(training.forward(TRAIN, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())


def train_a_step(training: tinker.TrainingClient) -> None:
    training.forward_backward(TRAIN, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def test_older_inflight_client_follows_the_newest_inflight_save(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=21).result()
    train_a_step(training)
    first = training.save_weights_and_get_sampling_client(kind="inflight").result()
    w1 = trained_now(training)
    np.testing.assert_allclose(scored(first), w1, atol=AGREE_ATOL)

    train_a_step(training)
    w2 = trained_now(training)
    assert np.abs(w2 - w1).max() > 0.05  # the step really moved the weights
    np.testing.assert_allclose(scored(first), w1, atol=AGREE_ATOL)  # optim_step alone publishes nothing

    second = training.save_weights_and_get_sampling_client(kind="inflight").result()
    np.testing.assert_allclose(scored(first), w2, atol=AGREE_ATOL)
    np.testing.assert_allclose(scored(second), w2, atol=AGREE_ATOL)


def test_snapshot_client_keeps_its_weights_after_an_inflight_save(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=22).result()
    train_a_step(training)
    snapshot = training.save_weights_and_get_sampling_client().result()
    w1 = trained_now(training)
    train_a_step(training)
    inflight = training.save_weights_and_get_sampling_client(kind="inflight").result()
    w2 = trained_now(training)
    np.testing.assert_allclose(scored(snapshot), w1, atol=AGREE_ATOL)
    np.testing.assert_allclose(scored(inflight), w2, atol=AGREE_ATOL)


def test_inflight_clients_of_two_models_follow_their_own_model(service):
    a = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=23).result()
    b = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=24).result()
    train_a_step(a)
    on_a = a.save_weights_and_get_sampling_client(kind="inflight").result()
    on_b = b.save_weights_and_get_sampling_client(kind="inflight").result()
    train_a_step(b)
    b.save_weights_and_get_sampling_client(kind="inflight").result()
    np.testing.assert_allclose(scored(on_a), trained_now(a), atol=AGREE_ATOL)
    np.testing.assert_allclose(scored(on_b), trained_now(b), atol=AGREE_ATOL)


def test_inflight_session_reports_no_model_path(service, shared_daemon):
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=25).result()
    sampler = training.save_weights_and_get_sampling_client(kind="inflight").result()
    with httpx.Client(base_url=shared_daemon.url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
        body = http.get(f"/api/v1/samplers/{sampler._sampling_session_id}").json()
    # No model path: the key is left out, as every reply leaves out a field at the SDK's default.
    assert body == {"sampler_id": sampler._sampling_session_id, "base_model": "tiny-qwen3"}
