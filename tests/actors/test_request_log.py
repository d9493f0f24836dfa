"""The future table logs each request's start at once and its finish in batches (futures.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import trio
import trio.testing

from openrld.actors.futures import LOG_FLUSH_S, Completed, FutureTable
from openrld.store import RequestFinish

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class RecordingLog:
    """What the store would be told, in order."""

    def __init__(self, fail_finishes: int = 0) -> None:
        self.calls: list[tuple[str, object]] = []
        self._fail_finishes = fail_finishes

    def record(self, request_id: str, model_id: str, kind: str) -> None:
        self.calls.append(("start", request_id))

    def finish(self, finished: Sequence[RequestFinish]) -> None:
        if self._fail_finishes:
            self._fail_finishes -= 1
            raise OSError("disk full")
        self.calls.append(("finish", [(r.request_id, r.finished) for r in finished]))

    def state(self, request_id: str) -> str | None:
        return None


def table(log: RecordingLog) -> FutureTable:
    return FutureTable(log, now=lambda: T0)


async def test_a_start_is_logged_before_create_returns() -> None:
    log = RecordingLog()
    table(log).create("r-1", model_id="m", kind="sample", owner="u")
    assert log.calls == [("start", "r-1")]


async def test_finishes_are_logged_together_within_one_flush(autojump_clock: trio.testing.MockClock) -> None:
    log = RecordingLog()
    futures = table(log)
    async with trio.open_nursery() as nursery:
        await nursery.start(futures.run_log)
        for request_id in ("r-1", "r-2"):
            futures.create(request_id, model_id="m", kind="sample", owner="u")
            futures.resolve(request_id, Completed(value=None))
        assert log.calls == [("start", "r-1"), ("start", "r-2")]
        await trio.sleep(LOG_FLUSH_S)
        nursery.cancel_scope.cancel()
    assert log.calls[2:] == [("finish", [("r-1", T0), ("r-2", T0)])]


async def test_a_cancelled_log_task_writes_what_it_holds() -> None:
    log = RecordingLog()
    futures = table(log)
    async with trio.open_nursery() as nursery:
        await nursery.start(futures.run_log)
        futures.create("r-1", model_id="m", kind="sample", owner="u")
        futures.resolve("r-1", Completed(value=None))
        nursery.cancel_scope.cancel()
    assert log.calls == [("start", "r-1"), ("finish", [("r-1", T0)])]


async def test_a_failed_log_write_leaves_the_results_readable(autojump_clock: trio.testing.MockClock) -> None:
    log = RecordingLog(fail_finishes=1)
    futures = table(log)
    async with trio.open_nursery() as nursery:
        await nursery.start(futures.run_log)
        futures.create("r-1", model_id="m", kind="sample", owner="u")
        futures.resolve("r-1", Completed(value=7))
        await trio.sleep(LOG_FLUSH_S * 1.5)  # the write fails ...
        futures.create("r-2", model_id="m", kind="sample", owner="u")
        futures.resolve("r-2", Completed(value=8))
        await trio.sleep(LOG_FLUSH_S)  # ... and the next one carries on
        nursery.cancel_scope.cancel()
    assert await futures.wait("r-1", owner="u", hold_s=0) == Completed(value=7)
    assert log.calls[-1] == ("finish", [("r-2", T0)])
