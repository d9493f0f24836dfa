"""One persistent thread per engine, fed from a queue: the engine goes from one call to the next
without waiting for the event loop.

`trio.to_thread.run_sync` hands a call to a thread and its outcome back to the event
loop, and the actor then settles that call's futures and picks the next before the
engine sees it. On a busy node that left a trainer idle 4-6 ms a step (README, "the
trainer process also waits 4-6 ms a step between its calls"). Here the actor queues the
next call while the current one runs (vLLM's engine core loop works the same way: a
busy loop over an input queue), and the thread takes it the moment the current one
returns; outcomes come back to the event loop through the trio token, in order.

Every engine call of the actor goes through its one thread, so the engine, which is not
thread-safe, is only ever touched from that thread, and a call queued before another
runs before it. The caller holds the device's limiter around what it queues: the
thread itself knows nothing of turns.

On a CPU device the thread also ends once its queue has stayed empty for `IDLE_RELEASE_S`,
and the next call starts another (`release_when_idle`). Torch's CPU thread pool (libgomp)
belongs to the thread that opens a parallel region, and lives until that thread ends.
libgomp shortens every pool's spin-wait to about 10 us (1,000 spins, against the
10,000 openrld/__init__.py sets) while the process holds more pool threads than the
machine has cores, and the trainer's and the sampler's engine threads each kept a pool
although the device's turns let only one compute at a time. The trainer's threads then
slept and were woken at most of its parallel regions: SmolLM2's bare 8 x 128 SFT step
under openrld's wait policy made ~130 voluntary context switches with one pool and
~4,000-4,500 with a second, idle one on another thread (5.58/5.83 against 5.99/6.06 s,
two alternating pairs). A new thread and pool cost about 0.1 ms, once per burst.

Written by hand because neither trio nor the standard library has it: trio's thread
cache starts each call afresh from the event loop, and `concurrent.futures` reports
back through a thread-safe future that the event loop would have to poll.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

_T = TypeVar("_T")


class Pending(Generic[_T]):
    """A call queued on an `EngineThread`; its outcome once the thread has run it."""

    def __init__(self, on_done: Callable[[], None] | None) -> None:
        self._done = trio.Event()
        self._outcome: outcome.Outcome | None = None
        self._on_done = on_done

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def _set(self, result: outcome.Outcome) -> None:  # on the event loop
        self._outcome = result
        self._done.set()
        if self._on_done is not None:
            self._on_done()

    async def wait(self) -> _T:
        """The call's value, or its exception raised here. Not cancellable: the call runs to its
        end regardless, and the engine must not be touched again until it has."""
        with trio.CancelScope(shield=True):
            await self._done.wait()
        assert self._outcome is not None
        return self._outcome.unwrap()


# How long an engine thread on a CPU device waits for a call before it ends (the module's docstring):
# past the gaps between the calls of one burst (a decode step queues the next before it returns),
# short against the other engine's turn that follows (a training step takes ~0.1-10 s).
IDLE_RELEASE_S = 0.05


def on_cpu(device: str) -> bool:
    """Whether a device label ("cpu", "cpu:1", "cuda:0"; "" for a worker without a lease) names a
    CPU device: only there does an idle engine thread end (a CUDA engine keeps its thread's
    current device and handles)."""
    return device.partition(":")[0] == "cpu"


class EngineThread:
    """A daemon thread that runs the calls queued on it one at a time, in order; with
    `release_when_idle`, a new thread after each idle spell, never two at once."""

    def __init__(self, name: str, *, release_when_idle: bool = False) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Pending[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._token = trio.lowlevel.current_trio_token()
        self._name = f"engine {name}"
        self._idle_s = IDLE_RELEASE_S if release_when_idle else None
        self._lock = threading.Lock()  # orders a submit against an idle thread's end
        self._running = False
        self._start()

    def submit(self, fn: Callable[..., _T], *args: Any, on_done: Callable[[], None] | None = None) -> Pending[_T]:
        """Queue `fn(*args)` behind the calls already queued; `on_done` runs on the event loop when it ends."""
        pending: Pending[_T] = Pending(on_done)
        with self._lock:
            self._calls.put((fn, args, pending))
            if not self._running:  # the last thread ended idle
                self._start()
        return pending

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await self.submit(fn, *args).wait()

    def stop(self) -> None:
        """The thread ends once the calls already queued have run."""
        self._calls.put(None)

    def _start(self) -> None:
        self._running = True
        threading.Thread(target=self._loop, name=self._name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                item = self._calls.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._calls.empty():  # else a submit came between: take it
                        self._running = False
                        return
                continue
            if item is None:
                return
            fn, args, pending = item
            result = outcome.capture(fn, *args)
            try:
                self._token.run_sync_soon(pending._set, result)
            except trio.RunFinishedError:  # the event loop is gone: nobody waits for anything
                return
