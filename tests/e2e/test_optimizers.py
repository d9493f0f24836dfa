"""Optimizer families through the real SDK: Dimuon chosen at creation, kept across save and
resume, and a step of the other family failing as a user error."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

API_KEY = "tml-test"
DIMUON = types.DimuonOptimizerConfig()


def _datum() -> types.Datum:
    tokens = list(range(5, 25))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def dimuon_state(service) -> tuple[str, float]:
    """A Dimuon model trained two steps and saved: (state path, the loss after a third step).

    The third step uses the momentum of the first two, so a resume that lost it would differ.
    """
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0, optimizer=DIMUON).result()
    for _ in range(2):
        training.forward_backward([_datum()], "cross_entropy").result()
        training.optim_step(types.DimuonParams(learning_rate=0.05)).result()
    path = training.save_state("dimuon-2").result().path
    return path, _step_then_loss(training)


def _step_then_loss(training) -> float:
    training.forward_backward([_datum()], "cross_entropy").result()
    training.optim_step(types.DimuonParams(learning_rate=0.05, beta1=0.5)).result()
    return training.forward([_datum()], "cross_entropy").result().metrics["loss:sum"]


def test_get_info_reports_a_dimuon_model_as_dimuon(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0, optimizer=DIMUON).result()
    config = training.get_info().optimizer_config
    assert (config.type, config.version) == ("dimuon", 1)


def test_adam_params_on_a_dimuon_model_fail_and_the_corrected_step_succeeds(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1, optimizer=DIMUON).result()
    training.forward_backward([_datum()], "cross_entropy").result()
    with pytest.raises(tinker.TinkerError, match=r"optimizer mismatch: model \S+ uses 'dimuon' \(version 1\)"):
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
    # The gradient was kept: the corrected step applies it (a zero norm would mean it was lost).
    metrics = training.optim_step(types.DimuonParams(learning_rate=0.05)).result().metrics
    assert metrics["grad_norm:mean"] > 0


def test_a_mismatched_step_pipelined_behind_forward_backwards_fails_alone(service):
    """Submitted without waiting, the step may run in one worker call with the passes before it."""
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=2, optimizer=DIMUON).result()
    passes = [training.forward_backward([_datum()], "cross_entropy") for _ in range(2)]
    wrong = training.optim_step(types.AdamParams(learning_rate=0.05))
    assert [p.result().metrics["loss:sum"] > 0 for p in passes] == [True, True]
    with pytest.raises(tinker.TinkerError, match=r"optimizer mismatch: model \S+ uses 'dimuon' \(version 1\)"):
        wrong.result()
    metrics = training.optim_step(types.DimuonParams(learning_rate=0.05)).result().metrics
    assert metrics["grad_norm:mean"] > 0


def test_resume_with_optimizer_keeps_dimuon_and_continues_the_run(service, dimuon_state):
    path, uninterrupted_loss = dimuon_state
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().optimizer_config.type == "dimuon"
    assert _step_then_loss(resumed) == pytest.approx(uninterrupted_loss, abs=1e-5)  # the resume bound


def test_weights_only_resume_of_a_dimuon_checkpoint_is_adamw(service, dimuon_state):
    path, _ = dimuon_state
    resumed = service.create_training_client_from_state(path).result()
    assert resumed.get_info().optimizer_config.type == "adamw"
    resumed.forward_backward([_datum()], "cross_entropy").result()
    resumed.optim_step(types.AdamParams(learning_rate=0.05)).result()
