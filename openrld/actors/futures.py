"""The future table: every asynchronous request's result, until the client reads it.

Submissions (forward_backward, optim_step, saves, loads, asample) get a request
id at once; the actor that does the work resolves it here with `Completed` or
`Failed`, and `retrieve_future` long-polls it with `wait`. Results stay for
`keep_s` after completion, so a client that retries a poll still finds them.

The table is plain trio state, touched only from the event loop. It logs every
request in the store too: its start at once, so that a daemon restarted after a
crash answers a future of the previous process (whose result lived only in its
memory) with a clear `Gone`, on which the SDK resubmits it; its finish in
batches, one transaction every LOG_FLUSH_S (`run_log`), for the session trace
and the pending-request gauge, so that no result waits for a database write.

An `observer` sees every outcome as it is resolved, with the request's model
(or sampling session) id and kind: the run history (actors/run_history.py)
takes training metrics and sampling counts there. It runs on the event loop
and must not block.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol

import msgspec
import trio

from openrld.errors import Gone, NotFound, ServiceUnavailable
from openrld.store import RequestFinish, utc_now

logger = logging.getLogger(__name__)

LOG_FLUSH_S = 0.25


class Completed(msgspec.Struct, frozen=True):
    value: object  # a result struct; api/ chooses protobuf or JSON by its type


class Failed(msgspec.Struct, frozen=True):
    detail: str
    category: str  # "user" or "server"


Outcome = Completed | Failed
Observer = Callable[[str, str, Outcome], None]  # (model or sampler id, kind, outcome)


class RequestLog(Protocol):
    def record(self, request_id: str, model_id: str, kind: str) -> None: ...
    def finish(self, finished: Sequence[RequestFinish]) -> None: ...
    def state(self, request_id: str) -> str | None: ...


class _Entry:
    __slots__ = ("request_id", "model_id", "kind", "owner", "done", "outcome", "done_at")

    def __init__(self, request_id: str, model_id: str, kind: str, owner: str) -> None:
        self.request_id = request_id
        self.model_id = model_id
        self.kind = kind
        self.owner = owner
        self.done = trio.Event()
        self.outcome: Outcome | None = None
        self.done_at = 0.0


class FutureStatistics(msgspec.Struct, frozen=True):
    pending: int
    completed: int
    failed: int
    held: int


class FutureTable:
    """Request id -> outcome, with long-polling waiters."""

    def __init__(
        self, log: RequestLog, *, keep_s: float = 600.0, max_held: int = 100_000,
        now: Callable[[], datetime] = utc_now, observer: Observer | None = None,
    ) -> None:
        self._log = log
        self._observer = observer
        self._now = now
        self._finished: list[RequestFinish] = []  # not yet in the log
        self._keep_s = keep_s
        self._max_held = max_held
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._completed = 0
        self._failed = 0
        self._closing = False
        # Pending requests whose queue can say how it is doing (TryAgainResponse.queue_state).
        self._queue_probes: dict[str, Callable[[], str]] = {}

    def close(self) -> None:
        """Shutting down: wake every waiter, which then answers 503 instead of holding its poll."""
        self._closing = True
        for entry in self._entries.values():
            if entry.outcome is None:
                entry.done.set()

    def create(self, request_id: str, *, model_id: str, kind: str, owner: str) -> None:
        self._prune()
        self._entries[request_id] = _Entry(request_id, model_id, kind, owner)
        self._log.record(request_id, model_id, kind)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None or entry.outcome is not None:
            return  # already resolved (a cancel raced the result), or pruned
        entry.outcome = outcome
        entry.done_at = trio.current_time()
        self._finished.append(RequestFinish(request_id, self._now()))
        self._queue_probes.pop(request_id, None)
        entry.done.set()
        if self._observer is not None:
            self._observer(entry.model_id, entry.kind, outcome)
        if isinstance(outcome, Failed):
            self._failed += 1
        else:
            self._completed += 1

    def fail(self, request_id: str, error: Exception, category: str = "server") -> None:
        detail = getattr(error, "detail", None) or f"{type(error).__name__}: {error}"
        self.resolve(request_id, Failed(detail=detail, category=getattr(error, "category", category)))

    async def run_log(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Log the finished requests every LOG_FLUSH_S until cancelled, then once more."""
        task_status.started()
        try:
            while True:
                await trio.sleep(LOG_FLUSH_S)
                self._write_log()
        finally:
            self._write_log()

    def _write_log(self) -> None:
        if not self._finished:
            return
        finished, self._finished = self._finished, []
        try:
            self._log.finish(finished)
        except Exception:  # the log is bookkeeping: a failed write must not stop the futures
            logger.exception("request log write failed; %d finishes not logged", len(finished))

    def owner_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return entry.owner if entry else None

    def watch_queue(self, request_id: str, probe: Callable[[], str]) -> None:
        """Let `queue_state` ask the queue that holds this pending request how it is doing."""
        if request_id in self._entries:
            self._queue_probes[request_id] = probe

    def queue_state(self, request_id: str) -> str:
        """The SDK's queue_state for a pending request: "active" unless its queue says otherwise."""
        probe = self._queue_probes.get(request_id)
        return probe() if probe is not None else "active"

    def kind_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return entry.kind if entry else None

    async def wait(self, request_id: str, *, owner: str, hold_s: float) -> Outcome | None:
        """The outcome, or None if it is still pending after `hold_s` (the client polls again).

        Raises:
            NotFound: no such request for this owner.
            Gone: the request was pending when an earlier daemon process died.
        """
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            if entry is None and self._log.state(request_id) == "lost":
                raise Gone(f"request {request_id} was lost when the daemon restarted; submit it again")
            raise NotFound(f"no request {request_id!r}")
        with trio.move_on_after(hold_s):
            await entry.done.wait()
        if entry.outcome is None and self._closing:
            raise ServiceUnavailable("the daemon is shutting down; poll again after it restarts")
        return entry.outcome

    def statistics(self) -> FutureStatistics:
        pending = sum(1 for e in self._entries.values() if e.outcome is None)
        return FutureStatistics(
            pending=pending, completed=self._completed, failed=self._failed, held=len(self._entries)
        )

    def _prune(self) -> None:
        """Drop results read long ago; the oldest first, never a pending one."""
        now = trio.current_time()
        while self._entries:
            request_id, entry = next(iter(self._entries.items()))
            expired = entry.outcome is not None and now - entry.done_at > self._keep_s
            if not expired and len(self._entries) < self._max_held:
                break
            if entry.outcome is None:
                self._entries.move_to_end(request_id)
                break
            del self._entries[request_id]
