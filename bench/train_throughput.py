"""Trainer throughput and peak memory through the API, as ratios to a bare PyTorch loop.

Three batch shapes (8x128, 32x256, 4x1024 tokens). For each, the same step runs two ways
on the tiny Llama, with the same LoRA (rank 8, same target modules and alpha), summed
cross-entropy in fp32 and AdamW (torch.optim.AdamW, foreach=False, on the bare side):

- bare: a PyTorch loop in this process, no server;
- API pipelined: the real SDK against a real daemon on loopback, each step's
        forward_backward and optim_step submitted together and the next step submitted
        before the previous step's results are read, as tinker-cookbook's pipelined
        supervised loop does: the trainer's throughput, with the client keeping it fed;
- API lock-step: the same, but each step's results are read before the next step is
        submitted, so every step also pays the client's and the HTTP round trip's latency;
- API pipelined, trainer process: the same as API pipelined, against a second daemon
        configured with `[workers] launcher = "process"`, whose trainer and sampler run in
        worker processes of their own (openrld/worker/) instead of threads of the daemon's;
- engine: the daemon's trainer engine (`TorchTrainer`, the same forward_backward and
        optim_step calls the trainer actor makes) in this process, no server: what the
        daemon's compute costs before any HTTP, SDK or event loop is around it.

Bare and API blocks alternate, so drift in this shared machine's speed hits both.
Printed figures, all measured in this run:

    throughput ratio = bare seconds per step / API pipelined seconds per step  (target >= 0.9 per shape)
    lock-step ratio  = bare seconds per step / API lock-step seconds per step  (no target: latency-bound)
    process ratio    = bare seconds per step / API pipelined seconds per step, trainer process
    engine ratio     = bare seconds per step / engine seconds per step         (no target: it splits the gap)
    memory ratio     = daemon peak RSS / bare-loop peak RSS                    (target <= 1.2)
                       and, for the trainer-process daemon, the sum of its own peak and its
                       trainer process's (an upper bound: the peaks need not coincide, and
                       pages of torch's libraries that both map count twice)

The bare loop's peak is that of a child process that runs only the bare loop over the
same shapes (same imports, same model), so neither side counts the other's memory.

Run: `.venv/bin/python bench/train_throughput.py` (about 7 minutes on 2 CPU cores; `--shapes 8x128`
measures one shape).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import peft
import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import match_daemon_threads, tiny_daemon  # noqa: E402

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum  # noqa: E402
from openrld.gpu.models import load_causal_lm, lora_config  # noqa: E402
from openrld.gpu.torch_trainer import TorchTrainer  # noqa: E402

SHAPES = ((8, 128), (32, 256), (4, 1024))  # (sequences, tokens per sequence)
RANK, LR = 8, 1e-4
WARMUP, STEPS = 1, 4
# Alternating rounds per shape. The small shape's steps are short, so more of its rounds cost
# little, and its figure, the most sensitive to this shared machine's drift, needs them most.
ROUNDS = {(8, 128): 8, (32, 256): 2, (4, 1024): 2}


def batch_tokens(batch: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(batch * seq_len).integers(3, 380, size=(batch, seq_len + 1))


class BareLoop:
    """The baseline: model, loss and optimizer with no server around them."""

    def __init__(self, model_dir: Path) -> None:
        model = load_causal_lm(model_dir, torch.device("cpu"))
        self.model = peft.get_peft_model(model, lora_config(LoraSpec(rank=RANK)))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, foreach=False
        )

    def steps(self, batch: int, seq_len: int, count: int) -> list[float]:
        tokens = torch.from_numpy(batch_tokens(batch, seq_len))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        times = []
        for _ in range(count):
            start = time.perf_counter()
            logits = self.model(input_ids=inputs).logits.float()  # (B, T, V)
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            (-logprobs.sum()).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return times


class EngineLoop:
    """The daemon's trainer engine in this process: the calls the trainer actor makes, without the server."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = TorchTrainer(model_dir, torch.device("cpu"))
        self.engine.add_adapter("bench", LoraSpec(rank=RANK, seed=0))

    def steps(self, batch: int, seq_len: int, count: int) -> list[float]:
        data = [
            TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in batch_tokens(batch, seq_len)
        ]
        request = ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.engine.forward_backward_many("bench", [request])
            self.engine.optim_step("bench", AdamParams(learning_rate=LR))
            times.append(time.perf_counter() - start)
        return times


class ApiLoop:
    def __init__(self, url: str) -> None:
        import tinker

        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model="tiny-llama", rank=RANK, seed=0).result()

    def steps(self, batch: int, seq_len: int, count: int, pipelined: bool) -> list[float]:
        """Seconds per step, `count` of them.

        Lock-step: each step's forward_backward and optim_step are submitted together and
        both results are read before the next step (a latency-bound loop). Pipelined: the
        next step is submitted before the previous one's results are read, as
        tinker-cookbook's pipelined supervised loop does, so the trainer never waits for the
        client; a step's time is the interval between consecutive completions.
        """
        from tinker import types

        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={"target_tokens": row[1:].tolist()},
            )
            for row in batch_tokens(batch, seq_len)
        ]
        adam = types.AdamParams(learning_rate=LR)

        def submit():
            return self.training.forward_backward(data, "cross_entropy"), self.training.optim_step(adam)

        def wait(futures) -> None:
            for future in futures:
                future.result()

        times = []
        if not pipelined:
            for _ in range(count):
                start = time.perf_counter()
                wait(submit())
                times.append(time.perf_counter() - start)
            return times
        in_flight = submit()
        wait_started = time.perf_counter()
        for _ in range(count):
            following = submit()
            wait(in_flight)
            done = time.perf_counter()
            times.append(done - wait_started)
            in_flight, wait_started = following, done
        wait(in_flight)
        return times

    def close(self) -> None:
        self.service.close("success").result()


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident set, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


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


