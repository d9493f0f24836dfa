"""openrld beside a peer Tinker server, SkyRL's, driven by the same client loop, with a researcher's HF `generate`
as the sampler's baseline.

The peer: SkyRL 0.4.0's Tinker server (`skyrl.tinker.api`) with its JAX backend, on the CPU, in the
environment `make skyrl-env` builds (.venv-skyrl: pyenv's Python 3.12, `skyrl[tinker,jax]==0.4.0`,
tinker 0.25). It serves the same model directory as openrld, with two LoRA slots of rank at most 8
(`--backend-config '{"max_lora_adapters": 2, "max_lora_rank": 8}'`: its default of 32 slots of rank 32
costs it about 7x on this work) and otherwise its defaults. Its API process relaunches its engine with
`uv run`, so it starts as `uv run --no-sync --extra tinker --extra jax -m skyrl.tinker.api ...` from
bench/skyrl/, a project that declares those extras, with UV_PROJECT_ENVIRONMENT naming .venv-skyrl.
openrld: `openrld serve` with its default config (bench/_daemon.py).

The client: bench/_sdk_loop.py, one process per server, both run by .venv-skyrl's Python with the
tinker SDK 0.25 it holds (SkyRL's sampling fails with 0.38; openrld serves 0.25 too), so the two
servers answer the same requests from the same SDK. The baseline of the sampler: bench/_bare_loop.py,
the loop a researcher writes with transformers + peft, sampling with HF `generate`, in the project's
environment with torch's defaults (rl_throughput.py has its SFT step and RL iteration). The figures
are rl_throughput.py's three: SFT step 8x128 (lock-step), sample 8 x 32 new tokens from a 32-token
prompt by the LoRA's weights, and an RL iteration (save_weights_and_get_sampling_client, sample
8 x 32, importance_sampling forward_backward, optim_step). Each figure is warmed up once on every
side (JAX compiles each shape on first use), and openrld first runs as many RL iterations as its
sampler holds versions (a long run's steady state). Rounds alternate openrld, SkyRL, bare per figure;
each round's seconds are printed, then the medians, as RESULT lines:

    RESULT <model> <figure> medians: openrld A s  SkyRL B s  [bare C s]  SkyRL/openrld B/A  [bare/openrld C/A]

A ratio above 1 is openrld faster. The load average is printed before and after. SkyRL trains no
LoRA on the unembedding (it ignores the SDK's train_unembed, and refuses it on tied embeddings such as
SmolLM2's); openrld's and the bare loop's LoRA cover lm_head too.

Run: `make skyrl-env` once, then `.venv/bin/python bench/skyrl_peer.py` (SmolLM2-135M-Instruct; about
10 minutes on 2 CPU cores; `--rounds N` sets the rounds). Not part of `make test` or `make bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, clean_env, daemon, vocab_size

from openrld.actors.sampler import MAX_LOADED_VERSIONS

HERE = Path(__file__).resolve().parent
SKYRL_VENV = HERE.parent / ".venv-skyrl"
SKYRL_PROJECT = HERE / "skyrl"  # its pyproject declares the extras `uv run --extra` asks for
SKYRL_BACKEND_CONFIG = {"max_lora_adapters": 2, "max_lora_rank": 8}
SKYRL_START_TIMEOUT_S = 300
# (title, the SDK client's request, the bare loop's request or None); each answers seconds. The bare loop
# samples only: the issue holds the sampler to both HF `generate` and SkyRL's, and rl_throughput.py has
# the bare SFT step and RL iteration (its HF `generate` takes minutes a round on a loaded machine).
WORK: tuple[tuple[str, dict, dict | None], ...] = (
    ("SFT step 8x128", dict(op="sft_steps", rows=8, tokens=128, count=1, pipelined=False), None),
    ("sample 8x32", dict(op="sample", batch=8, new_tokens=32, lora=True), dict(op="sample")),
    ("RL iteration", dict(op="rl_iteration"), None),
)
SIDES = ("openrld", "SkyRL", "bare")


def seconds(answer: float | list[float]) -> float:
    """A request's seconds: sft_steps answers a list of one."""
    return answer[0] if isinstance(answer, list) else answer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def skyrl_server(model_dir: Path) -> Iterator[str]:
    """Yields the URL of SkyRL's Tinker server on `model_dir`, its database and checkpoints in a temporary
    dir (its default database lives in its package dir and outlives the run); stopped on exit, with the
    engine it relaunched (one process group)."""
    with tempfile.TemporaryDirectory(prefix="openrld-bench-skyrl-") as tmp:
        port = free_port()
        command = [
            str(SKYRL_VENV / "bin" / "uv"), "run", "--no-sync", "--extra", "tinker", "--extra", "jax",
            "-m", "skyrl.tinker.api", "--backend", "jax", "--base-model", str(model_dir),
            "--backend-config", json.dumps(SKYRL_BACKEND_CONFIG), "--host", "127.0.0.1", "--port", str(port),
            "--database-url", f"sqlite:///{tmp}/tinker.db", "--checkpoints-base", f"{tmp}/checkpoints",
        ]
        env = dict(
            clean_env(os.environ), UV_PROJECT_ENVIRONMENT=str(SKYRL_VENV),
            PATH=f"{SKYRL_VENV / 'bin'}{os.pathsep}{os.environ['PATH']}",  # the API relaunches its engine as `uv`
        )
        env.pop("VIRTUAL_ENV", None)  # uv would warn that it differs from the project's environment
        with open(Path(tmp) / "server.log", "w") as log:
            proc = subprocess.Popen(command, cwd=SKYRL_PROJECT, env=env, stdout=log, stderr=log, start_new_session=True)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_until_answering(url, proc, Path(tmp) / "server.log")
                yield url
            finally:
                stop_group(proc)


