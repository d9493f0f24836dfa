"""A datum whose training step would not fit in the device's memory is refused with a 400 that
names its tokens, the estimate and the limit, before any compute (`gpu/memory_fit.py`).

The limit is injected through `TrainerConfig.available_memory_bytes`, set to the estimate of a
datum of 100 tokens on the tiny Llama: 100 tokens fit exactly, 101 do not. The estimate itself
is checked against `PeakMeter`'s measure of the real step on tiny models of the families whose
layers differ (sliding windows, linear attention, experts), plain and checkpointed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu.memory_fit import CPU_MARGIN, PROBE_CHUNK, Line, PeakMeter, StepFit, allocator_margin, available_memory
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=3)


def one_datum(length: int, forward_only: bool = False) -> ForwardBackwardBatch:
    tokens = np.arange(length + 1, dtype=np.int64) % 300 + 3
    datum = TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=forward_only)


@pytest.fixture
def estimate_of_100(tiny_llama: Path) -> int:
    probe = TorchTrainer(tiny_llama, CPU)
    probe.add_adapter("a", SPEC)
    probe.forward_backward("a", one_datum(8))  # measures the bytes a token keeps
    return probe._passes.scorer.step_bytes(100)


def limited_trainer(tiny_llama: Path, limit: int) -> TorchTrainer:
    trainer = TorchTrainer(tiny_llama, CPU, config=TrainerConfig(available_memory_bytes=limit))
    trainer.add_adapter("a", SPEC)
    return trainer


FIT = StepFit(
    plain=Line(fixed=1000.0, per_token=10.0),
    checkpointed=Line(fixed=500.0, per_token=2.0),
    logits_per_position=4.0,
    window_block=100,
)


def test_a_plain_step_is_its_line_plus_its_logits_chunk_and_window_block_times_the_margin() -> None:
    # 1,000 + 10 × 100 tokens, + 4 × (50 - 8) positions of logits beyond the probes' chunk, + 100
    assert FIT.step_bytes(100, False, 50, 1.5) == int(1.5 * (1000 + 1000 + 4 * (50 - PROBE_CHUNK) + 100))


def test_a_checkpointed_step_takes_the_checkpointed_line() -> None:
    assert FIT.step_bytes(100, True, 50, 1.5) == int(1.5 * (500 + 200 + 4 * (50 - PROBE_CHUNK) + 100))


def test_a_step_shorter_than_its_chunk_holds_logits_for_its_own_positions() -> None:
    assert FIT.step_bytes(20, False, 50, 1.5) == int(1.5 * (1000 + 200 + 4 * (20 - PROBE_CHUNK) + 100))


def test_a_model_that_cannot_checkpoint_takes_the_plain_line() -> None:
    fit = StepFit(plain=FIT.plain, checkpointed=None, logits_per_position=4.0, window_block=100)
    assert fit.step_bytes(100, True, 50, 1.5) == FIT.step_bytes(100, False, 50, 1.5)


def test_a_cpu_checkpointed_step_is_given_the_heap_glibc_keeps_behind_it() -> None:
    assert (allocator_margin(CPU, False), allocator_margin(CPU, True)) == (2.0, 8.0)


def test_the_meter_counts_the_tensors_alive_at_once_not_views_or_what_came_before() -> None:
    before = torch.ones(1 << 20)
    with PeakMeter(CPU) as meter:
        first = torch.ones(1 << 18)  # 1 MiB of float32
        second = torch.ones(1 << 19)  # 2 MiB
        _views = (first.view(2, -1), second[1:], before.t(), first.add_(1))
        del first, second, _views
        torch.ones(1 << 18)
    assert meter.peak == 3 * (1 << 20)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma4", "qwen3_5", "qwen3_moe"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_the_tensor_estimate_is_within_a_tenth_below_and_twice_above_the_measured_step(
    tmp_path: Path, family: str, checkpointed: bool
) -> None:
    # 300 tokens: past the probes' 96, the tiny windows of 8 and several log-softmax chunks.
    config = TrainerConfig(activation_budget_bytes=1 if checkpointed else 1 << 40, logprob_chunk_positions=64)
    trainer = TorchTrainer(build_tiny_model(tmp_path / family, family, seed=2), CPU, config=config)
    trainer.add_adapter("a", SPEC)
    tensors = trainer._passes.scorer.step_bytes(300) / CPU_MARGIN[checkpointed]
    with PeakMeter(CPU) as meter:
        trainer.forward_backward("a", one_datum(300))
    assert meter.peak / 1.1 <= tensors <= 2 * meter.peak


def test_measuring_the_estimate_leaves_the_accumulated_gradients_as_they_were(tiny_llama: Path) -> None:
    trainer = TorchTrainer(tiny_llama, CPU)
    trainer.add_adapter("a", SPEC)
    trainer.forward_backward("a", one_datum(50, forward_only=False))
    before = {name: grad.clone() for name, grad in trainer.adapter_gradients("a").items()}
    trainer._passes.scorer._step_fit = None
    trainer._passes.scorer.step_bytes(100)  # the probes run again, with backward
    after = trainer.adapter_gradients("a")
    assert all(torch.equal(after[name], grad) for name, grad in before.items())


def test_a_datum_over_the_limit_is_refused_naming_its_tokens_the_estimate_and_the_limit(
    tiny_llama: Path, estimate_of_100: int
) -> None:
    trainer = limited_trainer(tiny_llama, estimate_of_100)
    with pytest.raises(BadRequest) as refused:
        trainer.forward_backward("a", one_datum(101))
    estimate = trainer._passes.scorer.step_bytes(101)
    assert str(refused.value) == (
        f"datum 0: model_input has 101 tokens, whose training step needs about {estimate / 1024**3:.2f} GiB of "
        f"memory; the device can give {estimate_of_100 / 1024**3:.2f} GiB "
        f"({estimate} > {estimate_of_100} bytes); send a shorter datum"
    )
    assert refused.value.key == "model_input"


def test_a_refused_datum_adds_no_gradient(tiny_llama: Path, estimate_of_100: int) -> None:
    trainer = limited_trainer(tiny_llama, estimate_of_100)
    trainer.forward_backward("a", one_datum(50))
    before = {name: grad.clone() for name, grad in trainer.adapter_gradients("a").items()}
    with pytest.raises(BadRequest):
        trainer.forward_backward("a", one_datum(101))
    after = trainer.adapter_gradients("a")
    assert all(torch.equal(after[name], grad) for name, grad in before.items())


def test_a_datum_at_the_limit_runs(tiny_llama: Path, estimate_of_100: int) -> None:
    trainer = limited_trainer(tiny_llama, estimate_of_100)
    assert trainer.forward_backward("a", one_datum(100)).logprobs[0].shape == (100,)


def test_a_forward_only_datum_over_the_limit_runs(tiny_llama: Path, estimate_of_100: int) -> None:
    # No graph is kept without backward: a forward holds about one layer's activations at a time.
    trainer = limited_trainer(tiny_llama, estimate_of_100)
    assert trainer.forward_backward("a", one_datum(101, forward_only=True)).logprobs[0].shape == (101,)


def test_the_cpu_can_give_some_but_not_more_than_all_of_its_memory() -> None:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_memory(CPU) <= total
