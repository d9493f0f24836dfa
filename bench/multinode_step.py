"""The step of an Automodel trainer that spans nodes, on the CPU: 4 gloo ranks over 2 torchruns (two
"nodes" on loopback) against 4 ranks in one torchrun and 2 ranks in one, with the single-process
trainer as the baseline.

One LoRA training step (`forward_backward_then_step`, summed cross-entropy, rank 8, AdamW) on the
tiny Llama at the shapes of `automodel_step.py`, by four engines on this machine's cores:

- torch:             the default trainer engine (`lora_trainer`) in this process: the baseline;
- 2 ranks:           openrl.trainer_gpus=2 on one node: one torchrun (`--standalone`) of 2 ranks;
- 4 ranks:           openrl.trainer_gpus=4 on one node: one torchrun of 4 ranks;
- 4 ranks, 2 nodes:  openrl.trainer_gpus=4 over two nodes as the daemons run it: the home's
                     torchrun of 2 ranks hosts the c10d rendezvous (`SpanRendezvous`, is_host=1)
                     and speaks the worker protocol; the member's torchrun of 2 ranks joins it
                     (`WorkerHosting.member_ranks`); the ranks renumber themselves, the home's
                     first (`worker/ranks.py`).

Printed per shape: the median step in ms (ratio: torch / engine), and

    cross-node = (4 ranks, 2 nodes) - (4 ranks), the median of the turns' differences: what
                 splitting one group's 4 ranks over two torchruns costs per step.

On loopback the two "nodes" share the cores and the kernel's TCP stack, so this is the cost of
the layout (two agents, one rendezvous, the ranks' order), not of a network: gloo talks over TCP
on loopback whether or not the ranks share a torchrun. A real network adds its latency to each
of the step's collectives (FSDP's all-gathers and reduce-scatters, the control broadcast).
Every rank has cores / ranks torch threads; 4 ranks on 2 cores are oversubscribed, equally in
both 4-rank layouts.

Run: `.venv/bin/python bench/multinode_step.py` (`--steps N`, default 20; `--quick`: 8x128 only,
3 steps). It runs itself in .venv-automodel (`make automodel-env`), as `automodel_step.py` does.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AUTOMODEL_PYTHON = HERE.parent / ".venv-automodel" / "bin" / "python"


def _run_in_the_automodel_environment() -> None:
    """Run this bench again in the Automodel environment with the workers' malloc settings, as
    `automodel_step.py` runs itself (importing it first would run that bench instead)."""
    from openrld.worker.launchers.process import _MALLOC

    python = sys.executable
    if importlib.util.find_spec("nemo_automodel") is None:
        if not AUTOMODEL_PYTHON.exists() or Path(python) == AUTOMODEL_PYTHON:
            sys.exit(f"no Automodel environment at {AUTOMODEL_PYTHON}: `make automodel-env` builds it")
        python = str(AUTOMODEL_PYTHON)
    elif all(name in os.environ for name in _MALLOC):
        return
    os.execve(python, [python, __file__, *sys.argv[1:]], {**_MALLOC, **os.environ})


_run_in_the_automodel_environment()

import numpy as np  # noqa: E402

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum  # noqa: E402
from openrld.gpu.tiny_models import build_tiny_model  # noqa: E402
from openrld.worker import builtin  # noqa: E402
from openrld.worker.client import WorkerTimeouts  # noqa: E402
from openrld.worker.hosting import WorkerHosting  # noqa: E402
from openrld.worker.launchers.torchrun import SpanRendezvous  # noqa: E402
from openrld.worker.protocol import Start  # noqa: E402

# The shapes, rank, optimizer and timing of automodel_step.py and worker_launchers.py (not imported:
# they reach the engine factory, which needs the gguf package the Automodel environment lacks).
RANK = 8
ADAM = AdamParams(learning_rate=1e-4)
TINY_SHAPES = [(8, 128), (32, 256), (4, 1024)]
MAX_BATCH_TOKENS = 8192
TIMEOUTS = WorkerTimeouts(hello_s=300.0, deadline_s=600.0)  # a group's start imports nemo_automodel on every rank
WARMUP = 2  # steps per engine at each shape before the timed ones


def batch(rows: int, length: int, vocab: int) -> ForwardBackwardBatch:
    tokens = np.random.default_rng(rows * length).integers(3, vocab, size=(rows, length + 1))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in tokens]
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


def turn_times(built: dict[str, object], work: ForwardBackwardBatch, turns: int) -> dict[str, list[float]]:
    """Seconds of each engine's steps, after WARMUP each, the engines stepping in turns (the order
    rotating) so that this shared machine's swings in speed fall on all alike."""
    for engine in built.values():
        for _ in range(WARMUP):
            engine.forward_backward_then_step("a", [work], ADAM)
    times: dict[str, list[float]] = {name: [] for name in built}
    names = list(built)
    for turn in range(turns):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            began = time.perf_counter()
            built[name].forward_backward_then_step("a", [work], ADAM)
            times[name].append(time.perf_counter() - began)
    return times


