"""CPU threads chosen per engine call by its size (gpu/call_threads.py) against every call on
every core, as the engines ran before.

One process, one engine thread (as a daemon's engine runs), the node's default ceiling
(`cpu_threads = 0`: the machine's cores), a LoRA trainer and a torch sampler on the model;
the two policies alternate call by call, so drift in this shared machine's speed hits both.
The work is `rl_throughput.py`'s: an SFT step of 8 x 128 tokens (forward_backward and
optim_step) and a sample of 8 x 32 new tokens from a 32-token prompt. Printed per figure:

    <model> <figure>  by size <ms>  every core <ms>  ratio = every core / by size

On SmolLM2 every one of these calls is large enough for every core, so its ratio is the
rule's own cost (the count set at each call); on the tiny Llama it is what one thread saves.

Run: `.venv/bin/python bench/call_threads.py` (`--models tiny-llama` skips SmolLM2,
`--rounds N` sets the calls per policy).
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its wait policy (OMP_WAIT_POLICY) must be set before torch loads

# isort: split
import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from _daemon import bench_models, match_daemon_threads, vocab_size

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import call_threads
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
ROWS, TOKENS = 8, 128  # the SFT step
SAMPLES, NEW_TOKENS, PROMPT = 8, 32, 32  # the sample
POLICIES = (("by size", call_threads.WORK_PER_THREAD), ("every core", 1))  # WORK_PER_THREAD of each


def workload(model_dir: Path) -> dict[str, Callable[[], object]]:
    """The SFT step and the sample, on a fresh trainer and sampler of `model_dir`."""
    trainer = TorchTrainer(model_dir, CPU)
    trainer.add_adapter("job", LoraSpec(rank=8), "adamw")
    sampler = TorchSampler(model_dir, CPU)
    rng = np.random.default_rng(0)
    vocab = vocab_size(model_dir)
    data = []
    for _ in range(ROWS):
        ids = rng.integers(1, vocab, TOKENS + 1)
        data.append(TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(TOKENS, np.float32)}))
    batch = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    job = SampleJob(
        prompt=rng.integers(1, vocab, PROMPT).astype(np.int32), num_samples=SAMPLES,
        params=SamplingSpec(max_tokens=NEW_TOKENS, seed=1, stop_at_eos=False),  # stop=[]: every sample runs 32
    )

    def sft() -> None:
        trainer.forward_backward("job", batch)
        trainer.optim_step("job", AdamParams(learning_rate=1e-4))

    return {f"SFT step {ROWS}x{TOKENS}": sft, f"sample {SAMPLES}x{NEW_TOKENS}": lambda: sampler.sample(None, job)}


def measure(name: str, model_dir: Path, rounds: int) -> None:
    for figure, call in workload(model_dir).items():
        call()  # warm-up: lazy allocations
        times: dict[str, list[float]] = {label: [] for label, _ in POLICIES}
        for _ in range(rounds):
            for label, work_per_thread in POLICIES:
                call_threads.WORK_PER_THREAD = work_per_thread
                start = time.perf_counter()
                call()
                times[label].append(time.perf_counter() - start)
        call_threads.WORK_PER_THREAD = POLICIES[0][1]
        ours, all_cores = (statistics.median(times[label]) for label, _ in POLICIES)
        print(f"{name:10s} {figure:16s} by size {ours * 1000:8.1f} ms  every core {all_cores * 1000:8.1f} ms  "
              f"ratio {all_cores / ours:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2"], choices=["tiny-llama", "smollm2"])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"ceiling {match_daemon_threads()} threads; {args.rounds} calls per policy, alternating", flush=True)
    with bench_models(args.models) as models:
        for name, model_dir in models:
            engine = threading.Thread(target=measure, args=(name, model_dir, args.rounds))  # as a daemon's engine thread
            engine.start()
            engine.join()


if __name__ == "__main__":
    main()
