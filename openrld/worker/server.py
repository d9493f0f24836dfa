"""The worker's side of the protocol: serve one engine to the daemon that started it.

A worker program (the built-in one, `python -m openrld.worker`, or a custom
image's) calls `serve` with a function that builds its engine from the
daemon's `Start`. `serve` connects to the socket the daemon named, says hello,
builds, then answers calls one at a time on the main thread, until the daemon
says Bye or closes the connection; then it exits. A reader thread takes the
daemon's messages as they come, so that a Cancel or the end of the connection is
seen during a call: a worker whose daemon died exits at once, mid-call, and
never outlives it. A heartbeat thread tells the daemon the worker lives while a
call or the build runs.

Nothing here imports trio or the daemon; torch only where a built-in engine or a
tensor needs it.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, cast

from openrld.errors import OpenrldError
from openrld.worker import values
from openrld.worker.frames import FrameSocket, Limits, ProtocolError
from openrld.worker.methods import METHODS, Done, StepCall, StepReply
from openrld.worker.protocol import (
    PROTOCOL_VERSION,
    Bye,
    Call,
    Cancel,
    Failure,
    Heartbeat,
    Hello,
    Ready,
    Result,
    Role,
    Start,
)

logger = logging.getLogger("openrld.worker")

SOCKET_ENV = "OPENRLD_WORKER_SOCKET"
TOKEN_ENV = "OPENRLD_WORKER_TOKEN"
ROLE_ENV = "OPENRLD_WORKER_ROLE"
IGNORE_SIGNALS_ENV = "OPENRLD_WORKER_IGNORE_SIGNALS"
WORLD_SIZE_ENV = "WORLD_SIZE"  # set by torchrun for each rank of a group
RANKS_ENV = "OPENRLD_WORKER_RANKS"  # set by the torchrun launcher alone

BuildEngine = Callable[[Start], Any]

_session: _Session | None = None  # the one this process serves


def cancelled() -> bool:
    """Whether the daemon cancelled the call this worker runs now.

    An engine in a long call may ask between pieces of its work, and stop early by
    raising `openrld.errors.Gone`; one that never asks finishes the call.
    """
    session = _session
    return session is not None and session.call_id in session.cancelled


def serve(
    build: BuildEngine, *, role: Role | None = None, socket_path: str | None = None, token: str | None = None,
    engine: str = "custom", info: Callable[[Any], dict] | None = None,
) -> None:
    """Serve the engine `build` makes to the daemon, until it says Bye; then exit the process.

    Arguments not given come from the environment the launcher set: OPENRLD_WORKER_SOCKET,
    OPENRLD_WORKER_TOKEN and OPENRLD_WORKER_ROLE. `info(engine)` adds facts to Ready.
    Started by the torchrun launcher (OPENRLD_WORKER_RANKS=1), this process is one rank of a
    group, a group of one included (its engine may rely on the process group): see `ranks.py`.
    """
    if os.environ.get(RANKS_ENV) == "1" and WORLD_SIZE_ENV in os.environ:
        from openrld.worker import ranks

        ranks.serve(build, role=role, socket_path=socket_path, token=token, engine=engine, info=info)  # exits
    role = cast(Role, role or os.environ[ROLE_ENV])
    socket_path = socket_path or os.environ[SOCKET_ENV]
    token = token or os.environ[TOKEN_ENV]
    if os.environ.get(IGNORE_SIGNALS_ENV) == "1":
        # A Ctrl-C or systemd's stop reaches the daemon's whole process group; the daemon's
        # drain lets the call in hand finish, then says Bye.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    frames = FrameSocket(sock, Limits())
    frames.send(Hello(PROTOCOL_VERSION, token, role, os.getpid(), ["shared_memory"], engine))
    status = _Session(frames, role).run(build, info)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the engine's state goes with the process; tearing torch down would take seconds


class _Session:
    def __init__(self, frames: FrameSocket, role: Role) -> None:
        self.frames = frames
        self.role = role
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.busy = threading.Event()
        self.cancelled: set[int] = set()
        self.call_id = 0  # the call running now; 0: none
        self.heartbeat_s = 2.0

    def run(self, build: BuildEngine, info: Callable[[Any], dict] | None) -> int:
        global _session
        _session = self
        try:
            message, _ = self.frames.receive(timeout=None)
        except (EOFError, OSError, ProtocolError):
            return 1
        if not isinstance(message, Start):
            return 1
        self.frames.shared_memory = message.shared_memory
        self.heartbeat_s = message.heartbeat_s
        threading.Thread(target=self._heartbeats, daemon=True, name="openrld-worker-heartbeat").start()
        threading.Thread(target=self._read, daemon=True, name="openrld-worker-reader").start()
        engine = self._build(build, message)
        if engine is None:
            return 1
        self.frames.send(Ready(info=info(engine) if info is not None else {}))
        answers = handlers(self.role, engine)
        while True:
            item = self.inbox.get()
            if not isinstance(item, tuple):  # Bye, or the daemon is gone
                _close(engine)
                return 0
            call, buffers = item
            if call.id in self.cancelled:
                self.cancelled.discard(call.id)
                self.frames.send(Failure(call.id, "Gone", f"call {call.id} was cancelled before it ran"))
                continue
            self._answer(answers, call, buffers)

    def _build(self, build: BuildEngine, start: Start) -> Any:
        self.busy.set()
        try:
            return build(start)
        except BaseException as error:
            kind, text, key = values.failure_fields(error)
            self.frames.send(Failure(0, kind, f"the worker could not build its engine: {text}", key, traceback.format_exc()))
            return None
        finally:
            self.busy.clear()

    def _answer(self, answers: dict[str, Callable[[tuple], Any]], call: Call, buffers: list[memoryview]) -> None:
        method, answer = METHODS[self.role].get(call.method), answers.get(call.method)
        if method is None or answer is None:
            self.frames.send(Failure(call.id, "fault", f"this worker has no method {call.method!r}"))
            return
        self.busy.set()
        self.call_id = call.id
        try:
            args = values.decode(call.args, method.args, buffers, torch_tensors=True)
            value = answer(args)
            encoding = values.Encoding()
            encoded = encoding.encode(value)
        except BaseException as error:  # the engine's error is the call's; the worker serves on
            kind, text, key = values.failure_fields(error)
            trace = "" if isinstance(error, OpenrldError) else traceback.format_exc()
            self.frames.send(Failure(call.id, kind, text, key, trace))
        else:
            self.frames.send(Result(call.id, encoded), encoding.buffers)
        finally:
            self.call_id = 0
            self.cancelled.discard(call.id)
            self.busy.clear()

    def _read(self) -> None:
        """The daemon's messages, as they come; its end of the connection ends this process."""
        while True:
            try:
                message, buffers = self.frames.receive(timeout=None)
            except (EOFError, OSError, ProtocolError):
                self._daemon_gone()
                return
            match message:
                case Call():
                    self.inbox.put((message, buffers))
                case Cancel(id=call_id):
                    self.cancelled.add(call_id)
                case Bye():
                    self.inbox.put(None)
                    return
                case _:
                    os._exit(1)

    def _daemon_gone(self) -> None:
        """The daemon is gone (or mad): nothing will read what this worker computes."""
        os._exit(0)

    def _heartbeats(self) -> None:
        while True:
            if self.busy.wait():
                try:
                    self.frames.send(Heartbeat(busy=True))
                except OSError:
                    return
            threading.Event().wait(self.heartbeat_s)


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            logger.exception("closing the engine failed")


def handlers(role: Role, engine: Any) -> dict[str, Callable[[tuple], Any]]:
    """What answers each call, by name: each takes the call's decoded wire arguments and
    returns its reply. The Protocol's calls on `engine` (`methods.Method.call`), and for a
    sampler the `step` that carries its adds and cancels."""
    answers: dict[str, Callable[[tuple], Any]] = {
        name: functools.partial(method.call, engine) for name, method in METHODS[role].items()
    }
    if role == "sampler":
        answers["step"] = lambda args: _sampler_step(engine, *args)
    return answers


def _sampler_step(engine: Any, call: StepCall) -> StepReply:
    for request_id in call.cancels:
        engine.cancel(request_id)
    failed = []
    for add in call.adds:
        try:
            engine.add(add.request_id, add.version, add.job)
        except (OpenrldError, KeyError, ValueError) as error:
            kind, text, _ = values.failure_fields(error)
            failed.append(values.RequestFailure(add.request_id, kind, text))
    finished = []
    for _ in range(call.steps):
        if not engine.has_work():
            break
        finished += [Done(done.request_id, done.result) for done in engine.step()]
    return StepReply(finished, failed, engine.has_work())
