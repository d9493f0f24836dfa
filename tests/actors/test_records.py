"""Records: what the REST, lifecycle and admin routes read and change, driven directly.

The rows are made as the API makes them, through the job table and the sampling
sessions of a node on stand-in engines (tests/actors/stand_in_node.py); the routes
themselves are reached only through a daemon (tests/e2e/).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from openrld import ids
from openrld.actors.job_registry import session_of
from openrld.actors.records import Records
from openrld.errors import BadRequest, NotFound
from tests.actors.stand_in_node import MODEL, OWNER, Node, batch, running_node, sample_job

HOUR = timedelta(hours=1)


@pytest.fixture
async def node(tmp_path):
    async with running_node(tmp_path) as running:
        yield running


@pytest.fixture
def records(node: Node) -> Records:
    return Records(node.store, node.usage)


def everything(row: object) -> bool:
    return True


# ---------------------------------------------------------------- sessions


async def test_another_users_session_is_404_exactly_as_a_missing_one(node: Node, records: Records):
    session_id = await node.session()
    with pytest.raises(NotFound) as theirs:
        records.own_session("bob", session_id)
    with pytest.raises(NotFound) as missing:
        records.own_session("bob", "s-none")
    assert (theirs.value.detail, missing.value.detail) == (f"no session {session_id!r}", "no session 's-none'")


async def test_a_sessions_members_are_its_runs_and_its_samplers_in_creation_order(node: Node, records: Records):
    session_id = await node.session()
    for seq in (1, 0):
        await node.completed(node.create_model(session_id, seq)[0])
    node.sampling.create(OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None)
    assert records.session_members(session_id) == (
        [ids.model_id(session_id, 1), ids.model_id(session_id, 0)], [ids.sampling_session_id(session_id, 0)]
    )


async def test_search_finds_the_owners_sessions_newest_first_with_their_checkpoints_count_and_bytes(
    node: Node, records: Records
):
    model_id = await node.new_model()
    older = session_of(model_id)
    await node.completed(
        node.jobs.save_weights(OWNER, model_id, 1, name="a", overwrite=False, ttl_seconds=None, user_metadata={})
    )
    newer = await node.session()
    await node.session("bob")
    size = node.store.checkpoints.get(model_id, ids.CheckpointKind.WEIGHTS, "a").size_bytes
    found = records.search_sessions(OWNER, everything, before=None, limit=10)
    assert [(row.session_id, count, size_bytes) for row, count, size_bytes in found] == [
        (newer, 0, 0), (older, 1, size),
    ]


async def test_search_answers_one_past_the_limit_and_only_sessions_before_the_cursor(node: Node, records: Records):
    made = [await node.session() for _ in range(4)]  # oldest first
    page = records.search_sessions(OWNER, everything, before=None, limit=2)
    assert [row.session_id for row, _, _ in page] == made[::-1][:3]  # the third says there is more
    cursor = (page[1][0].created_at, page[1][0].session_id)
    after = records.search_sessions(OWNER, everything, before=cursor, limit=2)
    assert [row.session_id for row, _, _ in after] == made[1::-1]


async def test_search_keeps_only_the_sessions_its_filter_accepts(node: Node, records: Records):
    await node.session()
    tagged = await node.session(tags=["team-a"])
    found = records.search_sessions(OWNER, lambda row: "team-a" in row.tags, before=None, limit=10)
    assert [row.session_id for row, _, _ in found] == [tagged]


# ---------------------------------------------------------------- projects


async def test_assigning_a_project_moves_the_session_and_audits_who_did_it(node: Node, records: Records):
    session_id = await node.session()
    records.assign_project(OWNER, session_id, "sweep-7")
    now = datetime.now(UTC)
    assert records.own_session(OWNER, session_id).project_id == "sweep-7"
    assert [(event, details) for _, event, details in records.audit_events(OWNER, now - HOUR, now + HOUR)] == [
        ("project_session_assigned", {"session_id": session_id, "project_id": "sweep-7", "actor": OWNER}),
    ]


@pytest.mark.parametrize("length", [0, ids.MAX_NAME_CHARS + 1], ids=["empty", "overlong"])
async def test_a_project_id_outside_its_length_is_400_with_the_range(node: Node, records: Records, length: int):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        records.assign_project(OWNER, session_id, "p" * length)
    assert caught.value.detail == f"project_id: expected 1..{ids.MAX_NAME_CHARS} characters, got {length}"
    assert records.own_session(OWNER, session_id).project_id is None


async def test_assigning_another_users_session_is_404_and_audits_nothing(node: Node, records: Records):
    session_id = await node.session()
    with pytest.raises(NotFound):
        records.assign_project("bob", session_id, "sweep-7")
    now = datetime.now(UTC)
    assert records.audit_events("bob", now - HOUR, now + HOUR) == []


# ---------------------------------------------------------------- request log, usage


async def test_a_sessions_requests_are_its_logged_requests_oldest_first(node: Node, records: Records):
    model_id = await node.new_model()
    session_id = session_of(model_id)
    step = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    sampler_id = node.sampling.create(
        OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None
    )
    sample, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    logged = [(request_id, model, kind) for request_id, model, kind, _, _ in records.session_requests(session_id)]
    assert logged[1:] == [(step, model_id, "forward_backward"), (sample, sampler_id, "sample")]
    assert logged[0][1:] == (model_id, "create_model")


async def test_usage_includes_the_counts_the_meter_has_not_flushed_yet(node: Node, records: Records):
    model_id = await node.new_model()
    node.jobs.forward_backward(OWNER, model_id, 1, batch(10, 20, 30))  # three datums of two tokens
    rows = records.usage(OWNER, datetime(1970, 1, 1, tzinfo=UTC), datetime(1970, 1, 2, tzinfo=UTC))
    assert [(row.session_id, row.kind, row.tokens) for row in rows] == [
        (session_of(model_id), "training", 6)
    ]