def wait_until_answering(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SKYRL_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"SkyRL's server exited ({proc.returncode}):\n{log.read_text()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/", timeout=5):
            return
        time.sleep(1)
    raise RuntimeError(f"SkyRL's server did not answer in {SKYRL_START_TIMEOUT_S} s:\n{log.read_text()}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (uv, its API, the engine's uv and the engine), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine, should it outlive the API process


def load() -> str:
    return "load average " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def measure(name: str, model_dir: Path, rounds: int) -> None:
    client = str(SKYRL_VENV / "bin" / "python")  # tinker 0.25 for both servers
    vocab = vocab_size(model_dir)
    with daemon({name: model_dir}) as openrld_url, skyrl_server(model_dir) as skyrl_url, \
            child("_sdk_loop.py", openrld_url, name, vocab, python=client) as ours, \
            child("_sdk_loop.py", skyrl_url, model_dir, vocab, python=client) as peer, \
            child("_bare_loop.py", model_dir) as bare:
        sides = {"openrld": ours, "SkyRL": peer}
        for _, request, bare_request in WORK:  # warm-up: connections, lazy allocations, JAX's compiles
            for api in sides.values():
                api.call(**request)
            if bare_request is not None:
                bare.call(**bare_request)
        # A long RL run's steady state: past the versions openrld's sampler holds (actors/sampler.py), each
        # new version takes the oldest one's adapter. SkyRL's is there from its first: each save reloads its
        # one training slot's sampler weights ("at adapter index 1", every time, in its log).
        ours.call("rl_iterations", count=MAX_LOADED_VERSIONS)
        times: dict[tuple[str, str], list[float]] = {}
        for index in range(rounds):
            for title, request, bare_request in WORK:
                answers = {side: seconds(api.call(**request)) for side, api in sides.items()}
                if bare_request is not None:
                    answers["bare"] = seconds(bare.call(**bare_request))
                for side, value in answers.items():
                    times.setdefault((side, title), []).append(value)
                print(f"{name} {title:14s} round {index + 1}: {row(answers)}", flush=True)
    for title, _, _ in WORK:
        medians = {side: statistics.median(times[side, title]) for side in SIDES if (side, title) in times}
        print(f"RESULT {name} {title:14s} medians: {row(medians)}", flush=True)


def row(answers: dict[str, float]) -> str:
    """Each side's seconds, then the others' as multiples of openrld's (above 1: openrld faster)."""
    ours = answers["openrld"]
    return "  ".join([f"{side} {value:7.3f} s" for side, value in answers.items()]
                     + [f"{side}/openrld {answers[side] / ours:.2f}" for side in SIDES[1:] if side in answers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny-llama", "smollm2"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))  # so the servers are stopped too
    if not (SKYRL_VENV / "bin" / "uv").exists():
        sys.exit(f"{SKYRL_VENV} is missing or incomplete: run `make skyrl-env` first (SkyRL's Tinker server and "
                 "the tinker 0.25 client this bench drives both servers with)")
    print(f"{args.rounds} alternating rounds a figure: openrld, SkyRL, then (the sample) the bare loop; {load()}", flush=True)
    with bench_models(args.models) as models:
        for name, model_dir in models:
            measure(name, model_dir, args.rounds)
    print(f"done; {load()}", flush=True)


if __name__ == "__main__":
    main()
