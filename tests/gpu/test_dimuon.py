"""Dimuon v1 (openrld's own): the reference class and the engine's family rules.

Everything runs in fp32 on the CPU. Directions are normalised, so their checks are at 1e-5
(the spec's bound for ‖D‖_F); parameters after a step are compared at 1e-6.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu.optim import Dimuon, dimuon_direction, rank_lr_correction
from openrld.gpu.torch_trainer import TorchTrainer

RANK = 4
PARAM_ATOL = 1e-6


def _lora_pair(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """A (r × n) and B (m × r), as peft shapes them, both non-zero."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.lora_A.weight": torch.nn.Parameter(torch.randn(RANK, 12, generator=generator)),
        "layer.lora_B.weight": torch.nn.Parameter(torch.randn(10, RANK, generator=generator)),
    }


def _set_grads(params: dict[str, torch.nn.Parameter], scale: float, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params.values():
        param.grad = scale * torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize("is_lora_b", [False, True], ids=["A", "B"])
def test_direction_has_frobenius_norm_sqrt_rank(is_lora_b: bool):
    shape = (10, RANK) if is_lora_b else (RANK, 12)
    momentum = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    direction = dimuon_direction(momentum, RANK, damping=1e-4, is_lora_b=is_lora_b)
    assert direction.shape == shape
    assert float(torch.linalg.matrix_norm(direction)) == pytest.approx(math.sqrt(RANK), abs=1e-5)


def test_direction_of_a_zero_momentum_is_zero():
    direction = dimuon_direction(torch.zeros(RANK, 12), RANK, damping=1e-4, is_lora_b=False)
    assert torch.equal(direction, torch.zeros(RANK, 12))


def test_stacked_experts_are_separate_matrices():
    momentum = torch.randn(3, RANK, 12, generator=torch.Generator().manual_seed(4))
    stacked = dimuon_direction(momentum, RANK, damping=1e-4, is_lora_b=False)
    for expert in range(3):
        alone = dimuon_direction(momentum[expert], RANK, damping=1e-4, is_lora_b=False)
        # Batched and single matmuls round differently; five Newton–Schulz steps amplify it.
        torch.testing.assert_close(stacked[expert], alone, atol=1e-5, rtol=0)


def test_rank_correction_is_one_at_rank_32_or_exponent_zero():
    assert rank_lr_correction(32, 0.175) == 1.0
    assert rank_lr_correction(4, 0.0) == 1.0
    assert rank_lr_correction(4, 0.175) == pytest.approx(8**0.175, rel=1e-12)


def test_a_step_moves_each_matrix_by_lr_times_kappa_times_sqrt_rank():
    params = _lora_pair()
    before = {k: p.detach().clone() for k, p in params.items()}
    _set_grads(params, 1.0)
    Dimuon(params, RANK).step(DimuonParams(learning_rate=0.1))
    kappa = rank_lr_correction(RANK, 0.175)
    for key, param in params.items():
        moved = float(torch.linalg.matrix_norm(param.detach() - before[key]))
        assert moved == pytest.approx(0.1 * kappa * math.sqrt(RANK), rel=1e-5), key


def test_doubling_the_loss_scale_leaves_the_update_unchanged():
    results = []
    for scale in (1.0, 2.0):
        params = _lora_pair()
        optimizer = Dimuon(params, RANK)
        for step in range(3):
            _set_grads(params, scale, seed=10 + step)
            optimizer.step(DimuonParams(learning_rate=0.05, beta1=0.8))
        results.append({k: p.detach().clone() for k, p in params.items()})
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], atol=PARAM_ATOL, rtol=0)


def test_zero_learning_rate_moves_the_momentum_but_not_the_weights():
    params = _lora_pair()
    before = {k: p.detach().clone() for k, p in params.items()}
    _set_grads(params, 1.0)
    optimizer = Dimuon(params, RANK)
    metrics = optimizer.step(DimuonParams(learning_rate=0.0))
    for key, param in params.items():
        assert torch.equal(param.detach(), before[key])
    state = optimizer.state_tensors()
    assert float(state["layer.lora_A.weight.momentum"].abs().max()) > 0
    assert int(state["layer.lora_A.weight.step"]) == 1
    assert metrics["learning_rate:mean"] == 0.0


def test_grad_norm_is_the_pre_clip_global_norm_and_clipping_keeps_the_direction():
    params = _lora_pair()
    _set_grads(params, 1.0)
    expected = math.sqrt(sum(float(p.grad.square().sum()) for p in params.values()))
    metrics = Dimuon(params, RANK).step(DimuonParams(learning_rate=0.1, grad_clip_norm=0.5))
    assert metrics["grad_norm:mean"] == pytest.approx(expected, rel=1e-6)


