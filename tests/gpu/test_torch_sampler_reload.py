"""TorchSampler: a version loads and samples after every earlier version was dropped.

peft keeps naming its last deleted adapter active; the sampler must not trip over it
(found by bench/gpu_check.py, which drops and reloads a version).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from openrld.batches import LoraSpec, SampleJob, SamplingSpec
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=1)


def test_a_version_samples_after_the_only_other_version_was_dropped(tiny_llama: Path) -> None:
    trainer = TorchTrainer(tiny_llama, CPU)
    trainer.add_adapter("x", SPEC)
    tensors = trainer.adapter_tensors("x")
    sampler = TorchSampler(tiny_llama, CPU)
    job = SampleJob(prompt=np.array([5, 6, 7]), num_samples=1, params=SamplingSpec(max_tokens=3, seed=1))
    sampler.load_version("a", tensors, SPEC)
    first = sampler.sample("a", job)
    sampler.drop_version("a")
    sampler.load_version("a", tensors, SPEC)
    again = sampler.sample("a", job)
    assert again.sequences[0].tokens.tolist() == first.sequences[0].tokens.tolist()
