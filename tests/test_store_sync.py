"""The database's commits wait on no disk, and `Database.sync` makes them durable and keeps the WAL bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrld.store import Store, database


def wal_frames(store: Store) -> int:
    """The pages the WAL holds now (a checkpoint reports them; this one runs after the assertion's writes)."""
    _busy, frames, _checkpointed = store.database.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(frames)


def add_sessions(store: Store, count: int, *, sync: bool) -> None:
    for n in range(count):
        store.sessions.create(f"s-{n}", "alice", [], {"pad": "x" * 2000}, "0.38.0", None, None)
        if sync:
            store.database.sync()


def test_the_event_loops_connections_commit_without_a_sync_or_a_checkpoint(tmp_path: Path):
    with Store.open(tmp_path / "data") as store:
        settings = [
            (conn.execute("PRAGMA synchronous").fetchone()[0], conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
            for conn in (store.database.conn, store.database.log)
        ]
    assert settings == [(1, 0), (1, 0)]  # NORMAL, none


def test_without_sync_the_wal_only_grows(tmp_path: Path):
    with Store.open(tmp_path / "data") as store:
        add_sessions(store, 100, sync=False)
        assert wal_frames(store) > 100


def test_sync_checkpoints_the_wal_once_past_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(database, "WAL_CHECKPOINT_BYTES", 64 * 1024)
    with Store.open(tmp_path / "data") as store:
        add_sessions(store, 100, sync=True)
        # The bound's 16 pages, plus the pages of the commit that passed it (a session row and its index).
        assert wal_frames(store) <= 16 + 4


def test_synced_rows_are_read_back_after_a_reopen(tmp_path: Path):
    with Store.open(tmp_path / "data") as store:
        add_sessions(store, 3, sync=True)
    with Store.open(tmp_path / "data") as store:
        assert [store.sessions.get(f"s-{n}").owner for n in range(3)] == ["alice"] * 3
