"""The cost of offload's in-place, tensor-by-tensor move against one plain copy of the same bytes.

`offload.relocate` moves a model's tensors one by one (so that every holder keeps its
tensor object); the baseline copies the same number of bytes as one flat buffer. Both
copy host memory to host memory here, so the ratio measures what the per-tensor walk
adds, not a device link (bench/gpu_check.py times the CUDA path on a GPU).

The model is a random Llama of ~50M parameters (fp32, 8 layers of width 768) with a
LoRA adapter, so its tensors range from large matrices to small LoRA factors. Blocks
of the two alternate, and the median of each is reported, since the CPUs here are
shared and noisy.

    python bench/offload_copy.py
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too

# isort: split
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import build_wide_model

from openrld.batches import LoraSpec
from openrld.gpu import offload
from openrld.gpu.torch_trainer import TorchTrainer

ROUNDS = 7


def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="openrld-offload-bench-") as tmp:
        model_dir = build_wide_model(Path(tmp) / "wide", hidden=768, layers=8, intermediate=2048, head_dim=64)
        trainer = TorchTrainer(model_dir, torch.device("cpu"), dtype=torch.float32)
        trainer.add_adapter("a", LoraSpec(rank=16, seed=0))
        tensors = offload.unique_tensors(offload.module_tensors(trainer._model), torch.device("cpu"))
        total = sum(t.numel() * t.element_size() for t in tensors)
        flat = torch.empty(total, dtype=torch.uint8)
        walk, bulk = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            offload.relocate(tensors, lambda t: t.clone())
            walk.append(time.perf_counter() - start)
            start = time.perf_counter()
            flat.clone()
            bulk.append(time.perf_counter() - start)
        walk_s, bulk_s = statistics.median(walk), statistics.median(bulk)
        print(f"tensors: {len(tensors)}, bytes: {total / 1e6:.1f} MB")
        print(f"relocate, tensor by tensor: {walk_s * 1e3:.1f} ms ({total / walk_s / 1e9:.2f} GB/s)")
        print(f"one flat copy of the same bytes: {bulk_s * 1e3:.1f} ms ({total / bulk_s / 1e9:.2f} GB/s)")
        print(f"relocate throughput as a fraction of the flat copy: {bulk_s / walk_s:.2f}")


if __name__ == "__main__":
    main()
