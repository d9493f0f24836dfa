"""The process launcher: a worker in a local process, in a named Python environment.

The daemon's own interpreter by default; a config may name others, such as the
vLLM or NeMo Automodel environments that `make` builds, which pin torch and
transformers versions of their own. The worker gets the daemon's environment,
the socket and token variables, and glibc malloc settings that keep its working
set (see `_MALLOC`). It ignores SIGINT and SIGTERM: a Ctrl-C or a systemd stop
reaches the daemon's whole process group, and the daemon's drain lets the call in
hand finish before it says Bye. A worker whose daemon died reads the end of its
connection and exits, so none outlives the daemon; `reap` has nothing to find.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from openrld.worker.launchers import LaunchedWorker, WorkerSpec
from openrld.worker.launchers.visible_devices import worker_visible_devices

logger = logging.getLogger(__name__)

# The engine runs on the worker's main thread, in glibc's main arena, which handed the freed
# activations of each step back to the kernel and faulted them in again the next: at 4x1024
# tokens, 9,000 page faults and 26 ms of kernel time a step, against about 500 and 4 ms with
# these. An operator's own settings win.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


class LocalProcess:
    def __init__(self, process: subprocess.Popen, device: str, name: str) -> None:
        self.process = process
        self.device = device
        self.name = name

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            if timeout > 0:
                logger.warning("worker %s did not stop in %.0f s; killing it", self.name, timeout)
            self.process.kill()
            self.process.wait()

    def describe(self) -> str:
        return f"pid {self.process.pid}"


class ProcessLauncher:
    def __init__(self, python: str = "", command: tuple[str, ...] = ("-m", "openrld.worker")) -> None:
        self.python = python or sys.executable
        self.command = command

    def launch(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str]) -> LaunchedWorker:
        env = {**_MALLOC, **os.environ, **environment}
        env["OPENRLD_WORKER_SOCKET"] = socket_path
        env["OPENRLD_WORKER_IGNORE_SIGNALS"] = "1"
        device = spec.start.device
        if device.startswith("cuda"):
            # One device each: the worker sees only its own, as cuda:0, and cannot take another's memory.
            index = device.partition(":")[2] or "0"
            env["CUDA_VISIBLE_DEVICES"] = worker_visible_devices([index], os.environ.get("CUDA_VISIBLE_DEVICES"))
            device = "cuda:0"
        # Its stdout is the daemon's stderr: the daemon's stdout says where it listens, and nothing else.
        process = subprocess.Popen(
            [self.python, *self.command], stdin=subprocess.DEVNULL, stdout=2, env=env,
        )
        return LocalProcess(process, device, spec.name)

    def reap(self) -> int:
        return 0  # a worker exits when its daemon's end of the connection closes
