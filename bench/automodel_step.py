"""The Automodel trainer's step on the CPU: 2 gloo ranks through the worker protocol, against
the single-process trainer, with the worker protocol's cost told apart from FSDP's.

One LoRA training step (`forward_backward_then_step`: the pass and the AdamW step in one call,
as the trainer actor makes it; summed cross-entropy, rank 8, AdamW) on the tiny Llama at the
shapes of `train_throughput.py` and `worker_launchers.py` (8x128, 32x256 and 4x1024 tokens,
the latter's batches), by four engines, all on this machine's cores:

- torch:      the default trainer engine (`lora_trainer`, `TorchTrainer`) in this process,
              called directly: the baseline;
- automodel:  the Automodel engine (`automodel_trainer`: FSDP2 over a process group of one)
              in this process, called directly: no worker protocol;
- 1 rank:     the Automodel engine as a daemon runs it for openrl.trainer_gpus=1: a torchrun
              group of one rank in the Automodel environment, through the worker protocol
              (`WorkerHosting.automodel_launcher`, then `RemoteTrainer`);
- 2 ranks:    the same for openrl.trainer_gpus=2: two gloo ranks, rank 0 speaking for the
              group, each rank scoring half of the datums.

An engine alone gets every core as torch threads; each of the 2 ranks gets half (as a node with
devices = ["cpu:0", "cpu:1"] gives each). Every engine is built by `openrld.worker.builtin.build`
from the same kind of `Start`, with max_batch_tokens 8192; this process runs with the workers'
malloc settings (`worker/launchers/process.py`; it runs itself again to get them), so that the
in-process engines allocate as the workers do (the daemon's own process bounds its heap
otherwise, `openrld/heap.py`: not measured here). The engines take turns, one step each, the
order rotating, so drift in this shared machine's speed falls on all of them. Printed per
shape, after 2 warm-up steps each, the median step in ms and:

    ratio          = torch seconds per step / the engine's seconds per step
    protocol       = 1 rank - automodel, the median of the turns' differences: the worker
                     protocol's cost (the call there and back, the codec, the ranks' control
                     broadcast on rank 0), in ms and as a share of torch's step
    FSDP, 2 ranks  = 2 ranks - 1 rank, likewise: what spreading the step over 2 gloo ranks
                     costs (or saves): the shards' all-gathers, the gradients' reduce-scatter,
                     and each rank's half of the datums on half of the cores; and the control
                     channel's broadcast of each call to the second rank (the two no-op round
                     trips tell how much that is)

Also printed: each group's start, and the round trip of a call that does no work
(`has_adapter`) to each worker. The table is on stdout; the libraries' warnings on stderr.

The Automodel engine runs only in its own environment (`make automodel-env`; `make test` builds
it): started from another interpreter, the bench runs itself in .venv-automodel.

Run: `.venv/bin/python bench/automodel_step.py` (about 2.5 minutes on 2 CPU cores; `--steps N`:
timed steps per engine per shape, default 40; `--quick`: 8x128 only, 3 steps, about 40 s, most
of it the engines' start).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AUTOMODEL_PYTHON = HERE.parent / ".venv-automodel" / "bin" / "python"


def _run_in_the_automodel_environment() -> None:
    """Run this bench again, unless this process already runs in the Automodel environment with the
    workers' malloc settings (glibc reads them only at a process's start). The in-process engines
    then allocate as the workers' do, and the figures differ by the protocol, not by the heap."""
    # The first import of openrld, before torch's: its CPU thread-pool wait policy holds here too.
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

from openrld.batches import LoraSpec  # noqa: E402
from openrld.gpu.tiny_models import build_tiny_model  # noqa: E402
from openrld.worker import builtin  # noqa: E402
from openrld.worker.client import WorkerTimeouts  # noqa: E402
from openrld.worker.hosting import WorkerHosting  # noqa: E402
from openrld.worker.protocol import Start  # noqa: E402

sys.path.insert(0, str(HERE))

from worker_launchers import RANK, TINY_SHAPES, batch, round_trip_s, turn_times  # noqa: E402

MAX_BATCH_TOKENS = 8192
# An Automodel group's start imports nemo_automodel on every rank: ~20 s on 2 idle cores, more when shared.
TIMEOUTS = WorkerTimeouts(hello_s=300.0, deadline_s=600.0)
ENGINES = ("torch", "automodel", "1 rank", "2 ranks")
WARMUP = 2  # steps per engine at each shape before the timed ones: allocator, kernels, FSDP's first gathers


def build_engines(model: Path, hosting: WorkerHosting, cores: int, stack: contextlib.ExitStack) -> dict[str, object]:
    """The four engines, each with the job's adapter "a" open (the name `turn_times` steps); the
    workers are closed when `stack` closes."""
    options = {"max_batch_tokens": MAX_BATCH_TOKENS}
    automodel = {**options, "fine_tuning": "lora"}
    built = {
        "torch": builtin.build(Start("lora_trainer", str(model), "cpu", threads=cores, options=options)),
        "automodel": builtin.build(Start("automodel_trainer", str(model), "cpu", threads=cores, options=automodel)),
    }
    for ranks, label in ((1, "1 rank"), (2, "2 ranks")):
        started = time.perf_counter()
        built[label] = hosting.start(
            hosting.automodel_launcher(ranks), role="trainer", kind="automodel_trainer", model_name="tiny-llama",
            model_dir=str(model), device="cpu", threads=max(1, cores // ranks), options=automodel, job="bench",
        )
        stack.callback(built[label].close)
        print(f"{label}: group ready in {time.perf_counter() - started:.1f} s", flush=True)
    for engine in built.values():
        engine.add_adapter("a", LoraSpec(rank=RANK, seed=0), "adamw")
    return built


def paired_ms(minuend: list[float], subtrahend: list[float]) -> float:
    """The median of the turns' differences, in ms: steadier than the difference of two medians."""
    return statistics.median(a - b for a, b in zip(minuend, subtrahend, strict=True)) * 1e3


def print_row(rows: int, length: int, times: dict[str, list[float]]) -> None:
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    columns = "  ".join(
        f"{name} {ms[name]:6.1f}" + ("" if name == "torch" else f" ({ms['torch'] / ms[name]:.3f})") for name in ENGINES
    )
    protocol = paired_ms(times["1 rank"], times["automodel"])
    fsdp = paired_ms(times["2 ranks"], times["1 rank"])
    print(
        f"{rows:>2}x{length:<4}  {columns}   protocol {protocol:+5.1f} ({protocol / ms['torch']:+.1%})"
        f"   FSDP, 2 ranks {fsdp:+6.1f} ({fsdp / ms['torch']:+.1%})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per engine per shape (default 40)")
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
        trips = ", ".join(f"{name} {round_trip_s(built[name], 100) * 1e6:.0f} us" for name in ("1 rank", "2 ranks"))
        print(f"a call that does no work: {trips}", flush=True)
        print(
            f"tiny Llama, LoRA rank {RANK}, {cores} cores; medians of {steps} steps per engine after {WARMUP}, in turns;"
            f" ms per step (ratio: torch / engine); protocol and FSDP: medians of the turns' differences, ms (/ torch)",
            flush=True,
        )
        for rows, length in shapes:
            print_row(rows, length, turn_times(built, batch(rows, length, vocab), steps, WARMUP))


if __name__ == "__main__":
    main()
