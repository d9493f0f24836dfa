"""The SQLite database of a data dir: its connections, schema and migrations, and the column codecs.

It owns <data_dir>/openrld.sqlite3: opening it in WAL mode, creating the
schema or checking its version, adding the tables that came after version 1,
and the second connection that the request log writes on. Times are integer
microseconds since the epoch, UTC: exact, and they sort. JSON columns hold
msgspec-encoded dicts and lists.

Durability without an fsync on the event loop. The loop's connections commit
at synchronous=NORMAL with automatic checkpoints off: a commit appends to the
WAL through the page cache and waits on no disk, and WAL mode keeps it across
a process crash. A run or checkpoint row must outlive the node too, so the
actor that writes one then awaits `sync()` in a worker thread
(actors/durable_commits.py): an fsync of the WAL, which makes every commit
before it durable, as synchronous=FULL would have at each commit. The same
call checkpoints the WAL into the database on a connection of its own once it
passes WAL_CHECKPOINT_BYTES (synchronous=NORMAL syncs the WAL before and the
database after), so the WAL stays bounded. What is left on the loop is one
fsync of the WAL header when a writer first reuses the WAL after a checkpoint,
once per WAL_CHECKPOINT_BYTES written.

The repositories (sessions.py, runs.py, ...) run their statements through a
`Database`; it knows no table's meaning. It never touches checkpoint files.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec

from openrld.errors import BadRequest, Conflict, ServerError
from openrld.store.history_table import HISTORY_SCHEMA, HistoryTable
from openrld.store.rows import JsonScalar

SCHEMA_VERSION = 1
DB_NAME = "openrld.sqlite3"

# How long a statement waits for another connection's lock (an `openrld`
# CLI reading the database) before failing. Short, because the caller is the
# event loop; WAL readers never block the writer anyway.
_BUSY_TIMEOUT_MS = 1000

# The WAL size past which `sync` checkpoints it. Large, because each checkpoint
# costs the loop one header fsync when the WAL is next reused; a busy node logs
# a request in a page or two, so this is thousands of requests apart.
WAL_CHECKPOINT_BYTES = 16 * 1024 * 1024

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# --- schema -----------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, tags TEXT NOT NULL,
    user_metadata TEXT NOT NULL, sdk_version TEXT NOT NULL, project_id TEXT,
    display_name TEXT, created_us INTEGER NOT NULL, heartbeat_us INTEGER NOT NULL,
    finished_us INTEGER, finish_reason TEXT, finish_detail TEXT
);
CREATE INDEX sessions_by_owner ON sessions (owner, created_us);
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, model_dir TEXT NOT NULL, lora TEXT, settings TEXT NOT NULL,
    user_metadata TEXT NOT NULL, optimizer_config TEXT NOT NULL,
    created_us INTEGER NOT NULL, last_request_us INTEGER NOT NULL,
    corrupted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX runs_by_owner ON runs (owner, created_us);
CREATE INDEX runs_by_session ON runs (session_id);
CREATE TABLE samplers (
    sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, model_path TEXT, run_id TEXT, created_us INTEGER NOT NULL
);
CREATE INDEX samplers_by_session ON samplers (session_id);
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, owner TEXT NOT NULL,
    size_bytes INTEGER, user_metadata TEXT NOT NULL, created_us INTEGER NOT NULL,
    expires_us INTEGER, public INTEGER NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
CREATE INDEX checkpoints_by_owner ON checkpoints (owner, created_us);
CREATE TABLE requests (
    request_id TEXT PRIMARY KEY, model_id TEXT NOT NULL, kind TEXT NOT NULL,
    state TEXT NOT NULL, created_us INTEGER NOT NULL, finished_us INTEGER
);
CREATE INDEX requests_by_state ON requests (state);
"""


