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


class EngineThread:
    """A daemon thread that runs the calls queued on it one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Pending[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._loop, name=f"engine {name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., _T], *args: Any, on_done: Callable[[], None] | None = None) -> Pending[_T]:
        """Queue `fn(*args)` behind the calls already queued; `on_done` runs on the event loop when it ends."""
        pending: Pending[_T] = Pending(on_done)
        self._calls.put((fn, args, pending))
        return pending

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await self.submit(fn, *args).wait()

    def stop(self) -> None:
        """The thread ends once the calls already queued have run."""
        self._calls.put(None)

    def _loop(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, args, pending = item
            result = outcome.capture(fn, *args)
            try:
                self._token.run_sync_soon(pending._set, result)
            except trio.RunFinishedError:  # the event loop is gone: nobody waits for anything
                return
