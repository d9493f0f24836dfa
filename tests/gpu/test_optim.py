"""AdamW against hand-checked vectors and against torch's own.

Tolerances: the scalar vectors are checked in float64 at 1e-9 (the spec gives ten digits
for p₂); parity with torch.optim.AdamW is 1e-6 relative (the
two differ only in float32 reduction order of the gradient norm).
"""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

from openrld.batches import AdamParams
from openrld.errors import BadRequest
from openrld.gpu.optim import AdamW

CASE4 = AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01)


def scalar_param(value: float = 1.0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor([value], dtype=torch.float64))


def test_case4_first_step_decays_then_moves_by_the_learning_rate():
    # decay 1.0 → 0.999; m̂ = 0.5, v̂ = 0.25, so the step is 0.1·0.5/0.5 = 0.1.
    p = scalar_param()
    optimizer = AdamW({"p": p})
    p.grad = torch.tensor([0.5], dtype=torch.float64)
    optimizer.step(CASE4)
    assert p.item() == pytest.approx(0.899, abs=1e-12)


def test_case4_second_step_uses_bias_corrected_moments():
    p = scalar_param()
    optimizer = AdamW({"p": p})
    for grad in (0.5, -0.25):
        p.grad = torch.tensor([grad], dtype=torch.float64)
        optimizer.step(CASE4)
    assert p.item() == pytest.approx(0.8712640552, abs=1e-9)


def test_case4_clipping_scales_by_c_over_norm_plus_eps_and_reports_the_pre_clip_norm():
    # ‖[3, 4]‖ = 5, c = 1: g ← g·1/(5 + 1e-6), so m = 0.1·g = [0.06, 0.08]·(5/(5 + 1e-6)).
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = AdamW({"p": p})
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    metrics = optimizer.step(AdamParams(learning_rate=0.1, grad_clip_norm=1.0))
    assert metrics == {"grad_norm:mean": 5.0, "learning_rate:mean": 0.1}
    factor = 1.0 / (5.0 + 1e-6)
    expected = torch.tensor([0.3, 0.4], dtype=torch.float64) * factor
    torch.testing.assert_close(optimizer.state_tensors()["p.exp_avg"], expected, rtol=0, atol=1e-15)


def make_params(seed: int) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"a": (4, 3), "b": (3,), "c": (2, 5)}
    return {name: torch.nn.Parameter(torch.randn(shape, generator=generator)) for name, shape in shapes.items()}


def set_grads(params: dict[str, torch.nn.Parameter], step: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=generator) * scale


