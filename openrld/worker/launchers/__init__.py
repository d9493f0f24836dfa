"""Where a worker runs, and how the daemon starts it and reaches it.

Every launcher starts the same conversation (`protocol.py`): the daemon listens
on a Unix socket of its own, in a private directory, and the worker it launched
connects to it with the token it was given. What differs is where that worker
runs and how it sees the socket, the model files and its devices:
- `process`: a local process in a named Python environment (process.py);
- `torchrun`: several ranks, rank 0 speaking for the group (torchrun.py);
- `container`: podman or docker on a VM, or a Pod on Kubernetes (container.py, pod.py).
In the daemon's own interpreter (inproc) there is no worker: the actor calls the
engine directly.

`start_worker` is the one way in: it listens, launches, waits for the hello
(watching the launched worker, so one that dies early fails at once, with its
exit status), checks the version and the token, sends Start and waits for Ready.
A worker that never says hello within `hello_s`, or that fails its build, is
stopped and reaped before the error reaches the actor.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Protocol

import msgspec

from openrld.errors import EngineLost, ServerError
from openrld.worker import values
from openrld.worker.client import WorkerConnection, WorkerTimeouts
from openrld.worker.frames import FrameSocket, Limits, ProtocolError
from openrld.worker.protocol import PROTOCOL_VERSION, Failure, Heartbeat, Hello, Ready, Role, Start

logger = logging.getLogger(__name__)

WORKER_SOCKET_DIR = "/run/openrld-worker"  # where a container or Pod sees the daemon's socket directory


class Mount(msgspec.Struct, frozen=True):
    source: str  # a path on this host
    target: str  # where the worker sees it (the same path, for a local process)
    read_only: bool = True


class WorkerSpec(msgspec.Struct, frozen=True):
    """One worker to launch: its name for logs, its role, what it builds and where."""

    name: str  # "openrld-trainer SmolLM2 (job abc)"
    role: Role
    start: Start  # its device is this node's label ("cpu", "cuda:1"); a launcher may rename it
    image: str | None = None  # a container image; None: the built-in worker
    mounts: tuple[Mount, ...] = ()  # the model directory, the checkpoint root
    job: str | None = None  # the job it serves alone, for the container's labels


class LaunchedWorker(Protocol):
    device: str  # the worker's device, as the worker sees it ("cuda:0" for a container given one GPU)

    def poll(self) -> int | None:
        """Its exit status once it has ended; None while it runs."""
        ...

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for it to end, then kill it; it is reaped on return."""
        ...

    def describe(self) -> str:
        """A pid, a container or Pod name: what an operator looks for."""
        ...


class Launcher(Protocol):
    def launch(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str]) -> LaunchedWorker:
        """Start the worker; `socket_path` is on this host, `environment` goes to the worker as it is."""
        ...

    def reap(self) -> int:
        """Stop every worker an earlier daemon of this node left running; how many there were."""
        ...


def socket_directory(root: Path | None = None) -> Path:
    """A private directory for this daemon's worker sockets (a socket path has at most 107 bytes).

    The directories of daemons that are gone (killed before they could remove theirs) are
    removed first; only their sockets can be in them.
    """
    base = root or Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    base.mkdir(parents=True, exist_ok=True)
    for left in base.glob("openrld-*-*"):
        _remove_if_orphaned(left)
    directory = base / f"openrld-{os.getpid()}-{secrets.token_hex(4)}"
    directory.mkdir(mode=0o700)
    return directory


def _remove_if_orphaned(directory: Path) -> None:
    """Remove a socket directory whose daemon is gone; anything else is left alone."""
    _, pid, _ = directory.name.split("-", 2)
    if not pid.isdigit() or not directory.is_dir() or directory.is_symlink() or directory.stat().st_uid != os.getuid():
        return
    try:
        os.kill(int(pid), 0)
        return  # that daemon (or whatever has its pid now) lives
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    try:
        for entry in directory.iterdir():
            if not entry.is_socket():
                return  # not one of ours after all
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()
    except OSError:
        pass  # another daemon starting at the same time removed it first


