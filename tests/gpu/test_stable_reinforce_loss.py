"""stable_reinforce: openrld's proposed loss math and its validation.

The vectors are the spec's case 2 (§9): lp = [−1, −0.5, −2], q̂ = [−1.2, −0.4, −1],
A = [1, −1, 0.5], every position sampled. With κ = 0 the loss is CISPO with bounds
[0, 4] (+1.136863); with κ = 0.1 it adds 0.1·Σ(r − 1 − Δ) = 0.1·0.394119.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openrld.batches import TrainDatum
from openrld.errors import BadRequest
from openrld.gpu import losses

SPEC_ATOL = 1e-6  # the spec prints six decimals
VOCAB = 100
LP = [-1.0, -0.5, -2.0]
SAMPLER = [-1.2, -0.4, -1.0]
ADVANTAGES = [1.0, -1.0, 0.5]


def run(lp_values, advantages, sampler, mask, config=None):
    """(loss, metrics, ∂L/∂lp) of one call on a float64 leaf lp."""
    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    inputs = {
        "advantages": torch.tensor(advantages, dtype=torch.float64),
        "sampler_logprobs": torch.tensor(sampler, dtype=torch.float64),
        "sampled_mask": torch.tensor(mask, dtype=torch.float64),
    }
    loss, metrics = losses.stable_reinforce(lp, inputs, config or {}, None)
    loss.backward()
    return loss.item(), metrics, lp.grad.tolist()


@pytest.mark.parametrize(
    "kl_coeff, expected_loss, expected_grad",
    [
        (0.0, 1.136863, [-1.221403, 0.904837, -0.183940]),
        (0.1, 1.176275, [-1.199262, 0.895321, -0.247152]),
    ],
    ids=["kl0", "kl0.1"],
)
def test_case2_vectors(kl_coeff, expected_loss, expected_grad):
    loss, _, grad = run(LP, ADVANTAGES, SAMPLER, [1, 1, 1], {"kl_coeff": kl_coeff})
    assert loss == pytest.approx(expected_loss, abs=SPEC_ATOL)
    np.testing.assert_allclose(grad, expected_grad, rtol=0, atol=SPEC_ATOL)


def test_metrics_count_sampled_tokens_and_sum_the_kl_estimator():
    # r − 1 − Δ = [0.021403, 0.004837, 0.367879]; nothing exceeds the cap of 4.
    _, metrics, _ = run(LP, ADVANTAGES, SAMPLER, [1, 1, 1])
    assert metrics == {
        "loss:sum": pytest.approx(1.136863, abs=SPEC_ATOL),
        "tokens:sum": 3,
        "kl:sum": pytest.approx(0.394119, abs=SPEC_ATOL),
        "clipped_tokens:sum": 0,
    }


def test_ratio_above_four_is_capped_in_the_coefficient():
    # Δ = 2, r = e² = 7.389 > 4: the coefficient is 4, so ℓ = −4·A·lp = −4·1·(−1) = 4, ∂ = −4.
    loss, metrics, grad = run([-1.0], [1.0], [-3.0], [1])
    assert (loss, grad) == (pytest.approx(4.0, abs=SPEC_ATOL), [pytest.approx(-4.0, abs=SPEC_ATOL)])
    assert metrics["clipped_tokens:sum"] == 1


def test_prompt_positions_contribute_exactly_zero_even_with_the_kl_term():
    # Position 0 is a prompt position: lp = −50 against q̂ = 0 would give exp overflow-scale
    # terms if it were not masked. With κ = 0.1 only position 1 counts: r = 1, so KL = 0.
    loss, metrics, grad = run([-50.0, -0.5], [0.0, 2.0], [0.0, -0.5], [0, 1], {"kl_coeff": 0.1})
    assert loss == pytest.approx(1.0, abs=SPEC_ATOL)  # −1·2·(−0.5)
    assert grad == [0.0, pytest.approx(-2.0, abs=SPEC_ATOL)]
    assert metrics["tokens:sum"] == 1


def recorded_datum(recorded, **inputs):
    n = len(inputs["advantages"]) if recorded is None else len(recorded)
    arrays = {"target_tokens": np.ones(n, np.int64)}
    arrays.update({key: np.asarray(value, np.float32) for key, value in inputs.items()})
    return TrainDatum(
        tokens=np.zeros(n, np.int64), inputs=arrays,
        recorded_logprobs=None if recorded is None else np.asarray(recorded, np.float32),
    )


def test_validation_turns_records_into_sampler_logprobs_and_mask():
    checked = losses.validate_request(
        "stable_reinforce", [recorded_datum([np.nan, -0.25, -1.5], advantages=[0, 1, 1])], {}, vocab_size=VOCAB
    )
    inputs = checked.inputs[0]
    assert inputs["sampler_logprobs"].tolist() == [0.0, -0.25, -1.5]
    assert inputs["sampled_mask"].tolist() == [0.0, 1.0, 1.0]
    assert checked.config == {"kl_coeff": 0.0}


def test_datum_without_provenance_is_refused_naming_the_datum():
    data = [recorded_datum([-0.5, -0.5], advantages=[1, 1]), recorded_datum(None, advantages=[1, 1])]
    with pytest.raises(BadRequest) as error:
        losses.validate_request("stable_reinforce", data, {}, vocab_size=VOCAB)
    assert error.value.detail.startswith("datum 1: stable_reinforce needs provenance on every datum")
    assert error.value.key == "loss_fn_input_spans"


def test_client_cannot_send_the_recorded_inputs_itself():
    datum = recorded_datum([-0.5, -0.5], advantages=[1, 1], sampler_logprobs=[0.0, 0.0])
    with pytest.raises(BadRequest) as error:
        losses.validate_request("stable_reinforce", [datum], {}, vocab_size=VOCAB)
    assert error.value.detail == (
        "datum 0: loss_fn_inputs['sampler_logprobs'] is not accepted by loss 'stable_reinforce'; "
        "allowed keys: target_tokens, advantages, logprobs"
    )


def test_negative_kl_coeff_is_refused():
    with pytest.raises(BadRequest) as error:
        losses.validate_request(
            "stable_reinforce", [recorded_datum([-0.5], advantages=[1])], {"kl_coeff": -0.1}, vocab_size=VOCAB
        )
    assert (error.value.detail, error.value.key) == (
        "loss_fn_config['kl_coeff'] must be >= 0 for loss 'stable_reinforce'; got -0.1", "kl_coeff",
    )


def test_missing_advantages_are_refused_naming_the_key():
    with pytest.raises(BadRequest) as error:
        losses.validate_request("stable_reinforce", [recorded_datum([-0.5])], {}, vocab_size=VOCAB)
    assert error.value.key == "advantages"
