"""Trainer throughput and peak memory through the API, as ratios to the bare loop a researcher writes.

Batch shapes 8x128, 32x256 and 4x1024 tokens on the tiny Llama, 8x128 on SmolLM2-135M-Instruct.
For each, the same SFT step (LoRA rank 8 on the same modules, alpha 32; summed cross-entropy in
fp32; AdamW with the SDK's betas and eps) runs these ways:

- baseline ("bare"): bench/_bare_loop.py, the loop a researcher writes with transformers and
        peft, in a process of its own that never imports openrld, with torch's defaults (its own
        thread count and wait policy, the checkpoint's dtype);
- API pipelined: `openrld serve` with its default config, and the real SDK in a process of its
        own (bench/_sdk_loop.py), each step's forward_backward and optim_step submitted together
        and the next step submitted before the previous step's results are read, as
        tinker-cookbook's pipelined supervised loop does: the trainer's throughput, with the
        client keeping it fed;
- API lock-step: the same, but each step's results are read before the next step is
        submitted, so every step also pays the client's and the HTTP round trip's latency;
- API pipelined, trainer process: as API pipelined, against a second daemon configured with
        `[workers] launcher = "process"`, whose trainer and sampler run in worker processes of
        their own (openrld/worker/) instead of threads of the daemon's;
- engine: the daemon's trainer engine (`TorchTrainer`, the same forward_backward and
        optim_step calls the trainer actor makes) in this process with the daemon's thread
        count, no server: what the daemon's compute costs before any HTTP, SDK or event loop
        is around it.

Rounds alternate (the API columns, then the baseline, then the engine), each STEPS steps a side;
each round's throughput ratio is printed, then the medians per side. Printed figures:

    throughput ratio = bare seconds per step / API pipelined seconds per step  (target >= 0.9 per shape)
    lock-step ratio  = bare seconds per step / API lock-step seconds per step  (no target: latency-bound)
    process ratio    = bare seconds per step / API pipelined seconds per step, trainer process
    engine ratio     = bare seconds per step / engine seconds per step         (no target: it splits the gap)
    memory ratio     = daemon peak RSS / bare-loop process peak RSS            (target <= 1.2)
                       and, for the trainer-process daemon, the sum of its own peak and its
                       trainer process's (an upper bound: the peaks need not coincide, and
                       pages of torch's libraries that both map count twice)

Each process's peak counts only its own work: the baseline's process runs the bare loop alone.

Run: `.venv/bin/python bench/train_throughput.py` (`--models tiny-llama`, `--shapes 8x128`,
`--rounds N`, `--steps N` for less of it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, daemon, match_daemon_threads, peak_rss_bytes, vocab_size
from _workload import ADAM_BETAS, ADAM_EPS, LR, RANK, batch_tokens

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.torch_trainer import TorchTrainer

SHAPES = {"tiny-llama": ((8, 128), (32, 256), (4, 1024)), "smollm2": ((8, 128),)}  # (sequences, tokens each)
WARMUP, STEPS = 1, 4
# Alternating rounds per shape. The small shape's steps are short, so more of its rounds cost
# little, and its figure, the most sensitive to this shared machine's drift, needs them most.
ROUNDS = {("tiny-llama", 8, 128): 8, ("tiny-llama", 32, 256): 2, ("tiny-llama", 4, 1024): 2, ("smollm2", 8, 128): 3}
COLUMNS = ("pipelined", "process", "lock-step", "bare", "engine")


class EngineLoop:
    """The daemon's trainer engine in this process: the calls the trainer actor makes, without the server."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = TorchTrainer(model_dir, torch.device("cpu"))
        self.engine.add_adapter("bench", LoraSpec(rank=RANK, seed=0))
        self.vocab = vocab_size(model_dir)

    def steps(self, batch: int, seq_len: int, count: int) -> list[float]:
        rows = batch_tokens(batch, seq_len, self.vocab)
        data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in rows]
        request = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
        adam = AdamParams(learning_rate=LR, beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], eps=ADAM_EPS)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.engine.forward_backward_many("bench", [request])
            self.engine.optim_step("bench", adam)
            times.append(time.perf_counter() - start)
        return times


