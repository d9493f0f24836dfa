"""What auto-saves to a shared checkpoint root cost a LoRA SFT step, as a ratio to the same node without one.

Two `openrld serve` daemons with the default config serve SmolLM2-135M-Instruct (or the tiny
Llama with `--models tiny-llama`): one with `checkpoint_root` set to a fresh directory, so that
its LoRA job's state (adapter and AdamW state) is written after every optim_step (issue 41), and
the baseline without one. The real SDK drives each from a process of its own
(bench/_sdk_loop.py): LoRA rank 8, summed cross-entropy on a ROWSxTOKENS batch, lock-step (each
step's forward_backward and optim_step submitted together, both read before the next step), so
a step's time includes whatever of the write the next step waits for.

The machine may be shared, so the two sides take turns: each round runs STEPS steps on one,
then on the other, the order flipping each round, and the first round is a discarded warm-up.
The load average is printed before and after. Printed figures:

    cost ratio = median seconds per step with auto-saves / median without  (target <= 1.02)

with each round's ratio, the size of one auto-save, and the step of the newest one on the root
(it must equal the steps taken: every step saved).

Run: `.venv/bin/python bench/autosave_cost.py` (`--models tiny-llama`, `--rounds N`, `--steps N`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, daemon, vocab_size
from _workload import RANK

from openrld.autosave import AUTOSAVE_DIR, latest_autosave

EVERY_STEP = {"openrl.autosave_steps": "1"}  # the job opts in: auto-saves are off unless asked for


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "tiny-llama"])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warm-up round")
    parser.add_argument("--steps", type=int, default=4, help="steps a side per round")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with bench_models(args.models) as models:
        for name, directory in models:
            run(name, directory, args)


def run(name: str, directory: Path, args: argparse.Namespace) -> None:
    print(f"{name}: LoRA rank {RANK}, {args.rows}x{args.tokens} tokens, {args.rounds} rounds of {args.steps} steps a side")
    print(f"  before: {load()}", flush=True)
    with contextlib.ExitStack() as stack:
        shared = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-root-")))
        saving_url = stack.enter_context(daemon({name: directory}, f'checkpoint_root = "{shared}"'))
        plain_url = stack.enter_context(daemon({name: directory}))
        vocab = vocab_size(directory)
        saving = stack.enter_context(child("_sdk_loop.py", saving_url, name, vocab, json.dumps(EVERY_STEP)))
        plain = stack.enter_context(child("_sdk_loop.py", plain_url, name, vocab))
        sides = {"autosave": saving, "none": plain}
        times: dict[str, list[float]] = {"autosave": [], "none": []}
        for round_number in range(args.rounds + 1):
            order = ["autosave", "none"] if round_number % 2 == 0 else ["none", "autosave"]
            medians = {}
            for side in order:
                steps = sides[side].call("sft_steps", rows=args.rows, tokens=args.tokens, count=args.steps, pipelined=False)
                medians[side] = statistics.median(steps)
                if round_number > 0:
                    times[side] += steps
            label = "warm-up" if round_number == 0 else f"round {round_number}"
            print(
                f"  {label}: {medians['autosave']:.3f} s/step with, {medians['none']:.3f} without, "
                f"ratio {medians['autosave'] / medians['none']:.3f}",
                flush=True,
            )
        report_autosaves(shared, (args.rounds + 1) * args.steps)
    with_saves, without = statistics.median(times["autosave"]), statistics.median(times["none"])
    print(f"  after: {load()}")
    print(f"  cost ratio = {with_saves:.3f} / {without:.3f} s per step = {with_saves / without:.3f} (target <= 1.02)")


def report_autosaves(shared: Path, steps_taken: int) -> None:
    jobs = os.listdir(shared / AUTOSAVE_DIR)
    assert len(jobs) == 1, jobs
    deadline = time.monotonic() + 60  # the last step's commit runs after its step answered
    while (latest := latest_autosave(shared, jobs[0])) is None or latest.manifest.step < steps_taken:
        assert time.monotonic() < deadline, f"no complete auto-save of step {steps_taken} on the root"
        time.sleep(0.1)
    size = sum(latest.manifest.files.values())
    files = len(latest.manifest.files)
    print(f"  newest auto-save: step {latest.manifest.step} of {steps_taken} taken, {size / 1e6:.2f} MB ({files} files)")


if __name__ == "__main__":
    main()
