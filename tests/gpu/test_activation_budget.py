"""Activation checkpointing chosen by the work's size: a micro-batch whose kept activations
would pass `activation_budget_bytes` recomputes its layers in backward; one under it does not.
The bytes a token keeps are measured on the model (the autograd graph's saved tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.scoring import default_activation_budget, default_micro_batch_budget
from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=3)


def one_datum(length: int) -> ForwardBackwardBatch:
    tokens = np.arange(length, dtype=np.int64) % 300 + 3
    datum = TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def layer_runs(trainer: TorchTrainer, batch: ForwardBackwardBatch) -> int:
    """How often the first decoder layer ran in one forward_backward: twice when checkpointed."""
    runs: list[int] = []
    layer = trainer._model.get_decoder().layers[0]
    handle = layer.input_layernorm.register_forward_pre_hook(lambda *_: runs.append(1))
    try:
        trainer.forward_backward("a", batch)
    finally:
        handle.remove()
    return len(runs)


def test_the_bytes_a_token_keeps_are_measured_and_grow_with_the_model(tiny_llama: Path, tmp_path: Path) -> None:
    trainer = TorchTrainer(tiny_llama, CPU)
    trainer.add_adapter("a", SPEC)
    per_token = trainer._passes.scorer._measure_activation_bytes_per_token()
    # The tiny Llama keeps a few KB a token: its 2 layers of width 64 and 128 in fp32.
    assert 1_000 < per_token < 20_000


def trainer_with_budget_of(tiny_llama: Path, tokens: int, micro_batch_tokens: int = 0) -> TorchTrainer:
    """A trainer whose activation budget is `tokens` tokens' activations (and its micro-batch budget
    `micro_batch_tokens`' when not 0), measured, and past its first step."""
    probe = TorchTrainer(tiny_llama, CPU)
    probe.add_adapter("a", SPEC)
    per_token = probe._passes.scorer._measure_activation_bytes_per_token()
    config = TrainerConfig(activation_budget_bytes=int(tokens * per_token),
                           micro_batch_budget_bytes=int(micro_batch_tokens * per_token))
    trainer = TorchTrainer(tiny_llama, CPU, config=config)
    trainer.add_adapter("a", SPEC)
    trainer.forward_backward("a", one_datum(8))  # the first step with grad measures (two probe forwards)
    return trainer


def test_a_micro_batch_over_the_budget_is_checkpointed_and_one_under_it_is_not(tiny_llama: Path) -> None:
    trainer = trainer_with_budget_of(tiny_llama, 100)  # 64 tokens run plain, 200 are checkpointed
    assert (layer_runs(trainer, one_datum(65)), layer_runs(trainer, one_datum(201))) == (1, 2)


def test_datums_over_the_budget_together_split_into_micro_batches_that_run_plain(tiny_llama: Path) -> None:
    trainer = trainer_with_budget_of(tiny_llama, 100)  # four datums of 60 tokens pass it together, fit it alone
    data = []
    for first in range(4):  # no two share a prefix (a shared group's check would run a forward of its own)
        tokens = (np.arange(61, dtype=np.int64) + 50 * first) % 300 + 3
        data.append(TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]}))
    four = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    assert layer_runs(trainer, four) == 4  # four micro-batches, none recomputed


def test_datums_split_at_the_micro_batch_budget_and_a_longer_one_alone_runs_plain(tiny_llama: Path) -> None:
    trainer = trainer_with_budget_of(tiny_llama, 1000, micro_batch_tokens=100)
    data = []
    for first in range(4):
        tokens = (np.arange(61, dtype=np.int64) + 50 * first) % 300 + 3
        data.append(TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]}))
    four = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    assert (layer_runs(trainer, four), layer_runs(trainer, one_datum(201))) == (4, 1)


def test_checkpointing_off_never_checkpoints(tiny_llama: Path) -> None:
    trainer = TorchTrainer(tiny_llama, CPU, config=TrainerConfig(activation_checkpointing=False, activation_budget_bytes=1))
    trainer.add_adapter("a", SPEC)
    trainer.forward_backward("a", one_datum(8))  # the first step with grad measures (two probe forwards)
    assert layer_runs(trainer, one_datum(1000)) == 1


def test_forward_only_never_checkpoints(tiny_llama: Path) -> None:
    trainer = TorchTrainer(tiny_llama, CPU, config=TrainerConfig(activation_budget_bytes=1))
    trainer.add_adapter("a", SPEC)
    runs: list[int] = []
    trainer._model.get_decoder().layers[0].input_layernorm.register_forward_pre_hook(lambda *_: runs.append(1))
    batch = one_datum(100)
    trainer.forward_backward("a", ForwardBackwardBatch(batch.data, "cross_entropy", {}, forward_only=True))
    assert len(runs) == 1


def test_the_cpu_default_budget_is_2_gib() -> None:
    assert default_activation_budget(CPU) == 2 * 1024**3


def test_the_cpu_default_micro_batch_budget_is_512_mib_or_the_activation_budget_under_it() -> None:
    assert (default_micro_batch_budget(CPU, 2 * 1024**3), default_micro_batch_budget(CPU, 1000)) == (512 * 1024**2, 1000)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="activation and micro-batch budgets must be >= 0"):
        TrainerConfig(activation_budget_bytes=-1)
    with pytest.raises(ValueError, match="activation and micro-batch budgets must be >= 0"):
        TrainerConfig(micro_batch_budget_bytes=-1)


def test_the_node_settings_budget_reaches_a_built_trainer(tiny_llama: Path) -> None:
    from openrld.worker import builtin
    from openrld.worker.protocol import Start

    options = {"max_batch_tokens": 512, "activation_budget_bytes": 12345}
    for kind in ("lora_trainer", "full_trainer"):
        trainer = builtin.build(Start(kind, str(tiny_llama), "cpu", options=options))
        assert (trainer._passes.scorer._activation_budget, trainer._passes.scorer.config.max_batch_tokens) == (12345, 512)


def test_a_node_setting_of_0_is_the_devices_default(tiny_llama: Path) -> None:
    from openrld.worker import builtin
    from openrld.worker.protocol import Start

    trainer = builtin.build(Start("lora_trainer", str(tiny_llama), "cpu", options={"activation_budget_bytes": 0}))
    assert trainer._passes.scorer._activation_budget == 2 * 1024**3
