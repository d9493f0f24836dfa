"""What auto-saves to a shared checkpoint root cost a LoRA SFT step, as a ratio to the same node without one.

Two `openrld serve` daemons with the default config serve SmolLM2-135M-Instruct (or the tiny
Llama with `--models tiny-llama`): one with `checkpoint_root` set to a fresh directory, so that
its LoRA job's state (adapter and AdamW state) is saved after every optim_step (issue 41: the
default for a LoRA job there), and the baseline without one. The real SDK drives each from a process of its own
(bench/_sdk_loop.py): LoRA rank 8, summed cross-entropy on a ROWSxTOKENS batch, lock-step (each
step's forward_backward and optim_step submitted together, both read before the next step), so
a step's time includes whatever of the write the next step waits for.

The machine may be shared, so the two sides take turns: each round runs STEPS steps on one,
then on the other, the order flipping each round, and the first round is a discarded warm-up.
The load average is printed before and after. Printed figures:

    cost ratio = median seconds per step with auto-saves / median without  (target <= 1.02)
    CPU ratio  = the daemon's CPU seconds (user + system, every thread) per step, with / without

with each round's ratios, the size of one auto-save, and the step of the newest one on the root
(it must equal the steps taken: every step saved). On a CPU node the save's work competes with
the step for the same cores, so the CPU ratio is what it costs there; it also moves far less than
the wall-clock ratio on a machine that other work shares.

With `--engine-thread`, it also measures in this process what an auto-save holds the engine thread
for, against the step it follows: openrld's LoRA trainer on the same batch (the daemon's thread
count), each round one step (forward_backward, optim_step), then `snapshot_state` (what the
engine thread does now), `save_state` (what it did before: serialise, write, fsync) and the
snapshot's write (off the engine thread now). Printed: each round's seconds, and the minimum and
median of each over the rounds as a share of the step's.

Run: `.venv/bin/python bench/autosave_cost.py` (`--models tiny-llama`, `--rounds N`, `--steps N`,
`--engine-thread`).
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

from _daemon import bench_models, child, cpu_seconds, daemon_process, match_daemon_threads, vocab_size
from _workload import LR, RANK, batch_tokens

from openrld.autosave import AUTOSAVE_DIR, latest_autosave

EVERY_STEP = {"openrl.autosave_steps": "1"}  # a LoRA job's default on a shared root, said outright


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
    parser.add_argument("--engine-thread", action="store_true", help="also time the engine thread's share in-process")
    parser.add_argument("--skip-daemons", action="store_true", help="only the --engine-thread figures")
    args = parser.parse_args()
    with bench_models(args.models) as models:
        for name, directory in models:
            if not args.skip_daemons:
                run(name, directory, args)
            if args.engine_thread:
                engine_thread(name, directory, args)


def engine_thread(name: str, directory: Path, args: argparse.Namespace) -> None:
    """What one auto-save holds the engine thread for, against one step, in this process."""
    import torch  # openrld's engine, as the daemon runs it: not a baseline

    from openrld.autosave import write_snapshot
    from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
    from openrld.gpu.torch_trainer import TorchTrainer

    threads = match_daemon_threads()
    trainer = TorchTrainer(directory, torch.device("cpu"))
    trainer.add_adapter("job", LoraSpec(rank=RANK, seed=0), "adamw")
    rows = batch_tokens(args.rows, args.tokens, vocab_size(directory))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in rows]
    batch = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    print(f"{name}: the engine thread's share of an auto-save, in-process ({threads} torch threads)")
    print(f"  before: {load()}", flush=True)
    seconds: dict[str, list[float]] = {"step": [], "snapshot_state": [], "save_state": [], "write (off-thread)": []}
    with tempfile.TemporaryDirectory(prefix="openrld-bench-states-") as tmp:
        for round_number in range(args.rounds + 1):
            timed = {}
            start = time.perf_counter()
            trainer.forward_backward("job", batch)
            trainer.optim_step("job", AdamParams(learning_rate=LR))
            timed["step"] = time.perf_counter() - start
            start = time.perf_counter()
            snapshot = trainer.snapshot_state("job", True)
            timed["snapshot_state"] = time.perf_counter() - start
            saved, written = Path(tmp) / f"saved-{round_number}", Path(tmp) / f"written-{round_number}"
            saved.mkdir(), written.mkdir()
            start = time.perf_counter()
            trainer.save_state("job", saved, True)
            timed["save_state"] = time.perf_counter() - start
            start = time.perf_counter()
            write_snapshot(snapshot, written)
            timed["write (off-thread)"] = time.perf_counter() - start
            label = "warm-up" if round_number == 0 else f"round {round_number}"
            print(f"  {label}: " + ", ".join(f"{key} {value:.3f} s" for key, value in timed.items()), flush=True)
            if round_number > 0:
                for key, value in timed.items():
                    seconds[key].append(value)
    print(f"  after: {load()}; state {snapshot.nbytes / 1e6:.2f} MB")
    step_min, step_median = min(seconds["step"]), statistics.median(seconds["step"])
    for key in ("snapshot_state", "save_state", "write (off-thread)"):
        low, middle = min(seconds[key]), statistics.median(seconds[key])
        print(
            f"  {key}: min {low:.3f} s = {low / step_min:.4f} of the fastest step; "
            f"median {middle:.3f} s = {middle / step_median:.4f} of the median step"
        )


def run(name: str, directory: Path, args: argparse.Namespace) -> None:
    print(f"{name}: LoRA rank {RANK}, {args.rows}x{args.tokens} tokens, {args.rounds} rounds of {args.steps} steps a side")
    print(f"  before: {load()}", flush=True)
    with contextlib.ExitStack() as stack:
        shared = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-root-")))
        saving_url, saving_pid = stack.enter_context(daemon_process({name: directory}, f'checkpoint_root = "{shared}"'))
        plain_url, plain_pid = stack.enter_context(daemon_process({name: directory}))
        vocab = vocab_size(directory)
        saving = stack.enter_context(child("_sdk_loop.py", saving_url, name, vocab, json.dumps(EVERY_STEP)))
        plain = stack.enter_context(child("_sdk_loop.py", plain_url, name, vocab))
        sides = {"autosave": (saving, saving_pid), "none": (plain, plain_pid)}
        times: dict[str, list[float]] = {"autosave": [], "none": []}
        cpu: dict[str, float] = {"autosave": 0.0, "none": 0.0}  # daemon CPU seconds over the timed rounds
        for round_number in range(args.rounds + 1):
            order = ["autosave", "none"] if round_number % 2 == 0 else ["none", "autosave"]
            medians, cpu_per_step = {}, {}
            for side in order:
                loop, pid = sides[side]
                cpu_before = cpu_seconds(pid)
                steps = loop.call("sft_steps", rows=args.rows, tokens=args.tokens, count=args.steps, pipelined=False)
                used = cpu_seconds(pid) - cpu_before
                medians[side], cpu_per_step[side] = statistics.median(steps), used / args.steps
                if round_number > 0:
                    times[side] += steps
                    cpu[side] += used
            label = "warm-up" if round_number == 0 else f"round {round_number}"
            print(
                f"  {label}: {medians['autosave']:.3f} s/step with, {medians['none']:.3f} without, "
                f"ratio {medians['autosave'] / medians['none']:.3f}; CPU {cpu_per_step['autosave']:.3f} s/step "
                f"with, {cpu_per_step['none']:.3f} without, ratio {cpu_per_step['autosave'] / cpu_per_step['none']:.3f}",
                flush=True,
            )
        report_autosaves(shared, (args.rounds + 1) * args.steps)
    with_saves, without = statistics.median(times["autosave"]), statistics.median(times["none"])
    print(f"  after: {load()}")
    print(f"  cost ratio = {with_saves:.3f} / {without:.3f} s per step = {with_saves / without:.3f} (target <= 1.02)")
    steps_timed = args.rounds * args.steps
    cpu_with, cpu_without = cpu["autosave"] / steps_timed, cpu["none"] / steps_timed
    print(f"  CPU ratio = {cpu_with:.3f} / {cpu_without:.3f} CPU s per step = {cpu_with / cpu_without:.3f}")


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