def paired_ms(minuend: list[float], subtrahend: list[float]) -> float:
    """The median of the turns' differences, in ms: steadier than the difference of two medians."""
    return statistics.median(a - b for a, b in zip(minuend, subtrahend, strict=True)) * 1e3


ENGINES = ("torch", "2 ranks", "4 ranks", "4 ranks, 2 nodes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_engines(model: Path, hosting: WorkerHosting, cores: int, stack: contextlib.ExitStack) -> dict[str, object]:
    """The four engines, each with adapter "a" open; the groups stop when `stack` closes."""
    options = {"max_batch_tokens": MAX_BATCH_TOKENS, "fine_tuning": "lora"}
    built: dict[str, object] = {
        "torch": builtin.build(Start("lora_trainer", str(model), "cpu", threads=cores, options={"max_batch_tokens": MAX_BATCH_TOKENS})),
    }
    for label, ranks, nodes in (("2 ranks", 2, 1), ("4 ranks", 4, 1), ("4 ranks, 2 nodes", 2, 2)):
        started = time.perf_counter()
        span = None
        if nodes > 1:
            endpoint = f"127.0.0.1:{_free_port()}"
            span = SpanRendezvous(nodes, endpoint, "bench", is_home=True, local_addr="127.0.0.1")
            member = SpanRendezvous(nodes, endpoint, "bench", is_home=False, local_addr="127.0.0.1")
            ranks_there = hosting.member_ranks(member, ("cpu",) * ranks, str(model))
            stack.callback(ranks_there.stop, 10.0)
        built[label] = hosting.start(
            hosting.automodel_launcher(ranks, span), role="trainer", kind="automodel_trainer", model_name="tiny-llama",
            model_dir=str(model), device="cpu", threads=max(1, cores // (ranks * nodes)), options=options, job="bench",
        )
        stack.callback(built[label].close)
        print(f"{label}: group ready in {time.perf_counter() - started:.1f} s", flush=True)
    for engine in built.values():
        engine.add_adapter("a", LoraSpec(rank=RANK, seed=0), "adamw")
    return built


def print_row(rows: int, length: int, times: dict[str, list[float]]) -> None:
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    columns = "  ".join(
        f"{name} {ms[name]:7.1f}" + ("" if name == "torch" else f" ({ms['torch'] / ms[name]:.3f})") for name in ENGINES
    )
    cross = paired_ms(times["4 ranks, 2 nodes"], times["4 ranks"])
    print(f"{rows:>2}x{length:<4}  {columns}   cross-node {cross:+6.1f} ms ({cross / ms['4 ranks']:+.1%} of 4 ranks)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per engine per shape (default 20)")
    parser.add_argument("--quick", action="store_true", help="8x128 only, 3 steps")
    args = parser.parse_args()
    shapes, steps = (TINY_SHAPES[:1], 3) if args.quick else (TINY_SHAPES, args.steps)
    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-")))
        model = build_tiny_model(root / "tiny-llama", "llama", seed=0)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        hosting = WorkerHosting(automodel_python=sys.executable, timeouts=TIMEOUTS)
        stack.callback(hosting.close)
        built = build_engines(model, hosting, cores, stack)
        print(
            f"tiny Llama, LoRA rank {RANK}, {cores} cores; medians of {steps} steps per engine after {WARMUP}, in turns;"
            " ms per step (ratio: torch / engine); cross-node: the median of the turns' differences",
            flush=True,
        )
        for rows, length in shapes:
            print_row(rows, length, turn_times(built, batch(rows, length, vocab), steps))


if __name__ == "__main__":
    main()
