"""The future table, driven directly as retrieve_future and the actors drive it: outcomes by
owner, long-poll holds, errors by category, restarts, shutdown, expiry, queue state, the log.

Pure trio under the autojump clock (pytest's `autojump_clock` fixture): a 30 s hold costs
nothing. The request log (the store's, in the daemon) is a stand-in that keeps what it is told.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import trio
import trio.testing

from openrld.actors.futures import LOG_FLUSH_S, Completed, Failed, FutureTable
from openrld.errors import BadRequest, Gone, NotFound, ServiceUnavailable
from openrld.store import RequestFinish

OWNER = "alice"
NOON = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


class KeptLog:
    """The request log: what was recorded and finished, and the ids a dead process left pending."""

    def __init__(self, lost: tuple[str, ...] = ()) -> None:
        self.recorded: list[tuple[str, str, str]] = []
        self.finished: list[list[RequestFinish]] = []
        self._lost = lost

    def record(self, request_id: str, model_id: str, kind: str) -> None:
        self.recorded.append((request_id, model_id, kind))

    def finish(self, finished: list[RequestFinish]) -> None:
        self.finished.append(list(finished))

    def state(self, request_id: str) -> str | None:
        return "lost" if request_id in self._lost else None


def table(log: KeptLog | None = None, **kwargs: object) -> FutureTable:
    return FutureTable(log if log is not None else KeptLog(), now=lambda: NOON, **kwargs)


def created(futures: FutureTable, *request_ids: str) -> FutureTable:
    for request_id in request_ids:
        futures.create(request_id, model_id="s-1:train:0", kind="forward_backward", owner=OWNER)
    return futures


# ---------------------------------------------------------------- outcomes and holds


async def test_a_resolved_future_answers_its_owner_with_its_outcome(autojump_clock):
    futures = created(table(), "r1")
    futures.resolve("r1", Completed({"loss:sum": 1.5}))
    assert await futures.wait("r1", owner=OWNER, hold_s=30) == Completed({"loss:sum": 1.5})


async def test_a_pending_future_answers_none_after_holding_the_poll_its_full_hold(autojump_clock):
    futures = created(table(), "r1")
    start = trio.current_time()
    assert await futures.wait("r1", owner=OWNER, hold_s=30) is None
    assert trio.current_time() - start == 30


async def test_a_held_poll_answers_as_soon_as_the_future_resolves(autojump_clock):
    futures = created(table(), "r1")
    answers = []

    async def poll() -> None:
        answers.append((await futures.wait("r1", owner=OWNER, hold_s=30), trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.sleep(2)
        futures.resolve("r1", Completed("done"))
    assert answers == [(Completed("done"), pytest.approx(2.0))]


async def test_another_owners_request_is_404_as_if_it_did_not_exist(autojump_clock):
    futures = created(table(), "r1")
    for request_id in ("r1", "r-missing"):
        with pytest.raises(NotFound) as caught:
            await futures.wait(request_id, owner="bob", hold_s=1)
        assert caught.value.detail == f"no request {request_id!r}"


async def test_a_request_pending_when_the_daemon_died_is_410_so_the_sdk_resubmits(autojump_clock):
    futures = table(KeptLog(lost=("r-old",)))
    with pytest.raises(Gone) as caught:
        await futures.wait("r-old", owner=OWNER, hold_s=1)
    assert caught.value.detail == "request r-old was lost when the daemon restarted; submit it again"


async def test_the_first_outcome_stays_when_a_cancel_races_the_result(autojump_clock):
    futures = created(table(), "r1")
    futures.resolve("r1", Completed("result"))
    futures.fail("r1", BadRequest("sample cancelled by the client (cancel_future)"))
    assert await futures.wait("r1", owner=OWNER, hold_s=1) == Completed("result")


@pytest.mark.parametrize(
    ("error", "failed"),
    [
        (BadRequest("target_tokens: expected 2, got 3"), Failed("target_tokens: expected 2, got 3", "user")),
        (Gone("model m has stopped"), Failed("model m has stopped", "user")),
        (ValueError("shape mismatch"), Failed("ValueError: shape mismatch", "server")),
    ],
    ids=["user-error", "gone", "unexpected"],
)
async def test_a_failure_keeps_its_errors_detail_and_category_and_an_unexpected_one_names_its_type(
    autojump_clock, error, failed
):
    futures = created(table(), "r1")
    futures.fail("r1", error)
    assert await futures.wait("r1", owner=OWNER, hold_s=1) == failed


async def test_shutting_down_ends_held_polls_with_503(autojump_clock):
    futures = created(table(), "r1")
    caught = []

    async def poll() -> None:
        with pytest.raises(ServiceUnavailable) as raised:
            await futures.wait("r1", owner=OWNER, hold_s=30)
        caught.append((raised.value.detail, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.sleep(1)
        futures.close()
    assert caught == [("the daemon is shutting down; poll again after it restarts", pytest.approx(1.0))]


# ---------------------------------------------------------------- expiry


async def test_a_result_is_forgotten_keep_s_after_it_settled(autojump_clock):
    futures = created(table(keep_s=10), "r1")
    futures.resolve("r1", Completed("result"))
    await trio.sleep(9)
    created(futures, "r2")  # each create prunes
    kept = await futures.wait("r1", owner=OWNER, hold_s=1)
    await trio.sleep(2)
    created(futures, "r3")
    with pytest.raises(NotFound):
        await futures.wait("r1", owner=OWNER, hold_s=1)
    assert kept == Completed("result")


async def test_past_max_held_the_oldest_settled_result_goes_and_a_pending_one_never_does(autojump_clock):
    futures = created(table(max_held=2), "pending", "settled")
    futures.resolve("settled", Completed("result"))
    created(futures, "r3")  # at the cap: the pending one is kept, so room is made past it
    created(futures, "r4")
    assert (futures.owner_of("pending"), futures.owner_of("settled")) == (OWNER, None)
    assert futures.statistics().pending == 3


# ---------------------------------------------------------------- queue state, statistics, log, observer


async def test_queue_state_is_what_the_requests_queue_says_until_it_settles(autojump_clock):
    futures = created(table(), "r1")
    futures.watch_queue("r1", lambda: "paused_capacity")
    before = futures.queue_state("r1")
    futures.resolve("r1", Completed("result"))
    assert (before, futures.queue_state("r1"), futures.queue_state("r-none")) == ("paused_capacity", "active", "active")


async def test_statistics_count_pending_completed_failed_and_held(autojump_clock):
    futures = created(table(), "r1", "r2", "r3")
    futures.resolve("r1", Completed("result"))
    futures.fail("r2", BadRequest("bad"))
    stats = futures.statistics()
    assert (stats.pending, stats.completed, stats.failed, stats.held) == (1, 1, 1, 3)


async def test_a_request_is_logged_at_creation_and_its_finish_at_the_next_flush(autojump_clock):
    log = KeptLog()
    futures = created(table(log), "r1")
    async with trio.open_nursery() as nursery:
        await nursery.start(futures.run_log)
        futures.resolve("r1", Completed("result"))
        logged_before_flush = list(log.finished)
        await trio.sleep(LOG_FLUSH_S)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert log.recorded == [("r1", "s-1:train:0", "forward_backward")]
    assert (logged_before_flush, log.finished) == ([], [[RequestFinish("r1", NOON)]])


async def test_the_observer_sees_each_outcome_once_with_its_model_and_kind(autojump_clock):
    seen = []
    futures = created(table(observer=lambda model_id, kind, outcome: seen.append((model_id, kind, outcome))), "r1")
    futures.resolve("r1", Completed("result"))
    futures.resolve("r1", Completed("again"))
    assert seen == [("s-1:train:0", "forward_backward", Completed("result"))]
