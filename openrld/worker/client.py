"""The daemon's side of a worker: an engine whose calls go over the worker protocol.

`RemoteTrainer` and `RemoteSampler` implement the engine interfaces of
`openrld.engine_types`, so an actor drives a worker exactly as it drives an
engine in its own process: blocking calls from its worker thread, one at a time.
Their calls are made from the Protocols (`methods.py`), but for what the daemon's
side does itself: track parking, and hold a sampler's adds and cancels for its next step.

Faults stay with the worker's jobs. A worker that exits, falls silent past its
heartbeat deadline during a call, or breaks the protocol (a malformed,
oversized or unexpected frame, a value that does not fit its type) is stopped
and reaped, and the call raises `EngineLost`, which tells the client to resume
from a saved state; the actor then builds another engine. An error an engine
means (a bad request) is raised here as the same class, and the worker serves
on. Nothing here unpickles, imports torch or imports trio.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from openrld.batches import SampleJob, SyncStats
from openrld.engine_types import Finished, ParkReport, ResumeReport
from openrld.errors import BadRequest, EngineLost, OpenrldError, ServerError
from openrld.worker import values
from openrld.worker.frames import FrameSocket, ProtocolError
from openrld.worker.methods import METHODS, SAMPLER_METHODS, TRAINER_METHODS, AddRequest, Method, StepCall
from openrld.worker.protocol import Bye, Call, Cancel, Failure, Heartbeat, Result

logger = logging.getLogger(__name__)
_GONE = object()


class WorkerTimeouts(msgspec.Struct, frozen=True):
    hello_s: float = 120.0  # from launch to the worker's hello (an image may be pulled, an interpreter start)
    heartbeat_s: float = 2.0  # the worker sends a heartbeat this often while it builds or runs a call
    deadline_s: float = 60.0  # silence this long while a call runs: the worker hangs, and is stopped
    stop_s: float = 10.0  # after Bye, the call in hand may finish; then the worker is killed


class WorkerConnection:
    """One worker's connection and process (or container, or Pod): calls, one at a time."""

    def __init__(self, frames: FrameSocket, worker: Any, *, name: str, role: str, timeouts: WorkerTimeouts) -> None:
        self.frames = frames
        self.worker = worker  # a launchers.LaunchedWorker
        self.name = name
        self.methods = METHODS[role]
        self.timeouts = timeouts
        self._lock = threading.Lock()
        self._next_id = 1
        self._in_flight: int | None = None  # the id of the call a thread waits on
        self._lost: EngineLost | None = None
        self._closed = False

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._closed:
                raise EngineLost(f"{self.name} was closed")
            call_id, self._next_id = self._next_id, self._next_id + 1
            try:
                encoding = values.Encoding()
                encoded = encoding.encode(args)
            except (NotImplementedError, TypeError) as error:
                raise ServerError(f"cannot send {method} to {self.name}: {error}") from error
            try:
                self._in_flight = call_id
                self.frames.send(Call(call_id, method, encoded), encoding.buffers)
                return self._await(call_id, method)
            except (ProtocolError, TimeoutError, EOFError, OSError) as error:
                raise self._lose(error) from error
            finally:
                self._in_flight = None

    def cancel(self) -> bool:
        """Tell the worker that the call in flight need not finish; from any thread.

        A call it has not started is answered Gone; an engine in a long call may stop
        early (server.cancelled()). Returns whether there was a call to cancel.
        """
        call_id = self._in_flight
        if call_id is None or self._lost is not None or self._closed:
            return False
        try:
            self.frames.send(Cancel(call_id))
        except OSError:
            return False
        return True

    def _await(self, call_id: int, method: str) -> Any:
        while True:
            message, buffers = self.frames.receive(timeout=self.timeouts.deadline_s)
            match message:
                case Heartbeat():
                    continue
                case Result(id=answered) | Failure(id=answered) if answered != call_id:
                    continue  # the late answer of a cancelled call
                case Result(value=raw):
                    return values.decode(raw, self.methods[method].result, buffers)
                case Failure(kind=kind, message=text, key=key, trace=trace):
                    if trace:  # a worker sends one for a fault, never for an error its engine means
                        logger.error("worker %s: %s failed in the worker:\n%s", self.name, method, trace)
                    raise values.error_from(kind, text, key)
                case _:
                    raise ProtocolError(f"a {type(message).__name__} message where a result was due")

    def _lose(self, error: BaseException) -> EngineLost:
        """Stop the worker, and say why it is lost."""
        if isinstance(error, TimeoutError):
            why = f"sent nothing for {self.timeouts.deadline_s:.0f} s during a call (its heartbeat deadline)"
        elif isinstance(error, ProtocolError):
            why = f"broke the worker protocol ({error})"
        else:
            why = "died"
        self.worker.stop(0.0 if not isinstance(error, (EOFError, OSError)) else self.timeouts.stop_s)
        self.frames.close()
        status = self.worker.poll()
        if status is not None and why == "died":
            why = f"died (exit status {status})"
        logger.error("worker %s lost: %s", self.name, why)
        self._lost = EngineLost(
            f"{self.name} {why}; the weights and optimizer state it held are gone: resume from a saved state "
            "(load_state, or load_state_with_optimizer)"
        )
        return self._lost

    def close(self) -> None:
        """Bye: the worker finishes the call in hand and exits; past `stop_s` it is killed."""
        self.cancel()  # a call still in flight (its caller was abandoned) need not finish
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._lost is None:
                with contextlib.suppress(OSError):
                    self.frames.send(Bye())
            self.worker.stop(self.timeouts.stop_s)
            self.frames.close()


