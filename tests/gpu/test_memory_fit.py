"""A datum whose training step would not fit in the device's memory is refused with a 400 that
names its tokens, the estimate and the limit, before any compute (`gpu/memory_fit.py`).

The limit is injected through `TrainerConfig.available_memory_bytes`, set to the estimate of a
datum of 100 tokens on the tiny Llama: 100 tokens fit exactly, 101 do not."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu.memory_fit import available_memory, step_bytes
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


def test_a_step_keeps_one_layer_and_every_layer_input_per_token_with_checkpointing() -> None:
    # 1,000 tokens × (8,000 B / 4 layers + 4 layers × 64 wide × 4 B) + a 1,024 B logits chunk
    assert step_bytes(1000, 8000.0, 4, 64, 4, 1024) == 1000 * (2000 + 1024) + 1024


def test_a_step_keeps_the_whole_graph_without_checkpointed_layers() -> None:
    assert step_bytes(1000, 8000.0, 0, 64, 4, 1024) == 1000 * 8000 + 1024


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