def daemon_pid(model_dir: Path | None = None) -> int:
    """The `openrld serve` child of this process (started by tiny_daemon); with several, the one
    whose config sits beside `model_dir`."""
    config = b"openrld.cli serve" if model_dir is None else str(model_dir.parent / "openrld.toml").encode()
    pids = children(os.getpid(), config)
    if len(pids) != 1:
        raise RuntimeError(f"expected one daemon process, found {pids}")
    return pids[0]


def bare_peak_in_child(model_dir: Path) -> int:
    """Peak RSS of a child that runs only the bare loop, two steps per shape."""
    out = subprocess.run(
        [sys.executable, __file__, "--bare-peak", str(model_dir)], check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def main(shapes: tuple[tuple[int, int], ...] = SHAPES) -> None:
    torch.manual_seed(0)
    match_daemon_threads()
    with tiny_daemon() as (url, model_dir), tiny_daemon('[workers]\nlauncher = "process"') as (process_url, process_model):
        bare, engine, api = BareLoop(model_dir), EngineLoop(model_dir), ApiLoop(url)
        process_api = ApiLoop(process_url)
        figures = []
        for batch, seq_len in shapes:
            times: dict[str, list[float]] = {"bare": [], "pipelined": [], "lock-step": [], "engine": [], "process": []}
            bare.steps(batch, seq_len, WARMUP)
            engine.steps(batch, seq_len, WARMUP)
            api.steps(batch, seq_len, WARMUP, pipelined=False)
            process_api.steps(batch, seq_len, WARMUP, pipelined=False)
            for _ in range(ROUNDS[batch, seq_len]):
                times["bare"] += bare.steps(batch, seq_len, STEPS)
                times["pipelined"] += api.steps(batch, seq_len, STEPS, pipelined=True)
                times["process"] += process_api.steps(batch, seq_len, STEPS, pipelined=True)
                times["lock-step"] += api.steps(batch, seq_len, STEPS, pipelined=False)
                times["engine"] += engine.steps(batch, seq_len, STEPS)
            figures.append((batch, seq_len, {key: statistics.median(values) for key, values in times.items()}))
        daemon_peak = peak_rss_bytes(daemon_pid(model_dir))
        process_daemon = daemon_pid(process_model)
        (trainer_process,) = [pid for pid in children(process_daemon, b"openrld.worker") if _is_trainer(pid)]
        process_peaks = peak_rss_bytes(process_daemon), peak_rss_bytes(trainer_process)
        api.close()
        process_api.close()
        bare_peak = bare_peak_in_child(model_dir)
    rounds = ", ".join(f"{b}x{t}: {n}x{STEPS}" for (b, t), n in ROUNDS.items() if (b, t) in shapes)
    print(f"tiny Llama, LoRA rank {RANK}, median per side of alternating rounds of steps ({rounds})")
    for batch, seq_len, median in figures:
        bare_s, pipelined_s, lock_step_s = median["bare"], median["pipelined"], median["lock-step"]
        engine_s, process_s = median["engine"], median["process"]
        print(
            f"{batch:>3}x{seq_len:<5} bare {bare_s * 1e3:7.1f} ms  API pipelined {pipelined_s * 1e3:7.1f} ms  "
            f"throughput ratio (bare/API, target >= 0.9): {bare_s / pipelined_s:.3f}   "
            f"trainer process {process_s * 1e3:7.1f} ms, ratio {bare_s / process_s:.3f}   "
            f"lock-step {lock_step_s * 1e3:7.1f} ms, ratio {bare_s / lock_step_s:.3f}   "
            f"engine {engine_s * 1e3:7.1f} ms, ratio {bare_s / engine_s:.3f}"
        )
    print(
        f"peak RSS: daemon {daemon_peak / 2**20:.0f} MiB, bare loop {bare_peak / 2**20:.0f} MiB, "
        f"memory ratio (daemon/bare, target <= 1.2): {daemon_peak / bare_peak:.3f}"
    )
    print(
        f"peak RSS with process workers: daemon {process_peaks[0] / 2**20:.0f} MiB + trainer process "
        f"{process_peaks[1] / 2**20:.0f} MiB, memory ratio (sum/bare): {sum(process_peaks) / bare_peak:.3f}"
    )


def bare_peak_main(model_dir: Path) -> None:
    match_daemon_threads()
    loop = BareLoop(model_dir)
    for batch, seq_len in SHAPES:
        loop.steps(batch, seq_len, 2)
    print(peak_rss_bytes(os.getpid()))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--bare-peak":
        bare_peak_main(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--shapes":  # e.g. --shapes 8x128,32x256
        main(tuple(tuple(int(n) for n in shape.split("x")) for shape in sys.argv[2].split(",")))
    else:
        main()
