"""The merge of the members' list pages: times compared as times, duplicates kept once, errors passed on."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.cluster.list_fanout import PageQuery, item_time, merge_pages, page_query


def page(runs: list[dict], total: int | None = None) -> Reply:
    return json_reply({"training_runs": runs, "cursor": {"offset": 0, "limit": 20, "total_count": total or len(runs)}})


def run(run_id: str, time: str) -> dict:
    return {"training_run_id": run_id, "last_request_time": time}


def merged(*pages: Reply, limit: int = 20, offset: int = 0) -> dict:
    answer = merge_pages(pages, "training_runs", "last_request_time", PageQuery(limit, offset, b""))
    assert answer.status == 200
    return msgspec.json.decode(answer.body)


def test_two_times_in_the_same_second_are_ordered_by_their_fraction_not_their_spelling():
    # msgspec leaves the fraction out when microseconds are 0: as strings, "...:05Z" > "...:05.5Z" ('Z' > '.').
    newer, older = run("newer", "2026-12-02T05:00:05.500000Z"), run("older", "2026-12-02T05:00:05Z")
    assert [r["training_run_id"] for r in merged(page([older]), page([newer]))["training_runs"]] == ["newer", "older"]


def test_z_and_an_offset_are_the_same_instant_and_an_offset_is_honoured():
    # 06:00+02:00 is 04:00Z: older than 05:00Z although it reads later.
    runs = [run("b", "2026-12-02T06:00:00+02:00"), run("a", "2026-12-02T05:00:00Z"), run("c", "2026-12-02T04:30:00+00:00")]
    assert [r["training_run_id"] for r in merged(page(runs))["training_runs"]] == ["a", "c", "b"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-12-02T05:00:05Z", datetime(2026, 12, 2, 5, 0, 5, tzinfo=UTC)),
        ("2026-12-02T05:00:05.000250+00:00", datetime(2026, 12, 2, 5, 0, 5, 250, tzinfo=UTC)),
        ("2026-12-02T05:00:05", datetime(2026, 12, 2, 5, 0, 5, tzinfo=UTC)),  # naive: taken as UTC
        ("yesterday", datetime.min.replace(tzinfo=UTC)),
        (None, datetime.min.replace(tzinfo=UTC)),
    ],
    ids=["z", "offset-with-fraction", "naive", "unreadable", "missing"],
)
def test_item_time(value, expected):
    assert item_time(value) == expected


def test_an_item_listed_by_two_members_is_kept_once_and_totals_add_up():
    same = run("r-1", "2026-12-02T05:00:00Z")
    body = merged(page([same], total=3), page([same, run("r-2", "2026-12-02T04:00:00Z")], total=4), limit=1, offset=1)
    assert body == {"training_runs": [run("r-2", "2026-12-02T04:00:00Z")], "cursor": {"offset": 1, "limit": 1, "total_count": 7}}


def test_a_members_4xx_is_the_answer_and_a_5xx_is_left_out():
    refused = detail_reply(401, "bad key")
    assert merge_pages([page([]), refused], "training_runs", "last_request_time", PageQuery(20, 0, b"")) == refused
    assert merged(page([run("r-1", "2026-12-02T05:00:00Z")]), detail_reply(503, "down"))["cursor"]["total_count"] == 1


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (b"", PageQuery(20, 0, b"limit=20&offset=0")),
        (b"limit=5&offset=10&x=y", PageQuery(5, 10, b"limit=15&offset=0&x=y")),
    ],
    ids=["defaults", "page-two"],
)
def test_each_member_is_asked_for_everything_up_to_the_pages_end(query, expected):
    assert page_query(query, 20) == expected


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        (b"limit=x", "limit and offset must be integers"),
        (b"limit=0", "limit must be >= 1 and offset >= 0, got limit=0 offset=0"),
    ],
    ids=["not-an-integer", "zero-limit"],
)
def test_a_bad_page_is_400_saying_why(query, detail):
    assert page_query(query, 20) == detail_reply(400, detail)
