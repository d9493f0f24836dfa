"""A LoRA trainer engine in a process of its own, called as the engine itself is.

Why: in the daemon's process the engine's Python shares one GIL with the event loop.
A forward and backward pass of a small model is thousands of short torch calls, and
each one that finds the GIL taken by the loop (decoding the next request, answering a
long-poll) waits for it. On a 2-core node the 8x128 training step ran at 0.66-0.83 of a
bare loop's speed in the daemon's process, and at 0.70-0.95 in a process of its own
(`bench/train_throughput.py`, twelve paired runs). vLLM's v1 engine runs its EngineCore
in a process of its own for the same reason.

What it does: `TrainerProcess` starts a child interpreter that builds the engine (a
`TorchTrainer`) and then answers one call at a time over a pipe: the method's name and
arguments in, its value or its exception out, both pickled (tensors as bytes, never
shared memory, so that nothing outlives a call). It has the trainer's methods, so the
trainer actor calls it as it would call the engine, from its worker thread.

What it does not do:
- full fine-tuning: a full trainer hands its sampler whole weight deltas, which would
  cross the pipe at every sync; it stays in the daemon's process;
- restart a dead child: a call after the child died raises `EngineLost`, and so does
  every later one; the trainer actor then builds a new engine (actors/trainer.py);
- trio: the calls block their thread, as the engine's own do.

The child ignores SIGINT and SIGTERM: a Ctrl-C or systemd's stop reaches the whole
process group, and the daemon's graceful drain lets the step in flight finish before it
closes the pipe. A child whose parent was killed reads end-of-file and exits.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, LoraSpec, OptimParams, OptimResult
from openrld.errors import EngineLost, OpenrldError

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # a step in flight finishes first; past this the child is killed
MALLOC_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: smaller blocks come from the heap, and are kept
MALLOC_TRIM_THRESHOLD = 2**30  # free heap at the top is given back only past this


class TrainerProcess:
    """A `TorchTrainer` built and run in a child process; one call at a time."""

    def __init__(self, build: Callable[[], Any], *, threads: int | None, name: str) -> None:
        # A fresh interpreter, not fork (which would copy the daemon's threads' held locks) nor
        # multiprocessing's spawn (which re-runs the caller's __main__, a user's script perhaps).
        ours, theirs = socket.socketpair()
        with theirs:
            # Its stdout is the daemon's stderr: the daemon's stdout says where it listens, and nothing else.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "openrld.gpu.engine_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=2, env=_child_environment(),
            )
        self.name = name
        self._conn = multiprocessing.connection.Connection(ours.detach())
        self._lock = threading.Lock()
        self._stop = weakref.finalize(self, _stop, self._process, self._conn, name)
        try:
            self._conn.send_bytes(pickle.dumps((build, threads), protocol=pickle.HIGHEST_PROTOCOL))
            self._receive()  # the build's outcome
        except BaseException:
            self._stop()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def close(self) -> None:
        """Stop the child: it finishes the call in hand, if any, then exits."""
        with self._lock:
            self._stop()

    # The engine's methods, by name; see gpu/torch_trainer.py for what each does.
    def add_adapter(self, name: str, spec: LoraSpec, optimizer: str = "adamw") -> None:
        return self._call("add_adapter", name, spec, optimizer)

    def drop_adapter(self, name: str) -> None:
        return self._call("drop_adapter", name)

    def has_adapter(self, name: str) -> bool:
        return self._call("has_adapter", name)

    def adapter_names(self) -> list[str]:
        return self._call("adapter_names")

    def adapter_tensors(self, name: str) -> dict[str, Any]:
        return self._call("adapter_tensors", name)

    def sampler_payload(self, name: str, version: str) -> dict[str, Any]:
        return self._call("sampler_payload", name, version)

    def adapter_gradients(self, name: str) -> dict[str, Any]:
        return self._call("adapter_gradients", name)

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        return self._call("forward_backward", name, batch)

    def forward_backward_many(self, name: str, batches: Sequence[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        return self._call("forward_backward_many", name, list(batches))

    def forward_backward_then_step(
        self, name: str, batches: Sequence[ForwardBackwardBatch], params: OptimParams | None
    ) -> tuple[list[ForwardBackwardResult], OptimResult | Exception | None]:
        return self._call("forward_backward_then_step", name, list(batches), params)

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        return self._call("optim_step", name, params)

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        return self._call("sampler_checkpoint", name, directory)

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        return self._call("export_adapter", name, directory, base_model)

    def save_state(self, name: str, directory: Path, with_optimizer: bool = True) -> int:
        return self._call("save_state", name, directory, with_optimizer)

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None = None, with_optimizer: bool = True,
        optimizer: str | None = None,
    ) -> None:
        return self._call("load_state", name, directory, spec, with_optimizer, optimizer)

    def park(self) -> Any:
        return self._call("park")

    def resume(self) -> Any:
        return self._call("resume")

    @property
    def is_parked(self) -> bool:
        return self._call("is_parked")

    @property
    def last_sync(self) -> None:
        return None  # a LoRA trainer makes no weight sync

    def statistics(self) -> Any:
        return self._call("statistics")

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if not self._stop.alive:
                raise EngineLost(f"trainer process {self.name} was closed")
            try:
                self._conn.send_bytes(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
            except OSError as error:
                raise self._died() from error
            return self._receive()

    def _receive(self) -> Any:
        try:
            ok, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as error:
            raise self._died() from error
        if not ok:
            raise value
        return value

    def _died(self) -> EngineLost:
        self._stop()
        return EngineLost(
            f"trainer process {self.name} died (exit status {self._process.returncode}); "
            "the weights and optimizer state it held are gone: resume from a saved state"
        )


def _child_environment() -> dict[str, str]:
    """The daemon's environment, with glibc's malloc told to keep the engine's working set.

    The engine runs on the child's main thread, in glibc's main arena, which handed the freed
    activations of each step back to the kernel and faulted them in again the next: at 4x1024
    tokens, 9,000 page faults and 26 ms of kernel time a step, against about 500 and 4 ms with
    these (the daemon's trainer thread has an arena of its own, which gives back less). An
    operator's own settings win.
    """
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(MALLOC_TRIM_THRESHOLD))
    return env


def _stop(process: subprocess.Popen, conn: multiprocessing.connection.Connection, name: str) -> None:
    conn.close()  # the child reads end-of-file after the call in hand, and exits
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        logger.warning("trainer process %s did not stop in %.0f s; killing it", name, STOP_TIMEOUT_S)
        process.kill()
        process.wait()


# ---------------------------------------------------------------- the child


def _serve(conn: multiprocessing.connection.Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        build, threads = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    from openrld.gpu.devices import apply_cpu_threads

    apply_cpu_threads(threads)  # the daemon's share of the cores, as an engine in its process would have
    try:
        engine = build()
    except BaseException as error:
        _reply(conn, False, error)
        return
    _reply(conn, True, None)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            attribute = getattr(engine, method)
            value = attribute(*args) if callable(attribute) else attribute  # a property: is_parked
        except OpenrldError as error:  # an error the engine means to raise: it crosses as it is
            _reply(conn, False, error)
        except Exception as error:  # a fault: the daemon logs it, with where in this process it arose
            error.add_note(traceback.format_exc())
            _reply(conn, False, error)
        else:
            _reply(conn, True, value)


def _reply(conn: multiprocessing.connection.Connection, ok: bool, value: Any) -> None:
    try:
        payload = pickle.dumps((ok, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # an exception that does not pickle still reaches the caller, as text
        payload = pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value} ({error})")))
    conn.send_bytes(payload)


if __name__ == "__main__":
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])))
    # The engine's state goes with the process; tearing torch's down would only take seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