def start_worker(
    launcher: Launcher, spec: WorkerSpec, directory: Path, *,
    timeouts: WorkerTimeouts = WorkerTimeouts(), limits: Limits = Limits(),
) -> tuple[WorkerConnection, Ready]:
    """Launch `spec`'s worker and bring it to Ready.

    Raises:
        EngineLost: it ended, fell silent or broke the protocol before it was ready.
        OpenrldError: its build failed (the worker's error, by class).
    """
    token = secrets.token_urlsafe(32)
    path = directory / f"w-{secrets.token_hex(6)}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o660)
        listener.listen(1)
        worker = launcher.launch(spec, str(path), {"OPENRLD_WORKER_TOKEN": token, "OPENRLD_WORKER_ROLE": spec.role})
        try:
            sock = _accept(listener, worker, spec.name, timeouts.hello_s)
        except BaseException:
            worker.stop(0.0)
            raise
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    frames = FrameSocket(sock, limits)
    try:
        ready = _handshake(frames, spec, worker, token, timeouts)
    except BaseException as error:
        worker.stop(0.0)
        frames.close()
        if isinstance(error, (ProtocolError, TimeoutError, EOFError, OSError)):
            raise _lost_before_ready(spec.name, worker, error) from error
        raise
    logger.info("worker ready name=%s at=%s", spec.name, worker.describe())
    return WorkerConnection(frames, worker, name=spec.name, role=spec.role, timeouts=timeouts), ready


def _accept(listener: socket.socket, worker: LaunchedWorker, name: str, hello_s: float) -> socket.socket:
    deadline = time.monotonic() + hello_s
    listener.settimeout(0.2)
    while True:
        try:
            sock, _ = listener.accept()
            sock.settimeout(None)
            return sock
        except TimeoutError:
            pass
        status = worker.poll()
        if status is not None:
            raise EngineLost(f"{name} exited (status {status}) before it connected; see the daemon's log")
        if time.monotonic() > deadline:
            raise EngineLost(f"{name} did not connect within {hello_s:.0f} s; it was stopped")


def _handshake(frames: FrameSocket, spec: WorkerSpec, worker: LaunchedWorker, token: str, timeouts: WorkerTimeouts) -> Ready:
    hello, _ = frames.receive(timeout=timeouts.hello_s)
    if not isinstance(hello, Hello):
        raise ProtocolError(f"a {type(hello).__name__} message where its hello was due")
    if not hmac.compare_digest(hello.token.encode(), token.encode()):
        raise ProtocolError("its hello carries another token")
    if hello.version != PROTOCOL_VERSION:
        raise ServerError(
            f"{spec.name} speaks worker protocol version {hello.version}, and this daemon speaks "
            f"{PROTOCOL_VERSION}: rebuild the image against this openrld"
        )
    if hello.role != spec.role:
        raise ProtocolError(f"it says it is a {hello.role}, and it was started as a {spec.role}")
    shared = "shared_memory" in hello.capabilities
    frames.shared_memory = shared
    frames.send(msgspec.structs.replace(spec.start, device=worker.device, shared_memory=shared, heartbeat_s=timeouts.heartbeat_s))
    while True:
        message, _ = frames.receive(timeout=timeouts.deadline_s)
        match message:
            case Heartbeat():
                continue
            case Ready():
                return message
            case Failure(kind=kind, message=text, key=key, trace=trace):
                if trace:
                    logger.error("worker %s failed to build:\n%s", spec.name, trace)
                error = values.error_from(kind, text, key)
                raise error if not isinstance(error, (values.WorkerFault, ValueError, KeyError)) else ServerError(text)
            case _:
                raise ProtocolError(f"a {type(message).__name__} message where Ready was due")


def _lost_before_ready(name: str, worker: LaunchedWorker, error: BaseException) -> EngineLost:
    if isinstance(error, TimeoutError):
        why = "fell silent before it was ready"
    elif isinstance(error, ProtocolError):
        why = f"broke the worker protocol before it was ready ({error})"
    else:
        why = f"ended before it was ready (exit status {worker.poll()})"
    return EngineLost(f"{name} {why}")
