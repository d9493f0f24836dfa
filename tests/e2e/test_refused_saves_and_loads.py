"""A save or load refused at the door still takes its seq_id's turn (the real SDK against a real daemon).

The SDK numbers a training client's calls before sending them, so a client that
catches a refusal and carries on sends its next op under the following seq_id;
that op runs only if the refused one's turn has passed.
"""

from __future__ import annotations

import math

import pytest
import tinker
from tinker import types

API_KEY = "tml-test"
WAIT_S = 60  # a step on the tiny model takes well under a second; a wedged job never answers


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def _train_one_step(training: tinker.TrainingClient) -> tuple[types.ForwardBackwardOutput, types.OptimStepResponse]:
    """forward_backward then optim_step, sent together as a loop does; both results."""
    tokens = list(range(40, 60))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    fb = training.forward_backward([datum], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-2))
    return fb.result(timeout=WAIT_S), step.result(timeout=WAIT_S)


def test_a_training_step_after_a_save_refused_with_400_completes(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    with pytest.raises(tinker.BadRequestError) as refused:
        training.save_state("../x").result(timeout=WAIT_S)
    assert refused.value.status_code == 400
    assert refused.value.body == {"detail": "checkpoint name: must not contain '/' or '\\', got '../x'"}

    fb, step = _train_one_step(training)
    assert math.isfinite(fb.metrics["loss:sum"])
    assert isinstance(step, types.OptimStepResponse)


def test_a_training_step_after_a_load_refused_with_400_completes(service):
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    path = training.save_weights_for_sampler("no-optimizer").result(timeout=WAIT_S).path
    with pytest.raises(tinker.BadRequestError) as refused, pytest.warns(FutureWarning):
        training.load_state_with_optimizer(path).result(timeout=WAIT_S)
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "detail": f"{path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false"
    }

    fb, step = _train_one_step(training)
    assert math.isfinite(fb.metrics["loss:sum"])
    assert isinstance(step, types.OptimStepResponse)
