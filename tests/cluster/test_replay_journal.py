"""The replay journal (issue 41): what a relaying node keeps of the requests it sends to a job's home.

A request is kept from the moment it is sent until its result is read and an auto-save
covers its seq_id; what is kept for a dead home is replayed on the adopter in seq_id
order; a job whose uncovered requests had to be dropped is known to be incomplete.
"""

from __future__ import annotations

import msgspec

from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.cluster.body_ids import Call
from openrld.cluster.replay import (
    Journal,
    _is_final,
    _request_id_of,
    _unreachable,
    _with_answer_id,
    _with_request_id,
)

MODEL = "s-1:train:0"


def call(path: str = "/api/v1/forward_backward", body: bytes = b"x" * 100) -> Call:
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")]}
    return Call(scope, dict(scope["headers"]), body, {})


def kept_seq_ids(journal: Journal, target: str = "b") -> list[int]:
    return [k.seq_id for k in journal.pending(MODEL, target)]


def test_requests_are_kept_in_seq_id_order_and_found_by_their_request_id() -> None:
    journal = Journal()
    for seq in (3, 1, 2):
        journal.answered(journal.keep(MODEL, seq, call(), "b"), f"r-{seq}")
    assert kept_seq_ids(journal) == [1, 2, 3]
    found = journal.lookup("r-2")
    assert found is not None and found.seq_id == 2


def test_a_retried_seq_id_keeps_the_first_request() -> None:
    journal = Journal()
    first = journal.keep(MODEL, 1, call(body=b"first"), "b")
    assert journal.keep(MODEL, 1, call(body=b"retry"), "b") is first


def test_a_request_goes_once_it_is_read_and_covered_not_before() -> None:
    journal = Journal()
    one, two = journal.keep(MODEL, 1, call(), "b"), journal.keep(MODEL, 2, call(), "b")
    journal.answered(one, "r-1")
    journal.answered(two, "r-2")
    journal.read(one)
    assert kept_seq_ids(journal) == [1, 2]  # read, but no auto-save covers it yet: a replay needs it
    journal.cover(MODEL, 2)
    assert kept_seq_ids(journal) == [2]  # covered, but its result is unread: its client may still poll
    assert journal.lookup("r-1") is None
    journal.read(two)
    assert kept_seq_ids(journal) == [] and journal.bytes == 0


def test_a_replayed_request_is_found_by_both_its_ids() -> None:
    journal = Journal()
    kept = journal.keep(MODEL, 5, call(), "b")
    journal.answered(kept, "r-b")
    journal.moved(kept, "c", "r-c")
    assert journal.lookup("r-b") is kept and journal.lookup("r-c") is kept
    assert kept_seq_ids(journal, "b") == [] and kept_seq_ids(journal, "c") == [5]


def test_past_its_bytes_the_oldest_go_and_a_job_missing_uncovered_requests_is_incomplete() -> None:
    journal = Journal(max_bytes=3 * (100 + 512))
    for seq in range(1, 5):
        journal.keep(MODEL, seq, call(), "b")
    assert kept_seq_ids(journal) == [2, 3, 4]
    assert journal.incomplete_above(MODEL) == 1
    journal.cover(MODEL, 1)  # an auto-save at or past what was dropped: nothing is missing any more
    assert journal.incomplete_above(MODEL) is None


def test_without_a_shared_root_a_job_keeps_at_most_its_count() -> None:
    journal = Journal(max_per_job=2)
    for seq in range(1, 4):
        journal.keep(MODEL, seq, call(), "b")
    assert kept_seq_ids(journal) == [2, 3]


# ---------------------------------------------------------------- the answers on the way


def test_a_retrieve_is_sent_for_the_live_request_and_its_try_again_names_the_polled_one() -> None:
    polled = call("/api/v1/retrieve_future", msgspec.json.encode({"request_id": "r-b", "allow_metadata_only": True}))
    live = _with_request_id(polled, "r-c")
    assert msgspec.json.decode(live.body) == {"request_id": "r-c", "allow_metadata_only": True}
    try_again = json_reply({"type": "try_again", "request_id": "r-c", "queue_state": "active"})
    assert msgspec.json.decode(_with_answer_id(try_again, "r-c", "r-b").body)["request_id"] == "r-b"
    assert not _is_final(try_again)


def test_results_and_failures_are_final_while_waits_are_not() -> None:
    result = Reply(b"\x0a\x00", content_type="application/x-protobuf")
    failed = json_reply({"error": "boom", "category": "user"})
    assert _is_final(result) and _is_final(failed) and _is_final(detail_reply(410, "gone"))
    assert not _is_final(detail_reply(408, "later")) and not _is_final(detail_reply(503, "busy"))


def test_a_home_that_did_not_answer_is_told_from_one_that_refused() -> None:
    assert _unreachable(detail_reply(503, "s-1:train:0 lives on node b, which did not answer (ConnectError)"))
    assert not _unreachable(detail_reply(503, "no capacity"))
    assert _request_id_of(json_reply({"request_id": "r-1", "model_id": MODEL})) == "r-1"
    assert _request_id_of(detail_reply(409, "seq_id 3 was already submitted")) is None
