"""The Tinker training loop, driven by the real SDK against a real daemon (issue: one node)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import tinker
from tinker import types

API_KEY = "tml-test"


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token datum: input tokens[:-1], targets tokens[1:]."""
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": targets,
            "weights": weights if weights is not None else [1.0] * len(targets),
        },
    )


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def test_sft_halves_the_loss_within_a_few_dozen_steps(service, tiny_llama):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=8, seed=0).result()
    rng = np.random.default_rng(0)
    data = [_datum(list(rng.integers(3, 300, size=24))) for _ in range(4)]
    losses = []
    for _ in range(30):
        fb = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] <= losses[0] / 2, losses


def test_a_node_without_a_shared_root_writes_no_auto_save(service, shared_daemon):
    """Auto-saves (issue 41) go to a checkpoint root shared by the cluster; a node alone writes none."""
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    datum = _datum(list(range(5, 25)))
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    training.save_state("after-two-steps").result()  # runs after both steps, so any write of theirs came first
    checkpoints = shared_daemon.data_dir / "checkpoints"
    assert not (checkpoints / ".autosave").exists()
    assert sorted(os.listdir(checkpoints / training.model_id)) == ["weights"]
    assert os.listdir(shared_daemon.data_dir / "tmp") == []


def test_sampler_logprobs_agree_with_forward_at_temperature_one(service):
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    data = [_datum(list(range(5, 25)))]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [7, 8, 9, 10, 11]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[]),
    ).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.tokens) == 8 and seq.stop_reason == "length"
        full = prompt + list(seq.tokens)
        fwd = training.forward([_datum(full)], "cross_entropy").result()
        forward_lp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1 :]
        np.testing.assert_allclose(np.asarray(seq.logprobs), forward_lp, atol=1e-3)


def test_compute_logprobs_agrees_with_forward(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=2).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    fwd = training.forward([_datum(tokens)], "cross_entropy").result()
    assert logprobs[0] is None
    np.testing.assert_allclose(
        np.asarray(logprobs[1:]), np.asarray(fwd.loss_fn_outputs[0]["logprobs"].tolist()), atol=1e-3
    )


def test_an_rl_loop_runs_sample_importance_sampling_optim_new_sampler(service):
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=3).result()
    prompt = [20, 21, 22, 23]
    sampler = training.save_weights_and_get_sampling_client().result()
    for _ in range(3):
        result = sampler.sample(
            types.ModelInput.from_ints(prompt), num_samples=4,
            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, stop=[]),
        ).result()
        rewards = [float(np.mean([t % 2 for t in s.tokens])) for s in result.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for seq, reward in zip(result.sequences, rewards):
            full = prompt + list(seq.tokens)
            n_prompt = len(prompt) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                        "advantages": [0.0] * n_prompt + [reward - mean] * len(seq.tokens),
                    },
                )
            )
        fb = training.forward_backward(data, "importance_sampling").result()
        assert math.isfinite(fb.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()


def test_a_saved_sampler_version_keeps_its_weights_while_training_continues(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=4).result()
    data = [_datum(list(range(30, 50)))]
    path = training.save_weights_for_sampler("frozen").result().path
    assert path.endswith("/sampler_weights/frozen")
    sampler = service.create_sampling_client(model_path=path).result()
    prompt = types.ModelInput.from_ints([30, 31, 32, 33])
    before = sampler.compute_logprobs(prompt).result()
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = sampler.compute_logprobs(prompt).result()
    moved = training.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    assert before == after
    assert moved != before


def test_state_round_trips_through_save_state_and_create_from_state(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=5).result()
    data = [_datum(list(range(60, 80)))]
    for _ in range(2):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state_path = training.save_state("step2").result().path
    assert state_path.endswith("/weights/step2")
    reference = training.forward(data, "cross_entropy").result().metrics["loss:sum"]

    restored = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert restored.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(reference, abs=1e-6)
    weights_only = service.create_training_client_from_state(state_path).result()
    assert weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(reference, abs=1e-6)

    # Continuing from the restored optimizer state matches continuing the original.
    for client in (training, restored):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    b = restored.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, abs=1e-5)


def test_load_state_with_optimizer_rewinds_an_existing_client(service):
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=6).result()
    data = [_datum(list(range(90, 110)))]
    state_path = training.save_state("start").result().path
    start = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] != pytest.approx(start, abs=1e-6)
    training.load_state_with_optimizer(state_path).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(start, abs=1e-6)
    training.load_state(state_path).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(start, abs=1e-6)


def test_get_info_reports_the_real_base_model_rank_and_tokenizer(service, tiny_llama):
    training = service.create_lora_training_client(base_model=str(tiny_llama), rank=16).result()
    info = training.get_info()
    assert info.model_data.model_name == str(tiny_llama)
    assert info.model_data.tokenizer_id == str(tiny_llama)
    assert info.lora_rank == 16
    assert info.is_lora is True
    tokenizer = training.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("Hello world!")) == "Hello world!"


def test_server_capabilities_list_the_configured_models_first(service):
    caps = service.get_server_capabilities()
    # After them: the packaged SmolLM2, and the model directories this module's tests used.
    assert [m.model_name for m in caps.supported_models][:2] == ["tiny-llama", "tiny-qwen3"]
