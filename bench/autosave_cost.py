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

Each round's pair of medians is taken minutes apart at most, so its ratio sees about the same load
on both sides; the median of the rounds' ratios is printed beside the pooled one. The last line of
each model is its result, as `RESULT <model>: ...`.

With `--engine-thread`, it also measures in this process what one auto-save costs, against the
step it follows: openrld's LoRA trainer on the same batch (the daemon's thread count), each round
one step (forward_backward, optim_step), then `snapshot_state` (what the engine thread does),
`save_state` (what it did before: serialise, write, fsync) and the snapshot's commit
(`autosave.commit_snapshot` into a shared root of its own: write, fsync, rename, prune the one
before; off the engine thread in the daemon). Printed: each round's wall and CPU seconds, and
the medians over the rounds, with the CPU of snapshot and commit together as a share of the
step's CPU: the work an auto-save adds to a step on a CPU node, free of the noise of a shared machine.

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
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, cpu_seconds, daemon_process, match_daemon_threads, vocab_size
from _workload import LR, RANK, batch_tokens

from openrld.autosave import AUTOSAVE_DIR, AUTOSAVE_FORMAT, AutosaveManifest, latest_autosave, step_dir_name
from openrld.checkpoint_manifest import MANIFEST_FORMAT, CheckpointManifest
from openrld.ids import CheckpointKind

EVERY_STEP = {"openrl.autosave_steps": "1"}  # a LoRA job's default on a shared root, said outright
BENCH_JOB = "s-0123456789abcdef:train:0"  # the in-process job's model id (--engine-thread)


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
    """What one auto-save costs the engine thread and the node's CPU, against one step, in this process."""
    import torch  # openrld's engine, as the daemon runs it: not a baseline

    from openrld.autosave import commit_snapshot
    from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
    from openrld.gpu.torch_trainer import TorchTrainer
    from openrld.store.checkpoint_files import CheckpointFiles

    threads = match_daemon_threads()
    trainer = TorchTrainer(directory, torch.device("cpu"))
    trainer.add_adapter("job", LoraSpec(rank=RANK, seed=0), "adamw")
    rows = batch_tokens(args.rows, args.tokens, vocab_size(directory))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in rows]
    batch = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    print(f"{name}: one auto-save against one step, in-process ({threads} torch threads)")
    print(f"  before: {load()}", flush=True)
    wall: dict[str, list[float]] = {"step": [], "snapshot_state": [], "save_state": [], "commit (off-thread)": []}
    cpu: dict[str, list[float]] = {key: [] for key in wall}
    with tempfile.TemporaryDirectory(prefix="openrld-bench-states-") as tmp:
        for side in ("root", "node"):
            (Path(tmp) / side).mkdir()
        files = CheckpointFiles.open(Path(tmp) / "node", Path(tmp) / "root")  # a shared root, as the daemon's
        for round_number in range(args.rounds + 1):
            timed: dict[str, tuple[float, float]] = {}
            with timing(timed, "step"):
                trainer.forward_backward("job", batch)
                trainer.optim_step("job", AdamParams(learning_rate=LR))
            with timing(timed, "snapshot_state"):
                snapshot = trainer.snapshot_state("job", True)
            saved = Path(tmp) / f"saved-{round_number}"
            saved.mkdir()
            with timing(timed, "save_state"):
                trainer.save_state("job", saved, True)
            with timing(timed, "commit (off-thread)"):
                commit_snapshot(files, snapshot, bench_manifest(round_number + 1))
            label = "warm-up" if round_number == 0 else f"round {round_number}"
            print(f"  {label}: " + ", ".join(f"{key} {w:.3f} s ({c:.3f} CPU)" for key, (w, c) in timed.items()), flush=True)
            if round_number > 0:
                for key, (w, c) in timed.items():
                    wall[key].append(w)
                    cpu[key].append(c)
    print(f"  after: {load()}; state {snapshot.nbytes / 1e6:.2f} MB")
    median = {key: (statistics.median(wall[key]), statistics.median(cpu[key])) for key in wall}
    for key, (w, c) in median.items():
        print(f"  {key}: median {w:.3f} s, {c:.3f} CPU s = {c / median['step'][1]:.4f} of the step's CPU")
    added = median["snapshot_state"][1] + median["commit (off-thread)"][1]
    print(
        f"RESULT {name} in-process: an auto-save adds {added:.3f} CPU s to a step of {median['step'][1]:.3f} "
        f"(x{1 + added / median['step'][1]:.4f}); the engine thread waits {median['snapshot_state'][0]:.3f} s of "
        f"{median['step'][0]:.3f} (x{1 + median['snapshot_state'][0] / median['step'][0]:.4f})"
    )


