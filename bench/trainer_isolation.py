"""What the API's traffic costs a trainer engine that runs in a process of its own.

In the daemon, the trainer's worker thread shares the GIL with the event loop that serves the
training loop's requests. On this 2-core machine, that costs the 8x128 step of
`train_throughput.py` 10-25%. The engine alone runs at the bare loop's speed. This bench measures
a trainer engine in a process of its own, stepping while a real SDK client drives a real daemon
with the training loop's traffic, with nothing crossing between the two: the ceiling of
`[workers] launcher = "process"` (openrld/worker/), whose own figure is train_throughput's
"trainer process" column.

- engine: the daemon's `TorchTrainer` (the same `forward_backward_many` and `optim_step` calls as
  train_throughput's engine column) in a child process, 8x128 tokens per step;
- bare: bench/_bare_loop.py's loop (train_throughput's baseline) in the same child process, with the
  daemon's thread count as the engine (a like-for-like split, not what a user gets), with no traffic;
- traffic: while the engine steps, one SDK client sends the pipelined loop's requests to a daemon
  on loopback, paced at the bare loop's step time. Per step that is a `forward_backward` of the
  same 8 datums of 128 tokens and an `optim_step`, and their two long-polls. The daemon decodes
  each datum, queues and answers the request, but its trainer refuses the datums (one target too
  many), so the daemon computes next to nothing.

Bare and engine blocks alternate, so drift in this shared machine's speed hits both. Printed:

    isolation ratio = bare seconds per step / engine seconds per step under the traffic

1.0 means the API's traffic costs a trainer in its own process nothing; compare it with
train_throughput's 8x128 throughput ratio, where the trainer shares the daemon's process.

Run: `.venv/bin/python bench/trainer_isolation.py` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too

# isort: split
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bare_loop import BareLoop
from _daemon import match_daemon_threads, tiny_daemon, vocab_size
from _workload import RANK, batch_tokens
from train_throughput import EngineLoop

SHAPE = (8, 128)
ROUNDS, STEPS = 4, 6


class Traffic:
    """The pipelined training loop's requests, sent from a thread while `running` is set."""

    def __init__(self, url: str, vocab: int) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model="tiny-llama", rank=RANK, seed=0).result()
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={"target_tokens": row.tolist()},  # one too many: refused after decoding
            )
            for row in batch_tokens(*SHAPE, vocab)
        ]
        self.step_s = 0.06
        self.steps = 0
        self.running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        in_flight: tuple = ()
        while not self._stop.is_set():
            if not self.running.is_set():
                time.sleep(0.01)
                continue
            started = time.perf_counter()
            following = (
                self.training.forward_backward(self.data, "cross_entropy"),
                self.training.optim_step(types.AdamParams(learning_rate=1e-4)),
            )
            if in_flight:
                refused, optim = in_flight
                try:
                    refused.result()
                    raise AssertionError("the daemon ran the traffic's forward_backward; it must refuse it")
                except tinker.RequestFailedError:
                    pass
                optim.result()
            in_flight = following
            self.steps += 1
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.service.close("success").result()


def worker(model_dir: Path) -> None:
    """The child process: bare and engine loops, stepping on request ("bare 6" / "engine 6")."""
    match_daemon_threads()
    loops = {"bare": BareLoop(model_dir), "engine": EngineLoop(model_dir)}
    for loop in loops.values():
        loop.steps(*SHAPE, 2)
    print("ready", flush=True)
    for line in sys.stdin:
        kind, count = line.split()
        print(statistics.median(loops[kind].steps(*SHAPE, int(count))), flush=True)


def main() -> None:
    with tiny_daemon() as (url, model_dir):
        child = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(model_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"

        def step_s(kind: str) -> float:
            child.stdin.write(f"{kind} {STEPS}\n")
            child.stdin.flush()
            return float(child.stdout.readline())

        traffic = Traffic(url, vocab_size(model_dir))
        bare, engine, rates = [], [], []
        for _ in range(ROUNDS):
            bare.append(step_s("bare"))
            traffic.step_s = bare[-1]
            traffic.running.set()
            time.sleep(0.3)  # the loop's requests are flowing before the engine starts
            steps, started = traffic.steps, time.perf_counter()
            engine.append(step_s("engine"))
            rates.append((traffic.steps - steps) / (time.perf_counter() - started))
            traffic.running.clear()
        traffic.close()
        assert min(rates) > 0, f"no traffic in some engine blocks: {rates}"
        child.stdin.close()
        child.wait(30)
    b, e = statistics.median(bare), statistics.median(engine)
    print(f"tiny Llama, LoRA rank {RANK}, {SHAPE[0]}x{SHAPE[1]}, median of {ROUNDS}x{STEPS} steps per side")
    print(
        f"bare {b * 1e3:.1f} ms  engine in its own process under {statistics.median(rates):.1f} loop steps/s "
        f"of API traffic {e * 1e3:.1f} ms  isolation ratio (bare/engine) {b / e:.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
    else:
        main()