# Tables added after schema version 1 shipped. They are additive (nothing
# reads them that did not create them), so a version-1 database gains them at
# open without a version bump.
_ADDITIVE_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    owner TEXT NOT NULL, event TEXT NOT NULL, details TEXT NOT NULL, at_us INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_owner ON audit (owner, at_us);
CREATE TABLE IF NOT EXISTS usage (
    bucket_us INTEGER NOT NULL, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, kind TEXT NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (bucket_us, session_id, base_model, kind)
);
CREATE INDEX IF NOT EXISTS usage_by_owner ON usage (owner, bucket_us);
""" + HISTORY_SCHEMA


# --- the database -----------------------------------------------------------------------------------


class Database:
    """The data dir's SQLite connections and wall clock, shared by the repositories. Use `Database.open`.

    `conn` and `log` are used by one thread at a time: the daemon calls them from the trio thread,
    since each call is a short statement that waits on no disk. `sync` runs in a worker thread.
    """

    def __init__(self, path: Path, conn: sqlite3.Connection, now: Callable[[], datetime]) -> None:
        self.path = path
        self.conn = conn
        self.now = now
        # The request log's statements have a connection of their own, so that
        # one never runs inside another's explicit transaction.
        self.log = _no_sync_connection(path)
        # Checkpoints happen here only, in `sync`'s thread.
        self._checkpointer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._checkpointer.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        self._checkpointer.execute("PRAGMA synchronous = NORMAL")
        self._sync_lock = threading.Lock()
        self._history_tables: list[HistoryTable] = []

    @classmethod
    def open(cls, data_dir: Path, now: Callable[[], datetime]) -> Database:
        """Open (creating, or checking the version of, its schema) the database in `data_dir`.

        Raises:
            ServerError: the schema version is not this openrld's.
        """
        path = data_dir / DB_NAME
        return cls(path, _connect(path), now)

    def close(self) -> None:
        for table in self._history_tables:
            table.close()
        self.log.close()
        self.conn.close()
        # Last: the last connection to close checkpoints the WAL and removes it,
        # and this one syncs around that.
        with self._sync_lock:
            self._checkpointer.close()

    def sync(self) -> None:
        """Make every commit so far durable: fsync the WAL, and checkpoint it once it has grown
        past WAL_CHECKPOINT_BYTES. Blocking; for a worker thread (one at a time)."""
        wal = self.path.with_name(self.path.name + "-wal")
        with self._sync_lock:
            try:
                fd = os.open(wal, os.O_RDONLY)
            except FileNotFoundError:
                return  # no connection is open, so every commit is in the database file
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size > WAL_CHECKPOINT_BYTES:
                self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def history_table(self, *, max_points: int, max_buckets: int, bucket_s: float) -> HistoryTable:
        """The runs' curves on a connection of their own, for a worker thread (history_table.py); closed with the database."""
        table = HistoryTable(
            _no_sync_connection(self.path), max_points=max_points, max_buckets=max_buckets, bucket_s=bucket_s
        )
        self._history_tables.append(table)
        return table

    def one(self, sql: str, args: tuple[object, ...]) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self.conn.execute(sql, args).fetchone()
        return row

    def count(self, sql: str, args: tuple[object, ...] = ()) -> int:
        row = self.one(sql, args)
        assert row is not None
        return int(row[0])


class Repository:
    """One table's reads and writes (runs, sessions, checkpoints, ...), on the data dir's one `Database`."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def _insert_new(self, sql: str, args: tuple[object, ...], what: str) -> None:
        """Insert a row whose key must be new. Raises Conflict ("<what> already exists") if it is taken."""
        try:
            self._db.conn.execute(sql, args)
        except sqlite3.IntegrityError:
            raise Conflict(f"{what} already exists") from None


def _no_sync_connection(db_path: Path) -> sqlite3.Connection:
    """A connection whose commits wait on no disk: synchronous=NORMAL (WAL mode syncs only at a
    checkpoint then) and no automatic checkpoints (`Database.sync` runs them). Every statement
    commits on its own (isolation_level=None); the few multi-statement steps use `transaction`."""
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    return conn


def _connect(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        # Durable by `Database.sync`, not per commit: see the module's docstring.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        with transaction(conn):
            has_schema = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
            ).fetchone()
            if has_schema is None:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            else:
                (version,) = conn.execute("SELECT version FROM schema_version").fetchone()
                if version != SCHEMA_VERSION:
                    raise ServerError(
                        f"{db_path} has schema version {version}; this openrld reads version {SCHEMA_VERSION}"
                    )
            for statement in _ADDITIVE_SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# --- column codecs ----------------------------------------------------------------------------------


def to_us(when: datetime) -> int:
    if when.tzinfo is None:
        raise ValueError(f"naive datetime {when!r}: the store keeps UTC times only")
    return (when - _EPOCH) // timedelta(microseconds=1)


def from_us(us: int | None) -> datetime | None:
    return None if us is None else _EPOCH + timedelta(microseconds=us)


def at(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


json = msgspec.json.encode

decode_str_dict = msgspec.json.Decoder(dict[str, str]).decode
decode_json_dict = msgspec.json.Decoder(dict[str, JsonScalar]).decode
decode_tags = msgspec.json.Decoder(tuple[str, ...]).decode


def user_metadata(metadata: object, what: str) -> bytes:
    """Encode a user_metadata dict, refusing anything but str -> str."""
    try:
        return json(msgspec.convert(metadata, dict[str, str]))
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{what} user_metadata: expected string keys and values: {exc}") from exc


def page(limit: int, offset: int) -> tuple[int, int]:
    if limit < 0:
        raise BadRequest(f"limit: expected 0 or more, got {limit}")
    if offset < 0:
        raise BadRequest(f"offset: expected 0 or more, got {offset}")
    return limit, offset
