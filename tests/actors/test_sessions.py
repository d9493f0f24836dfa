"""Sessions: creation with settings validated, the owner rule, heartbeats, finish and mirroring (sync, no trio)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from openrld.actors.sessions import SessionSnapshot, SessionTable
from openrld.errors import BadRequest, Gone, NotFound
from openrld.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "data") as opened:
        yield opened


@pytest.fixture
def sessions(store: Store) -> SessionTable:
    return SessionTable(store=store)


async def create(sessions: SessionTable, owner: str = "alice", tags: list[str] | None = None) -> str:
    return await sessions.create(
        owner, tags=tags or [], user_metadata={"note": "x"}, sdk_version="0.38.0", project_id=None, display_name=None
    )


async def test_an_unknown_openrl_tag_is_refused_at_create_naming_the_key(sessions):
    with pytest.raises(BadRequest) as caught:
        await create(sessions, tags=["openrl.no_such_key=1"])
    assert caught.value.key == "openrl.no_such_key"


async def test_a_created_session_is_its_owners(sessions):
    session_id = await create(sessions)
    assert (sessions.owned("alice", session_id).owner, sessions.is_home_to(session_id)) == ("alice", True)


async def test_another_users_session_is_404(sessions):
    session_id = await create(sessions)
    with pytest.raises(NotFound):
        sessions.owned("bob", session_id)


async def test_a_finished_sessions_heartbeat_is_410(sessions):
    session_id = await create(sessions)
    sessions.finish("alice", session_id, "user_requested", None)
    with pytest.raises(Gone):
        sessions.heartbeat("alice", session_id)


async def test_finishing_marks_the_session_finished(sessions):
    session_id = await create(sessions)
    before = sessions.is_finished(session_id)
    sessions.finish("alice", session_id, "user_requested", None)
    assert (before, sessions.is_finished(session_id)) == (False, True)


async def test_a_snapshot_mirrored_on_another_node_keeps_owner_tags_and_metadata(store, tmp_path):
    home = SessionTable(store=store)
    session_id = await create(home, tags=["openrl.exclusive=true"])
    with Store.open(tmp_path / "other") as other_store:
        other = SessionTable(store=other_store)
        other.mirror(home.snapshot(session_id))
        assert other.snapshot(session_id) == SessionSnapshot(
            session_id, "alice", ["openrl.exclusive=true"], {"note": "x"}, "0.38.0", None, None
        )


def test_an_unknown_session_has_no_snapshot(sessions):
    assert sessions.snapshot("s-none") is None


async def test_a_session_id_is_s_then_the_nodes_tag_then_random_hex(store):
    session_id = await create(SessionTable(store=store, id_tag="0a1b2c3d"))
    assert (session_id[:10], len(session_id)) == ("s-0a1b2c3d", 2 + 8 + 16)


async def test_another_users_heartbeat_is_404(sessions):
    session_id = await create(sessions)
    with pytest.raises(NotFound) as caught:
        sessions.heartbeat("bob", session_id)
    assert caught.value.detail == f"no session {session_id!r}"


async def test_a_session_keeps_the_first_finish_reason_given(sessions, store):
    session_id = await create(sessions)
    sessions.finish("alice", session_id, "user_requested", "done")
    sessions.finish("alice", session_id, "timeout", None)
    row = store.sessions.get(session_id)
    assert (row.finish_reason, row.finish_detail) == ("user_requested", "done")


async def test_mirroring_a_session_already_known_here_leaves_it_as_it_is(sessions):
    session_id = await create(sessions, tags=["openrl.exclusive=true"])
    sessions.mirror(SessionSnapshot(session_id, "mallory", [], {}, "0.16.0", None, None))
    assert sessions.owned("alice", session_id).tags == ("openrl.exclusive=true",)


def test_an_unknown_session_is_neither_finished_nor_home_here(sessions):
    assert (sessions.is_finished("s-none"), sessions.is_home_to("s-none")) == (False, False)


def test_an_adopted_jobs_session_is_recorded_with_its_owner_so_its_finish_reaches_the_job_here(sessions):
    sessions.mirror_adopted("s-home", "alice")
    sessions.finish("alice", "s-home", "user_requested", None)
    assert (sessions.owned("alice", "s-home").owner, sessions.is_finished("s-home")) == ("alice", True)


def test_a_session_recorded_by_adoption_is_never_sent_on_as_the_sessions_account(sessions):
    sessions.mirror_adopted("s-home", "alice")
    assert sessions.snapshot("s-home") is None


def test_the_homes_account_replaces_a_session_recorded_by_adoption(sessions):
    sessions.mirror_adopted("s-home", "alice")
    told = SessionSnapshot("s-home", "alice", ["openrl.exclusive=true"], {"note": "x"}, "0.38.0", None, "run 7")
    sessions.mirror(told)
    assert sessions.snapshot("s-home") == told


async def test_adoption_leaves_a_session_known_here_as_it_is(sessions):
    session_id = await create(sessions, tags=["openrl.exclusive=true"])
    sessions.mirror_adopted(session_id, "alice")
    assert sessions.snapshot(session_id) == SessionSnapshot(
        session_id, "alice", ["openrl.exclusive=true"], {"note": "x"}, "0.38.0", None, None
    )


def test_another_owners_account_leaves_a_session_recorded_by_adoption_as_it_is(sessions, store):
    sessions.mirror_adopted("s-home", "alice")
    sessions.mirror(SessionSnapshot("s-home", "mallory", ["openrl.exclusive=true"], {}, "0.38.0", None, None))
    row = store.sessions.get("s-home")
    assert (row.owner, row.tags) == ("alice", ())