SCHEDULE = [
    AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
    AdamParams(learning_rate=8e-3, beta1=0.85, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
    AdamParams(learning_rate=6e-3, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
    AdamParams(learning_rate=4e-3, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=100.0),
    AdamParams(learning_rate=2e-3, beta1=0.9, beta2=0.999, eps=1e-12, weight_decay=0.01, grad_clip_norm=0.5),
]


def test_matches_torch_adamw_with_clip_grad_norm_over_changing_hyperparameters():
    ours, theirs = make_params(0), make_params(0)
    optimizer = AdamW(ours)
    reference = torch.optim.AdamW(list(theirs.values()), foreach=False)
    for step, hp in enumerate(SCHEDULE):
        set_grads(ours, step, scale=3.0)  # norms around 6: clipping is active at c = 1 and 0.5
        set_grads(theirs, step, scale=3.0)
        metrics = optimizer.step(hp)
        # max_norm = inf makes torch's factor min(1, inf) = 1: the norm without clipping.
        max_norm = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(list(theirs.values()), max_norm)
        for group in reference.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        reference.step()
        reference.zero_grad(set_to_none=True)
        assert metrics["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-6)
        assert metrics["learning_rate:mean"] == hp.learning_rate
        for name in ours:
            torch.testing.assert_close(ours[name].detach(), theirs[name].detach(), rtol=1e-6, atol=1e-7)


def test_step_clears_the_gradients():
    params = make_params(0)
    optimizer = AdamW(params)
    set_grads(params, 0)
    optimizer.step(AdamParams())
    assert all(p.grad is None for p in params.values())


def test_step_without_gradients_is_a_no_op():
    params = make_params(0)
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer = AdamW(params)
    metrics = optimizer.step(AdamParams(learning_rate=0.1, weight_decay=0.5))
    assert metrics == {"grad_norm:mean": 0.0, "learning_rate:mean": 0.1}
    assert all(torch.equal(params[name], before[name]) for name in params)
    assert optimizer.steps_done == 0
    assert optimizer.state_tensors() == {}


def test_tensor_without_gradient_is_skipped_entirely():
    # No decay, no moment update, no step count for "b", exactly as torch skips grad=None.
    params = make_params(0)
    b_before = params["b"].detach().clone()
    optimizer = AdamW(params)
    set_grads(params, 0)
    params["b"].grad = None
    optimizer.step(AdamParams(learning_rate=0.1, weight_decay=0.5))
    assert torch.equal(params["b"], b_before)
    assert "b.step" not in optimizer.state_tensors()
    assert optimizer.state_tensors()["a.step"].item() == 1


def test_exported_state_continues_exactly_like_an_uninterrupted_run():
    uninterrupted = make_params(0)
    optimizer = AdamW(uninterrupted)
    for step in range(3):
        set_grads(uninterrupted, step)
        optimizer.step(SCHEDULE[step])
    # Through safetensors bytes, as a checkpoint would go.
    saved_state = safetensors.torch.load(safetensors.torch.save(optimizer.state_tensors()))
    resumed = {name: torch.nn.Parameter(p.detach().clone()) for name, p in uninterrupted.items()}
    resumed_optimizer = AdamW(resumed)
    resumed_optimizer.load_state_tensors(saved_state)
    assert resumed_optimizer.steps_done == 3
    for step in range(3, 5):
        set_grads(uninterrupted, step)
        set_grads(resumed, step)
        optimizer.step(SCHEDULE[step])
        resumed_optimizer.step(SCHEDULE[step])
    assert all(torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted)


def test_import_refuses_state_of_another_shape():
    params = make_params(0)
    optimizer = AdamW(params)
    set_grads(params, 0)
    optimizer.step(AdamParams())
    state = optimizer.state_tensors()
    state["a.exp_avg"] = torch.zeros(5)
    with pytest.raises(BadRequest, match=r"optimizer state 'a.exp_avg' has shape \[5\]; expected \[4, 3\]"):
        AdamW(make_params(0)).load_state_tensors(state)


def test_non_finite_gradient_norm_discards_gradients_and_updates_nothing():
    params = make_params(0)
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer = AdamW(params)
    set_grads(params, 0)
    params["c"].grad[0, 0] = math.inf
    with pytest.raises(BadRequest, match=r"^non-finite gradient norm \(check loss inputs\)$"):
        optimizer.step(AdamParams(learning_rate=0.1))
    assert all(p.grad is None for p in params.values())
    assert all(torch.equal(params[name], before[name]) for name in params)
    assert optimizer.steps_done == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("learning_rate", -1e-3, "adam_params.learning_rate must be >= 0; got -0.001"),
        ("learning_rate", math.nan, "adam_params.learning_rate must be a finite number; got nan"),
        ("beta1", 1.0, "adam_params.beta1 must be in [0, 1); got 1.0"),
        ("beta2", -0.1, "adam_params.beta2 must be in [0, 1); got -0.1"),
        ("eps", -1e-8, "adam_params.eps must be >= 0; got -1e-08"),
        ("weight_decay", math.inf, "adam_params.weight_decay must be a finite number; got inf"),
        ("grad_clip_norm", math.nan, "adam_params.grad_clip_norm must be a finite number; got nan"),
    ],
)
def test_invalid_hyperparameter_is_refused_and_keeps_the_gradient(field, value, message):
    params = make_params(0)
    optimizer = AdamW(params)
    set_grads(params, 0)
    grads = {name: p.grad.clone() for name, p in params.items()}
    bad = AdamParams(**{field: value})
    with pytest.raises(BadRequest) as error:
        optimizer.step(bad)
    assert error.value.detail == message
    assert error.value.key == field
    assert all(torch.equal(params[name].grad, grads[name]) for name in params)


def test_negative_grad_clip_norm_means_no_clipping():
    clipped_off, reference = make_params(0), make_params(0)
    set_grads(clipped_off, 0, scale=10.0)
    set_grads(reference, 0, scale=10.0)
    AdamW(clipped_off).step(AdamParams(learning_rate=0.1, grad_clip_norm=-1.0))
    AdamW(reference).step(AdamParams(learning_rate=0.1, grad_clip_norm=0.0))
    assert all(torch.equal(clipped_off[name], reference[name]) for name in reference)


# ---------------------------------------------------------------------------
# Narrow parameters: an fp32 master copy, and gradients widened one at a time


def test_a_bf16_parameter_keeps_steps_smaller_than_its_rounding_in_an_fp32_master() -> None:
    # 1.0 in bf16 has a rounding step of 2^-8 ≈ 0.0039; each step moves it by 1e-3 (Adam's
    # first steps are ±lr), so a bf16-only update would round every one of them away.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    reference = torch.nn.Parameter(torch.ones(4, dtype=torch.float32))
    optimizer, fp32 = AdamW({"p": p}), AdamW({"p": reference})
    params = AdamParams(learning_rate=1e-3, weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
        reference.grad = torch.full((4,), 0.5)
        optimizer.step(params)
        fp32.step(params)
    assert torch.equal(optimizer.master_tensors()["p"], reference.detach())  # the fp32 run, bit for bit
    assert torch.equal(p.detach(), reference.detach().to(torch.bfloat16))  # the master, rounded
    assert p[0].item() != 1.0


def test_the_master_copy_is_saved_and_restored_with_the_moments() -> None:
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = AdamW({"p": p})
    p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    optimizer.step(AdamParams(learning_rate=1e-3))
    state = safetensors.torch.load(safetensors.torch.save(optimizer.state_tensors()))
    assert state["p.master"].dtype == torch.float32
    resumed = AdamW({"p": torch.nn.Parameter(p.detach().clone())})
    resumed.load_state_tensors(state)
    assert torch.equal(resumed.master_tensors()["p"], optimizer.master_tensors()["p"])


def test_gradients_are_widened_one_at_a_time_as_each_is_applied() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name == "_to_copy" and kwargs and kwargs.get("dtype") == torch.float32:
                self.ops.append("widen")
            elif name == "addcdiv_":
                self.ops.append("update")
            return func(*args, **(kwargs or {}))

    params = {name: torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)) for name in ("a", "b", "c")}
    optimizer = AdamW(params)
    for p in params.values():
        p.grad = torch.full((8,), 0.5, dtype=torch.bfloat16)
    with Log() as log:
        optimizer.step(AdamParams(learning_rate=1e-3, grad_clip_norm=1.0))
    # One widened gradient (then the master copy) per tensor, each applied before the next is made.
    assert log.ops == ["widen", "widen", "update"] * 3
