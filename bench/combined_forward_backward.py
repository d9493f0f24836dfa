"""Cross-request batching in the trainer: one job's queued forward_backward requests run as
one engine pass (`TorchTrainer.forward_backward_many`) versus one pass per request.

Same adapter, same requests, same engine, in the same run; the passes alternate so drift
in this shared machine's speed hits both. Printed figure per case:

    speedup = seconds for the requests one by one / seconds for them in one pass

The cases are what the trainer actor sees when a job pipelines several small calls before
its optim_step (cookbook streaming minibatches), or when the SDK chunks one large call.

Run: `.venv/bin/python bench/combined_forward_backward.py`.
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too

# isort: split
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_trainer import TorchTrainer

CASES = ((16, 1, 128), (8, 4, 128), (4, 16, 256))  # (requests, datums per request, tokens per datum)
ROUNDS = 5


def requests(count: int, datums: int, tokens: int, rng: np.random.Generator) -> list[ForwardBackwardBatch]:
    out = []
    for _ in range(count):
        data = []
        for _ in range(datums):
            row = rng.integers(3, 380, size=tokens + 1)
            data.append(TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}))
        out.append(ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False))
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="openrld-bench-") as tmp:
        engine = TorchTrainer(build_tiny_model(Path(tmp) / "tiny-llama", "llama", seed=0), torch.device("cpu"))
    engine.add_adapter("job", LoraSpec(rank=8, seed=0))
    rng = np.random.default_rng(0)
    print(f"tiny Llama, LoRA rank 8, median of {ROUNDS} alternating rounds")
    for count, datums, tokens in CASES:
        batches = requests(count, datums, tokens, rng)
        one_by_one, combined = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for batch in batches:
                engine.forward_backward("job", batch)
            one_by_one.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.forward_backward_many("job", batches)
            combined.append(time.perf_counter() - start)
        separate_s, combined_s = statistics.median(one_by_one), statistics.median(combined)
        print(
            f"{count:>2} requests x {datums:>2} datums x {tokens} tokens: one by one {separate_s * 1e3:7.1f} ms, "
            f"one pass {combined_s * 1e3:7.1f} ms, speedup {separate_s / combined_s:.2f}"
        )


if __name__ == "__main__":
    main()