def test_state_round_trip_continues_like_an_uninterrupted_run():
    straight, resumed = _lora_pair(), _lora_pair()
    first = Dimuon(straight, RANK)
    _set_grads(straight, 1.0, seed=20)
    first.step(DimuonParams(learning_rate=0.1))
    # Resume: copy the weights and the state into a fresh optimizer.
    with torch.no_grad():
        for key in straight:
            resumed[key].copy_(straight[key])
    second = Dimuon(resumed, RANK)
    second.load_state_tensors(first.state_tensors())
    for params, optimizer in ((straight, first), (resumed, second)):
        _set_grads(params, 1.0, seed=21)
        optimizer.step(DimuonParams(learning_rate=0.1))
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


def test_adamw_state_does_not_load_into_dimuon():
    with pytest.raises(BadRequest, match="not Dimuon state"):
        Dimuon(_lora_pair(), RANK).load_state_tensors({"layer.lora_A.weight.exp_avg": torch.zeros(RANK, 12)})


def test_invalid_dimuon_params_change_nothing_and_keep_the_gradient():
    params = _lora_pair()
    _set_grads(params, 1.0)
    grads = {k: p.grad.clone() for k, p in params.items()}
    with pytest.raises(BadRequest, match=r"dimuon_params\.damping must be > 0"):
        Dimuon(params, RANK).step(DimuonParams(learning_rate=0.1, damping=0.0))
    for key, param in params.items():
        assert torch.equal(param.grad, grads[key])


# ---------------------------------------------------------------- the engine's family rules


@pytest.fixture(scope="module")
def trainer(tiny_llama: Path) -> TorchTrainer:
    return TorchTrainer(tiny_llama, torch.device("cpu"))


@pytest.fixture
def dimuon_adapter(trainer: TorchTrainer):
    trainer.add_adapter("d", LoraSpec(rank=RANK, seed=5), optimizer="dimuon")
    yield "d"
    trainer.drop_adapter("d")


def _sft_batch() -> ForwardBackwardBatch:
    tokens = np.arange(3, 20)
    datum = TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def test_adam_params_on_a_dimuon_model_fail_and_keep_the_gradient(trainer, dimuon_adapter):
    trainer.forward_backward(dimuon_adapter, _sft_batch())
    grads = trainer.adapter_gradients(dimuon_adapter)
    weights = trainer.adapter_tensors(dimuon_adapter)
    with pytest.raises(BadRequest, match=r"^optimizer mismatch: model d uses 'dimuon' \(version 1\) but this "
                       r"optim_step sent AdamParams; send DimuonParams$"):
        trainer.optim_step(dimuon_adapter, AdamParams(learning_rate=0.1))
    kept = trainer.adapter_gradients(dimuon_adapter)
    assert kept.keys() == grads.keys() and all(torch.equal(kept[k], grads[k]) for k in grads)
    assert all(torch.equal(trainer.adapter_tensors(dimuon_adapter)[k], weights[k]) for k in weights)
    # The corrected step then uses that gradient.
    metrics = trainer.optim_step(dimuon_adapter, DimuonParams(learning_rate=0.1)).metrics
    assert metrics["grad_norm:mean"] > 0


def test_dimuon_params_on_an_adamw_model_fail(trainer):
    trainer.add_adapter("w", LoraSpec(rank=RANK, seed=5))
    try:
        with pytest.raises(BadRequest, match=r"^optimizer mismatch: model w uses 'adamw' but this optim_step "
                           r"sent DimuonParams; send AdamParams$"):
            trainer.optim_step("w", DimuonParams(learning_rate=0.1))
    finally:
        trainer.drop_adapter("w")


def test_dimuon_state_checkpoint_resumes_like_an_uninterrupted_run(trainer, dimuon_adapter, tmp_path):
    for _ in range(2):
        trainer.forward_backward(dimuon_adapter, _sft_batch())
        trainer.optim_step(dimuon_adapter, DimuonParams(learning_rate=0.05))
    trainer.save_state(dimuon_adapter, tmp_path)
    trainer.load_state("resumed", tmp_path, LoraSpec(rank=RANK, seed=5), with_optimizer=True, optimizer="dimuon")
    try:
        for name in (dimuon_adapter, "resumed"):
            trainer.forward_backward(name, _sft_batch())
            trainer.optim_step(name, DimuonParams(learning_rate=0.05))
        straight, resumed = trainer.adapter_tensors(dimuon_adapter), trainer.adapter_tensors("resumed")
        for key in straight:
            torch.testing.assert_close(resumed[key], straight[key], atol=PARAM_ATOL, rtol=0)
        with pytest.raises(BadRequest, match="cannot override restored optimizer state"):
            trainer.load_state("as-adamw", tmp_path, LoraSpec(rank=RANK, seed=5), with_optimizer=True)
        assert not trainer.has_adapter("as-adamw")
    finally:
        trainer.drop_adapter("resumed")
