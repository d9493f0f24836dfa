"""Weight sync to a sampler that holds bfloat16 weights while the trainer keeps float32 masters.

`FullTrainer(sampler_dtype=torch.bfloat16)`: each payload carries the master weights
rounded to bfloat16, and a delta only the elements whose rounded bits changed. On a
tiny random Llama; weights are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, TrainDatum
from openrld.gpu import delta
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.tiny_models import build_tiny_model

CPU = torch.device("cpu")
TOKENS = np.arange(30, 46, dtype=np.int64)
DATA = [TrainDatum(tokens=TOKENS[:-1], inputs={"target_tokens": TOKENS[1:]})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def step(trainer: FullTrainer, learning_rate: float) -> None:
    batch = ForwardBackwardBatch(data=DATA, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    trainer.forward_backward("job", batch)
    trainer.optim_step("job", AdamParams(learning_rate=learning_rate))


def rounded(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: t.to(torch.bfloat16) for key, t in weights.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(delta.bits(a[k]), delta.bits(b[k])) for k in a)


@pytest.mark.parametrize("sync", ["delta", "full"])
def test_a_bf16_sampler_holds_the_fp32_masters_rounded_bit_for_bit_after_every_sync(model_dir: Path, sync: str):
    trainer = FullTrainer(model_dir, CPU, torch.float32, weight_sync=sync, sampler_dtype=torch.bfloat16)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU, torch.bfloat16)
    for version in ("v1", "v2", "v3"):
        step(trainer, 1e-3)
        sampler.load_version(version, trainer.sampler_payload("job", version))  # checks the digest too
        assert same_bits(sampler.live_weights(), rounded(trainer.live_tensors("job")))
    assert next(iter(trainer.live_tensors("job").values())).dtype == torch.float32


def test_a_bf16_delta_sends_exactly_the_elements_whose_rounded_bits_changed(model_dir: Path):
    trainer = FullTrainer(model_dir, CPU, torch.float32, sampler_dtype=torch.bfloat16)
    trainer.add_adapter("job")
    before = delta.clone_weights(trainer.live_tensors("job"))
    step(trainer, 1e-5)  # AdamW moves every master element by about 1e-5: most stay in their bf16 step
    after = trainer.live_tensors("job")
    payload = trainer.sampler_payload("job", "v1")
    fp32_changed = sum(int((delta.bits(after[k]) != delta.bits(before[k])).sum()) for k in after)
    bf16_changed = sum(
        int((delta.bits(after[k].to(torch.bfloat16)) != delta.bits(before[k].to(torch.bfloat16))).sum())
        for k in after
    )
    assert payload.changed_elements == bf16_changed
    assert payload.full_bytes == 2 * payload.total_elements  # two bytes per bf16 element
    assert bf16_changed < fp32_changed / 3  # 25011 of 99584 on this model and batch