def _is_trainer(pid: int) -> bool:
    return b"OPENRLD_WORKER_ROLE=trainer" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def children(parent: int, command: bytes) -> list[int]:
    """The pids of `parent`'s child processes whose command line holds `command`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and command in cmdline:
            found.append(int(entry.name))
    return found


def daemon_pid(config_dir: Path) -> int:
    """The `openrld serve` child of this process whose config sits in `config_dir`."""
    pids = children(os.getpid(), str(config_dir / "openrld.toml").encode())
    if len(pids) != 1:
        raise RuntimeError(f"expected one daemon process, found {pids}")
    return pids[0]


def measure(name: str, model_dir: Path, shapes: tuple[tuple[int, int], ...], rounds: int | None, steps: int) -> None:
    vocab = vocab_size(model_dir)
    with contextlib.ExitStack() as stack:
        roots = [Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-"))) for _ in range(2)]
        url = stack.enter_context(daemon({name: model_dir}, root=roots[0]))
        process_url = stack.enter_context(daemon({name: model_dir}, '[workers]\nlauncher = "process"', root=roots[1]))
        api = stack.enter_context(child("_sdk_loop.py", url, name, vocab))
        process_api = stack.enter_context(child("_sdk_loop.py", process_url, name, vocab))
        bare = stack.enter_context(child("_bare_loop.py", model_dir))
        engine = EngineLoop(model_dir)
        sides = {
            "pipelined": lambda shape, n: api.call("sft_steps", rows=shape[0], tokens=shape[1], count=n, pipelined=True),
            "process": lambda shape, n: process_api.call(
                "sft_steps", rows=shape[0], tokens=shape[1], count=n, pipelined=True),
            "lock-step": lambda shape, n: api.call("sft_steps", rows=shape[0], tokens=shape[1], count=n, pipelined=False),
            "bare": lambda shape, n: bare.call("sft_steps", rows=shape[0], tokens=shape[1], count=n),
            "engine": lambda shape, n: engine.steps(*shape, n),
        }
        medians = []
        for shape in shapes:
            times: dict[str, list[float]] = {column: [] for column in COLUMNS}
            for column in COLUMNS:
                sides[column](shape, WARMUP)
            for index in range(rounds or ROUNDS.get((name, *shape), 2)):
                for column in COLUMNS:
                    times[column] += sides[column](shape, steps)
                b, a = (statistics.median(times[column][-steps:]) for column in ("bare", "pipelined"))
                print(f"{name:10s} {shape[0]:>3}x{shape[1]:<5} round {index + 1}: bare {b * 1e3:8.1f} ms  "
                      f"API pipelined {a * 1e3:8.1f} ms  throughput ratio {b / a:.3f}", flush=True)
            medians.append((shape, {column: statistics.median(values) for column, values in times.items()}))
        daemon_peak = peak_rss_bytes(daemon_pid(roots[0]))
        process_daemon = daemon_pid(roots[1])
        (trainer_process,) = [pid for pid in children(process_daemon, b"openrld.worker") if _is_trainer(pid)]
        process_peaks = peak_rss_bytes(process_daemon), peak_rss_bytes(trainer_process)
        bare_peak = bare.peak_rss_bytes()
    for (batch, seq_len), median in medians:
        bare_s, pipelined_s, lock_step_s = median["bare"], median["pipelined"], median["lock-step"]
        engine_s, process_s = median["engine"], median["process"]
        print(
            f"{name:10s} {batch:>3}x{seq_len:<5} medians: bare {bare_s * 1e3:8.1f} ms  API pipelined "
            f"{pipelined_s * 1e3:8.1f} ms  throughput ratio (bare/API, target >= 0.9): {bare_s / pipelined_s:.3f}   "
            f"trainer process {process_s * 1e3:8.1f} ms, ratio {bare_s / process_s:.3f}   "
            f"lock-step {lock_step_s * 1e3:8.1f} ms, ratio {bare_s / lock_step_s:.3f}   "
            f"engine {engine_s * 1e3:8.1f} ms, ratio {bare_s / engine_s:.3f}", flush=True,
        )
    print(
        f"{name:10s} peak RSS: daemon {daemon_peak / 2**20:.0f} MiB, bare loop {bare_peak / 2**20:.0f} MiB, "
        f"memory ratio (daemon/bare, target <= 1.2): {daemon_peak / bare_peak:.3f}", flush=True,
    )
    print(
        f"{name:10s} peak RSS with process workers: daemon {process_peaks[0] / 2**20:.0f} MiB + trainer process "
        f"{process_peaks[1] / 2**20:.0f} MiB, memory ratio (sum/bare): {sum(process_peaks) / bare_peak:.3f}", flush=True,
    )


def parse_shape(text: str) -> tuple[int, int]:
    rows, tokens = text.split("x")
    return int(rows), int(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shapes", nargs="+", type=parse_shape, help="e.g. 8x128 32x256 (default: each model's own)")
    parser.add_argument("--rounds", type=int, help="rounds of each shape (default: ROUNDS)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps a side per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    threads = match_daemon_threads()  # the engine column's, as the daemon's; the baseline keeps torch's own
    print(f"LoRA rank {RANK}, {args.steps} steps a side per round; engine column: {threads} torch threads", flush=True)
    with bench_models(args.models) as models:
        for name, model_dir in models:
            measure(name, model_dir, tuple(args.shapes or SHAPES[name]), args.rounds, args.steps)


if __name__ == "__main__":
    main()
