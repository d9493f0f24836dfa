"""The built-in losses against hand-checked vectors: values and gradients worked out by hand
from Tinker's loss definitions, printed to six decimals.

Gradients are read by autograd from a leaf lp tensor, as if the model had produced those
target log-probs. lp is float64 so that the only error left is the vectors' rounding to six
decimals: hence atol=1e-6 (half an ulp of the printed value is 5e-7).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from openrld.batches import TrainDatum
from openrld.errors import BadRequest, NotSupportedYet
from openrld.gpu import losses

SPEC_ATOL = 1e-6  # the spec prints six decimals
VOCAB = 100


def run(loss_fn, lp_values, inputs, config=None, segments=None):
    """(loss:sum, metrics, ∂L/∂lp) of one loss call on a float64 leaf lp."""
    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    tensors = {key: torch.tensor(value, dtype=torch.float64) for key, value in inputs.items()}
    loss, metrics = losses.LOSSES[loss_fn].fn(lp, tensors, config or {}, segments)
    loss.backward()
    return loss.item(), metrics, lp.grad.tolist()


def datum(n, **inputs):
    """A datum of N = n positions with target token 1 everywhere unless given."""
    arrays = {"target_tokens": np.ones(n, np.int64)}
    for key, value in inputs.items():
        arrays[key] = np.asarray(value, np.int64 if key == "target_tokens" else np.float32)
    return TrainDatum(tokens=np.zeros(n, np.int64), inputs=arrays)


def close(actual, expected, atol=SPEC_ATOL):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


# ---------------------------------------------------------------- case 1: cross_entropy

CASE1_LP = [-0.5, -1.0, -2.0]


@pytest.mark.parametrize(
    "weights, expected_loss, expected_grad",
    [
        ([0, 1, 1], 3.0, [0, -1, -1]),
        ([1, 1, 1], 3.5, [-1, -1, -1]),
        ([0, 0, 0], 0.0, [0, 0, 0]),
        ([0.5, -1.0, 2.0], 3.25, [-0.5, 1.0, -2.0]),
    ],
    ids=["prompt-masked", "all-ones", "phase-1-zeros", "signed-phase-2"],
)
def test_cross_entropy_case1_vectors(weights, expected_loss, expected_grad):
    loss, metrics, grad = run("cross_entropy", CASE1_LP, {"weights": weights})
    close(loss, expected_loss)
    close(metrics["loss:sum"], expected_loss)
    close(grad, expected_grad)


def test_cross_entropy_without_weights_weighs_every_position_one():
    loss, metrics, grad = run("cross_entropy", CASE1_LP, {})
    close(loss, 3.5)
    close(grad, [-1, -1, -1])
    assert metrics["tokens:sum"] == 3


def test_custom_loss_phase_2_surrogate_carries_the_users_gradient():
    # §9 case 4: C = Σ lp², g = 2·lp = [−1, −2, −4]; phase 2 sends w = −g,
    # so the surrogate S = −Σ w·lp = 10.5 and ∂S/∂lp = g.
    loss, _, grad = run("cross_entropy", CASE1_LP, {"weights": [1.0, 2.0, 4.0]})
    close(loss, 10.5)
    close(grad, [-1.0, -2.0, -4.0])


CASE1_2D_LP = [[-0.2, -1.8], [-0.7, -0.9], [-3.0, -0.1]]
CASE1_2D_W = [[0, 0], [0.6, 0.4], [0.25, 0.75]]


def test_cross_entropy_2d_targets_sum_weighted_logprobs():
    # 0.6·0.7 + 0.4·0.9 + 0.25·3.0 + 0.75·0.1 = 1.605; ∂L/∂lp = −w.
    loss, metrics, grad = run("cross_entropy", CASE1_2D_LP, {"weights": CASE1_2D_W})
    close(loss, 1.605)
    close(grad, -np.asarray(CASE1_2D_W))
    assert metrics["tokens:sum"] == 4


def test_cross_entropy_2d_weights_from_csr_match_dense():
    # The spec's CSR form of the same weights: row 0 empty, crow [0, 0, 2, 4], col [0, 1, 0, 1].
    values = np.array([0.6, 0.4, 0.25, 0.75], np.float32)
    crow, col = [0, 0, 2, 4], [0, 1, 0, 1]
    from_csr = np.zeros((3, 2), np.float32)  # unlisted cells are 0
    for row in range(3):
        for j in range(crow[row], crow[row + 1]):
            from_csr[row, col[j]] = values[j]
    request = losses.validate_request(
        "cross_entropy", [datum(3, target_tokens=np.ones((3, 2)), weights=from_csr)], {}, vocab_size=VOCAB
    )
    packed = losses.pack_inputs(request, [0], torch.device("cpu"))
    lp = torch.tensor(CASE1_2D_LP, dtype=torch.float64).reshape(-1)
    loss, _ = losses.cross_entropy(lp, packed.inputs, request.config, packed.segments)
    # The weights crossed the wire as float32, so compare at float32 resolution.
    close(loss.item(), 1.605, atol=1e-6)


def test_zero_weight_makes_minus_infinity_logprob_contribute_exactly_zero():
    loss, _, grad = run("cross_entropy", [-math.inf, -1.0], {"weights": [0.0, 1.0]})
    assert loss == 1.0
    assert grad == [0.0, -1.0]


# ---------------------------------------------------------------- case 2: every RL loss, one datum

CASE2_LP = [-1.0, -0.5, -2.0]
CASE2_INPUTS = {"logprobs": [-1.2, -0.4, -1.0], "advantages": [1.0, -1.0, 0.5]}


@pytest.mark.parametrize(
    "loss_fn, config, extra, expected_loss, expected_grad",
    [
        ("importance_sampling", {}, {}, -0.500505, [-1.221403, 0.904837, -0.183940]),
        ("ppo", {}, {}, -0.479102, [0, 0.904837, -0.183940]),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}, -0.379102, [0, 0.904837, -0.183940]),
        ("cispo", {}, {}, 1.136863, [-1.221403, 0.904837, -0.183940]),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {}, 1.547581, [-1.2, 0.904837, -0.4]),
        ("dro", {"beta": 0.05}, {}, 1.526250, [-0.99, 0.995, -0.55]),
        ("dro", {"beta": 1.0}, {}, 2.025, [-0.8, 0.9, -1.5]),
        ("dro", {}, {}, 1.526250, [-0.99, 0.995, -0.55]),  # default β = 0.05
        ("gspo", {}, {"sequence_ratio_mask": [1, 1, 1]}, -0.311227, [-0.740818, 0, -0.370409]),
    ],
    ids=["is", "ppo", "ppo-0.9-1.1", "cispo", "cispo-0.8-1.2", "dro-0.05", "dro-1", "dro-default", "gspo"],
)
def test_rl_loss_case2_vectors(loss_fn, config, extra, expected_loss, expected_grad):
    loss, metrics, grad = run(loss_fn, CASE2_LP, {**CASE2_INPUTS, **extra}, config)
    close(loss, expected_loss)
    close(metrics["loss:sum"], expected_loss)
    close(grad, expected_grad)


def test_ppo_counts_the_clipped_position():
    # Position 0 (A > 0, r = 1.2214 > 1.2) is the only one whose gradient the clip removes.
    _, metrics, _ = run("ppo", CASE2_LP, CASE2_INPUTS)
    assert metrics == {"loss:sum": pytest.approx(-0.479102, abs=SPEC_ATOL), "tokens:sum": 3, "clipped_tokens:sum": 1}


@pytest.mark.parametrize("loss_fn", sorted(losses.LOSSES))
def test_every_loss_emits_its_declared_metric_keys(loss_fn):
    inputs = {**CASE2_INPUTS, "sequence_ratio_mask": [1, 1, 1], "weights": [1, 1, 1]}
    # stable_reinforce also reads what the server attaches from its stability records.
    recorded = {"sampler_logprobs": CASE2_INPUTS["logprobs"], "sampled_mask": [1, 1, 1]}
    allowed = {k: v for k, v in inputs.items() if k in losses.LOSSES[loss_fn].allowed_inputs}
    if loss_fn == "stable_reinforce":
        allowed.update(recorded)
    _, metrics, _ = run(loss_fn, CASE2_LP, allowed)
    assert tuple(metrics) == losses.LOSSES[loss_fn].metric_keys
    assert metrics["loss:sum"] != 0  # each loss really computed something here


# ---------------------------------------------------------------- case 3: two datums, padding, overrides

CASE3_A = datum(
    4,
    logprobs=[0, 0, -0.3, -0.5],
    advantages=[0, 0, 2, 2],
    sequence_ratio_mask=[0, 0, 1, 1],
)
CASE3_B = datum(3, logprobs=[0, -0.4, -1.2], advantages=[0, -1, -1], sequence_ratio_mask=[0, 1, 1])
CASE3_LP = [-3.0, -0.25, -0.1, -0.7, -1.5, -0.4, -0.9]  # a then b, packed


def run_packed(loss_fn, data, lp_values, config=None):
    """Validate and pack like the trainer, then run the loss on a leaf lp (float64)."""
    keep = losses.LOSSES[loss_fn].allowed_inputs
    data = [TrainDatum(d.tokens, {k: v for k, v in d.inputs.items() if k in keep}) for d in data]
    request = losses.validate_request(loss_fn, data, config or {}, vocab_size=VOCAB)
    packed = losses.pack_inputs(request, range(len(data)), torch.device("cpu"))
    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    loss, metrics = request.spec.fn(lp, packed.inputs, request.config, packed.segments)
    loss.backward()
    return metrics, lp.grad.tolist()


# The inputs travel as float32 (q = -0.3 is -0.30000001), so these use atol 2e-6.
PACKED_ATOL = 2e-6


@pytest.mark.parametrize(
    "loss_fn, expected_loss, expected_grad",
    [
        ("importance_sampling", -1.730408, [0, 0, -2.442806, -1.637462, 0, 1, 1.349859]),
        ("ppo", -1.687603, [0, 0, 0, -1.637462, 0, 1, 1.349859]),
        ("cispo", -0.224369, [0, 0, -2.442806, -1.637462, 0, 1, 1.349859]),
        ("dro", 0.587062, [-0.15, -0.0125, -1.99, -2.01, -0.075, 1, 1.015]),
        ("gspo", -1.676332, [0, 0, -2, -2, 0, 1.161834, 1.161834]),
    ],
)
def test_two_datums_case3_sum_over_datums(loss_fn, expected_loss, expected_grad):
    metrics, grad = run_packed(loss_fn, [CASE3_A, CASE3_B], CASE3_LP)
    close(metrics["loss:sum"], expected_loss, atol=PACKED_ATOL)
    close(grad, expected_grad, atol=PACKED_ATOL)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_two_datums_in_one_pack_equal_two_separate_packs(loss_fn):
    together, grad_together = run_packed(loss_fn, [CASE3_A, CASE3_B], CASE3_LP)
    alone_a, grad_a = run_packed(loss_fn, [CASE3_A], CASE3_LP[:4])
    alone_b, grad_b = run_packed(loss_fn, [CASE3_B], CASE3_LP[4:])
    close(together["loss:sum"], alone_a["loss:sum"] + alone_b["loss:sum"], atol=1e-12)
    close(grad_together, grad_a + grad_b, atol=1e-12)


def test_zero_advantage_prompt_positions_add_nothing_to_is_ppo_cispo_gspo():
    # Datum a's IS value −4.080267 is exactly its two sampled positions: −(1.221403 + 0.818731)·2.
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        _, grad = run_packed(loss_fn, [CASE3_A], CASE3_LP[:4])
        assert grad[:2] == [0.0, 0.0], loss_fn


def test_ppo_per_position_high_threshold_overrides_config():
    # hi = 1.5 at position 2 (r = 1.2214) unclips it, so PPO equals IS on datum a.
    override = datum(
        4, logprobs=[0, 0, -0.3, -0.5], advantages=[0, 0, 2, 2], clip_high_threshold=[1.2, 1.2, 1.5, 1.2]
    )
    metrics, grad = run_packed("ppo", [override], CASE3_LP[:4])
    close(metrics["loss:sum"], -4.080267, atol=PACKED_ATOL)
    close(grad, [0, 0, -2.442806, -1.637462], atol=PACKED_ATOL)
    assert metrics["clipped_tokens:sum"] == 0


def test_per_position_threshold_on_one_datum_leaves_the_other_on_config():
    # Datum b has no override: it keeps hi = 1.2 from config, and its A < 0 positions are not clipped.
    override = datum(
        4, logprobs=[0, 0, -0.3, -0.5], advantages=[0, 0, 2, 2], clip_high_threshold=[1.2, 1.2, 1.5, 1.2]
    )
    metrics, grad = run_packed("ppo", [override, CASE3_B], CASE3_LP)
    close(metrics["loss:sum"], -4.080267 + 2.349859, atol=PACKED_ATOL)
    close(grad, [0, 0, -2.442806, -1.637462, 0, 1, 1.349859], atol=PACKED_ATOL)


def test_zero_advantage_with_overflowing_ratio_stays_finite():
    # q = −1e30 on a prompt position makes Δ = 1e30 there; A = 0 must still mean exactly 0.
    loss, _, grad = run("importance_sampling", [-1.0, -2.0], {"logprobs": [-1e30, -2.0], "advantages": [0.0, 1.0]})
    assert loss == -1.0
    assert grad == [0.0, -1.0]


# ---------------------------------------------------------------- validation errors


def validate(loss_fn, data, config=None):
    return losses.validate_request(loss_fn, data, config or {}, vocab_size=VOCAB)


def rl_datum(n=4, **overrides):
    inputs = {"logprobs": [-0.5] * n, "advantages": [1.0] * n}
    inputs.update(overrides)
    return datum(n, **inputs)


def test_unknown_loss_lists_the_supported_names():
    with pytest.raises(BadRequest) as error:
        validate("sft", [rl_datum()])
    assert error.value.detail == (
        "unknown loss_fn 'sft'; supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo, "
        "stable_reinforce"
    )


def test_server_side_custom_loss_is_not_supported_yet():
    with pytest.raises(NotSupportedYet) as error:
        validate("custom", [rl_datum()])
    assert "custom" in error.value.detail


def test_empty_data_is_refused():
    with pytest.raises(BadRequest, match="at least one datum"):
        validate("cross_entropy", [])


def test_missing_required_input_names_the_key_and_datum():
    data = [rl_datum(), datum(4, logprobs=[0.0] * 4)]
    with pytest.raises(BadRequest) as error:
        validate("ppo", data)
    assert error.value.detail == (
        "datum 1: loss_fn_inputs is missing 'advantages', which loss 'ppo' requires "
        "(required: target_tokens, logprobs, advantages)"
    )
    assert error.value.key == "advantages"


def test_mask_input_is_refused_listing_the_allowed_keys():
    with pytest.raises(BadRequest) as error:
        validate("importance_sampling", [rl_datum(mask=[1.0] * 4)])
    assert error.value.detail == (
        "datum 0: loss_fn_inputs['mask'] is not accepted by loss 'importance_sampling'; "
        "allowed keys: target_tokens, logprobs, advantages"
    )


def test_short_advantages_give_the_spec_message():
    data = [rl_datum(512) for _ in range(3)] + [rl_datum(512, advantages=[1.0] * 511)]
    with pytest.raises(BadRequest) as error:
        validate("ppo", data)
    assert error.value.detail == (
        "datum 3: loss_fn_inputs['advantages'] has shape [511]; expected [512] (model_input length) for loss 'ppo'"
    )


def test_case3_advantages_of_length_three_for_datum_a_are_refused():
    bad_a = datum(4, logprobs=[0, 0, -0.3, -0.5], advantages=[0, 2, 2])
    with pytest.raises(BadRequest, match=r"datum 0: loss_fn_inputs\['advantages'\] has shape \[3\]; expected \[4\]"):
        validate("importance_sampling", [bad_a, CASE3_B])


def test_two_dimensional_targets_are_refused_by_rl_losses():
    with pytest.raises(BadRequest, match=r"target_tokens'\] has shape \[4, 2\]; expected \[4\]"):
        validate("importance_sampling", [rl_datum(target_tokens=np.ones((4, 2)))])


def test_weights_must_have_the_shape_of_the_targets():
    bad = datum(3, target_tokens=np.ones((3, 2)), weights=[1.0, 1.0, 1.0])
    with pytest.raises(BadRequest) as error:
        validate("cross_entropy", [bad])
    assert error.value.detail == (
        "datum 0: loss_fn_inputs['weights'] has shape [3]; expected [3, 2] (the shape of target_tokens) "
        "for loss 'cross_entropy'"
    )


def test_target_token_outside_the_vocabulary_is_refused():
    with pytest.raises(BadRequest) as error:
        validate("cross_entropy", [datum(3, target_tokens=[1, VOCAB, 2])])
    assert error.value.detail == (
        "datum 0: loss_fn_inputs['target_tokens'] has token id 100 at position 1; "
        "expected ids in [0, 100) for loss 'cross_entropy'"
    )


def test_negative_target_token_in_2d_targets_names_row_and_column():
    with pytest.raises(BadRequest, match=r"token id -1 at position \(2, 1\)"):
        validate("cross_entropy", [datum(3, target_tokens=[[1, 1], [1, 1], [1, -1]])])


def test_integral_float_targets_are_accepted_and_fractional_ones_refused():
    ok = validate("cross_entropy", [datum(2, target_tokens=[3, 4])])
    floats = TrainDatum(np.zeros(2, np.int64), {"target_tokens": np.array([3.0, 4.0], np.float32)})
    assert validate("cross_entropy", [floats]).inputs[0]["target_tokens"].tolist() == [3, 4]
    assert ok.inputs[0]["target_tokens"].dtype == np.int64
    fractional = TrainDatum(np.zeros(2, np.int64), {"target_tokens": np.array([3.0, 4.5], np.float32)})
    with pytest.raises(BadRequest, match=r"non-integral value 4\.5 at position 1"):
        validate("cross_entropy", [fractional])


def test_integer_advantages_are_widened_to_float32():
    integer = TrainDatum(
        np.zeros(2, np.int64),
        {"target_tokens": np.ones(2, np.int64), "logprobs": np.zeros(2, np.int64), "advantages": np.array([1, 0])},
    )
    assert validate("importance_sampling", [integer]).inputs[0]["advantages"].dtype == np.float32


def test_minus_infinity_sampler_logprob_is_refused():
    bad = datum(4, logprobs=[0, 0, -math.inf, -0.5], advantages=[0, 0, 2, 2])
    with pytest.raises(BadRequest) as error:
        validate("importance_sampling", [bad])
    assert error.value.detail == (
        "datum 0: loss_fn_inputs['logprobs'] has a non-finite value (-inf) at position 2 for loss 'importance_sampling'"
    )


def test_nan_weight_is_refused():
    with pytest.raises(BadRequest, match=r"weights'\] has a non-finite value \(nan\) at position 0"):
        validate("cross_entropy", [datum(2, weights=[math.nan, 1.0])])


@pytest.mark.parametrize(
    "loss_fn, config, message",
    [
        (
            "cross_entropy",
            {"beta": 0.1},
            "loss_fn_config key 'beta' is not accepted by loss 'cross_entropy'; accepted keys: none",
        ),
        ("ppo", {"clip_ratio": 0.2}, "accepted keys: clip_low_threshold, clip_high_threshold"),
        ("ppo", {"clip_low_threshold": "0.8"}, "loss_fn_config['clip_low_threshold'] must be a number for loss 'ppo'"),
        ("ppo", {"clip_high_threshold": math.inf}, "loss_fn_config['clip_high_threshold'] must be finite"),
        ("ppo", {"clip_low_threshold": 1.3}, "clip_low_threshold 1.3 > clip_high_threshold 1.2 in loss_fn_config"),
        ("cispo", {"clip_low_threshold": -0.1}, "loss_fn_config['clip_low_threshold'] must be >= 0 for loss 'cispo'"),
        ("dro", {"beta": -1.0}, "loss_fn_config['beta'] must be >= 0 for loss 'dro'; got -1.0"),
    ],
    ids=["ce-has-no-config", "unknown-key", "text-value", "infinite", "lo-above-hi", "negative-lo", "negative-beta"],
)
def test_bad_loss_config_is_refused(loss_fn, config, message):
    data = [rl_datum()] if loss_fn != "cross_entropy" else [datum(4)]
    with pytest.raises(BadRequest) as error:
        validate(loss_fn, data, config)
    assert message in error.value.detail


def test_per_position_low_threshold_above_high_is_refused():
    bad = rl_datum(clip_low_threshold=[0.8, 0.8, 1.3, 0.8])
    with pytest.raises(BadRequest) as error:
        validate("ppo", [bad])
    assert error.value.detail == (
        "datum 0: clip_low_threshold 1.3 > clip_high_threshold 1.2 at position 2 for loss 'ppo'"
    )


def test_gspo_with_an_empty_sequence_ratio_mask_is_refused():
    bad = datum(4, logprobs=[0, 0, -0.3, -0.5], advantages=[0, 0, 2, 2], sequence_ratio_mask=[0, 0, 0, 0])
    with pytest.raises(BadRequest, match="datum 0: loss_fn_inputs\\['sequence_ratio_mask'\\] marks no position"):
        validate("gspo", [bad])


def test_non_finite_loss_is_refused_before_backward():
    # Δ = 100 with A = −1 overflows exp in float32: the loss is +inf.
    lp = torch.tensor([0.0], requires_grad=True)
    inputs = {"logprobs": torch.tensor([-100.0]), "advantages": torch.tensor([-1.0])}
    loss, _ = losses.importance_sampling(lp, inputs, {})
    with pytest.raises(BadRequest, match="loss for 'importance_sampling' is not finite \\(inf\\)"):
        losses.check_finite_loss(loss, "importance_sampling")
    assert lp.grad is None