@contextlib.contextmanager
def timing(timed: dict[str, tuple[float, float]], key: str) -> Iterator[None]:
    """Wall and CPU seconds (this process's, every thread) of the block, into timed[key]."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    timed[key] = (time.perf_counter() - wall, time.process_time() - cpu)


def bench_manifest(step: int) -> AutosaveManifest:
    """An auto-save's manifest for the in-process job: what a trainer writes beside its files."""
    now = datetime.now(UTC)
    run = CheckpointManifest(
        format=MANIFEST_FORMAT, run_id=BENCH_JOB, kind=CheckpointKind.WEIGHTS, name=step_dir_name(step), owner="bench",
        session_id="s-0000000000000000", base_model="bench", model_dir="", lora={"rank": RANK}, settings={},
        optimizer_config={}, run_user_metadata={}, run_created_at=now, user_metadata={}, size_bytes=None,
        created_at=now, expires_at=None, public=False,
    )
    return AutosaveManifest(format=AUTOSAVE_FORMAT, model_id=BENCH_JOB, step=step, seq_id=step, run=run, created_at=now)


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
        round_ratios: dict[str, list[float]] = {"wall": [], "CPU": []}  # each timed round's, with / without
        load_before = load()
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
            if round_number > 0:
                round_ratios["wall"].append(medians["autosave"] / medians["none"])
                round_ratios["CPU"].append(cpu_per_step["autosave"] / cpu_per_step["none"])
            label = "warm-up" if round_number == 0 else f"round {round_number}"
            print(
                f"  {label}: {medians['autosave']:.3f} s/step with, {medians['none']:.3f} without, "
                f"ratio {medians['autosave'] / medians['none']:.3f}; CPU {cpu_per_step['autosave']:.3f} s/step "
                f"with, {cpu_per_step['none']:.3f} without, ratio {cpu_per_step['autosave'] / cpu_per_step['none']:.3f}",
                flush=True,
            )
        report_autosaves(shared, (args.rounds + 1) * args.steps)
    with_saves, without = statistics.median(times["autosave"]), statistics.median(times["none"])
    load_after = load()
    print(f"  after: {load_after}")
    wall_ratio = with_saves / without
    print(f"  cost ratio = {with_saves:.3f} / {without:.3f} s per step = {wall_ratio:.3f} (target <= 1.02)")
    steps_timed = args.rounds * args.steps
    cpu_with, cpu_without = cpu["autosave"] / steps_timed, cpu["none"] / steps_timed
    cpu_ratio = cpu_with / cpu_without
    print(f"  CPU ratio = {cpu_with:.3f} / {cpu_without:.3f} CPU s per step = {cpu_ratio:.3f}")
    for kind, ratios in round_ratios.items():
        print(f"  {kind} ratio, round by round: median {statistics.median(ratios):.3f}, from {min(ratios):.3f} to {max(ratios):.3f}")
    print(
        f"RESULT {name}: auto-save after every step costs x{wall_ratio:.3f} wall (target <= 1.02), x{cpu_ratio:.3f} CPU "
        f"per step ({args.rounds} rounds of {args.steps} steps a side; before: {load_before}; after: {load_after})",
        flush=True,
    )


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