class _RemoteEngine:
    """What a worker's trainer and sampler answer alike: turns on the device, sync statistics, the end."""

    def __init__(self, connection: WorkerConnection) -> None:
        self.connection = connection
        self._last_sync: SyncStats | None = None
        self._parked = False

    def park(self) -> ParkReport:
        report = self.connection.call("park")
        self._parked = True
        return report

    def resume(self) -> ResumeReport:
        report = self.connection.call("resume")
        self._parked = False
        return report

    @property
    def is_parked(self) -> bool:
        return self._parked

    @property
    def last_sync(self) -> SyncStats | None:
        return self._last_sync

    def close(self) -> None:
        self.connection.close()


class RemoteTrainer(_RemoteEngine):
    """A `TrainerEngine` in a worker: each of its calls is `methods.TRAINER_METHODS`' (`_calls`)."""


class RemoteSampler(_RemoteEngine):
    """A `SamplerEngine` in a worker.

    `add`, `cancel` and `has_work` are answered here, without the worker: the actor
    calls them on the event loop. Adds and cancels wait for the next `step`, which
    carries them; a request the worker refuses comes back failed from that step
    (`Finished.error`), as one that the engine in this process refuses fails at `add`.
    """

    def __init__(self, connection: WorkerConnection) -> None:
        super().__init__(connection)
        self._adds: list[AddRequest] = []
        self._cancels: list[str] = []
        self._live: dict[str, str | None] = {}  # request id -> its version

    # load_version, load_checkpoint, drop_version: methods.SAMPLER_METHODS' (`_calls`).

    def versions_in_use(self) -> set[str]:
        return {version for version in self._live.values() if version is not None}

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        if request_id in self._live:
            raise ValueError(f"request {request_id} is already in this sampler")
        self._adds.append(AddRequest(request_id, version, job))
        self._live[request_id] = version

    def cancel(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        del self._live[request_id]
        before = len(self._adds)
        self._adds = [add for add in self._adds if add.request_id != request_id]
        if len(self._adds) == before:  # already in the worker's engine
            self._cancels.append(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> list[Finished]:
        adds, cancels, self._adds, self._cancels = self._adds, self._cancels, [], []
        reply = self.connection.call("step", StepCall(adds, cancels))
        finished = []
        for done in reply.finished:
            if self._live.pop(done.request_id, _GONE) is not _GONE:  # else cancelled meanwhile
                finished.append(Finished(request_id=done.request_id, result=done.result))
        for failed in reply.failed:
            if self._live.pop(failed.request_id, _GONE) is not _GONE:
                error = values.error_from(failed.kind, failed.message)
                if not isinstance(error, OpenrldError):  # a refused request, as an engine here refuses it at add
                    error = BadRequest(str(error))
                finished.append(Finished(request_id=failed.request_id, result=None, error=error))
        return finished


def _calls(cls: type, methods: dict[str, Method]) -> None:
    """Give `cls` each call of `methods` that it does not write itself, as the Protocol declares it."""
    for name, method in methods.items():
        if not hasattr(cls, name):
            setattr(cls, name, _remote_call(cls, method))


def _remote_call(cls: type, method: Method) -> Callable[..., Any]:
    name = method.name

    def call(self: _RemoteEngine, *args: Any, **kwargs: Any) -> Any:
        value, last_sync = method.returned(self.connection.call(name, *method.send(args, kwargs)))
        if method.syncs:
            self._last_sync = last_sync
        return value

    call.__name__, call.__qualname__ = name, f"{cls.__name__}.{name}"
    call.__doc__ = method.doc
    call.__signature__ = method.signature  # type: ignore[attr-defined]
    return call


_calls(RemoteTrainer, TRAINER_METHODS)
_calls(RemoteSampler, SAMPLER_METHODS)
