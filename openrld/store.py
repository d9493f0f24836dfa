"""The node's durable state: an SQLite database and checkpoint directories.

This module owns everything under the data dir:

    <data_dir>/openrld.sqlite3     sessions, training runs, sampling sessions,
                                   checkpoints, the request log, and each run's
                                   bounded curves (history_table.py)
    <data_dir>/checkpoints/<run_id>/<kind>/<name>/   one directory per checkpoint
    <data_dir>/tmp/                staging for checkpoint writes; emptied at open
    <data_dir>/lock                held while a Store is open

With a checkpoint root shared by the cluster's nodes (`Store.open(...,
checkpoint_root=...)`: NFS, a GCS FUSE mount), the checkpoint directories live
there instead, as <root>/<run_id>/<kind>/<name>/, and staging moves to
<root>/.staging/<node_id>/ so that the final rename stays on one filesystem.
<node_id> is random, made once per data dir and kept in <data_dir>/node_id, so
recovery at open empties this node's staging and finishes this node's
interrupted replaces (moved aside as "<name>#old-<node_id>"), never another
live node's. Every checkpoint directory holds a manifest
(checkpoint_manifest.py); on a shared root, `adopt_checkpoint` turns another
node's checkpoint into local rows from it.

It guarantees:
- What was written before a kill is there after a restart: the database runs
  in WAL mode with synchronous=FULL, and a checkpoint directory appears under
  its final name only whole (written in tmp/, fsynced, renamed into place,
  parent fsynced). A restart removes whatever staging a kill left behind and
  finishes or undoes an interrupted replace.
- Requests that were pending when the daemon died read as "lost" afterwards,
  so their futures fail clearly instead of polling forever.
- No path it builds leaves the checkpoint root: every component passes
  `ids.validate_name`, and the resolved path is checked, symlinks included.
- One Store per data dir at a time (an exclusive lock on <data_dir>/lock).

It never decides policy (who may see what is the API's check, using the
`owner` columns), never imports trio or torch, and is used by one thread at
a time: the daemon calls it from the trio thread, since each call is a short
SQLite statement.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import secrets
import shutil
import sqlite3
import stat
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import msgspec

from openrld.checkpoint_manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    CheckpointManifest,
    ManifestError,
    read_manifest,
    write_manifest,
)
from openrld.history_table import HISTORY_SCHEMA, HistoryTable
from openrld.errors import BadRequest, Conflict, Gone, NotFound, ServerError
from openrld.ids import CheckpointKind, TinkerPath, parse_checkpoint_kind, validate_name

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "openrld.sqlite3"

# A replace moves the old directory aside under this suffix. '#' can never be
# part of a checkpoint name (ids.validate_name), so it never names a real one.
_REPLACED_SUFFIX = "#old"

# On a shared checkpoint root: the directory holding each node's staging. It
# starts with '.', which no run id may (ids.validate_name), so it is never a run.
SHARED_STAGING_DIR = ".staging"
NODE_ID_FILE = "node_id"  # in the data dir: this node's name for its staging on a shared root

# How long a statement waits for another connection's lock (an `openrld`
# CLI reading the database) before failing. Short, because the caller is the
# event loop; WAL readers never block the writer anyway.
_BUSY_TIMEOUT_MS = 1000

JsonScalar = str | int | float | bool | None

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# How long a lost request id still answers 410 rather than 404 after a restart.
REQUEST_LOG_KEEP = timedelta(days=7)


def utc_now() -> datetime:
    return datetime.now(UTC)


# --- rows -------------------------------------------------------------------------------------------


class SessionRow(msgspec.Struct, frozen=True):
    session_id: str
    owner: str
    tags: tuple[str, ...]
    user_metadata: dict[str, str]
    sdk_version: str
    project_id: str | None
    display_name: str | None
    created_at: datetime
    last_heartbeat_at: datetime
    finished_at: datetime | None
    finish_reason: str | None  # the first reason given; later ones are ignored
    finish_detail: str | None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class RunRow(msgspec.Struct, frozen=True):
    """A training run; `run_id` is the training client's model id."""

    run_id: str
    session_id: str
    owner: str
    base_model: str
    model_dir: str
    lora: dict[str, JsonScalar] | None  # LoraConfig fields; None for full fine-tuning
    settings: dict[str, JsonScalar]  # settings.settings_to_dict form
    user_metadata: dict[str, str]
    optimizer_config: dict[str, JsonScalar]
    created_at: datetime
    last_request_at: datetime
    corrupted: bool

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    @property
    def lora_rank(self) -> int | None:
        rank = self.lora.get("rank") if self.lora is not None else None
        return rank if isinstance(rank, int) else None


class SamplerRow(msgspec.Struct, frozen=True):
    sampler_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None  # the tinker:// path it samples from; None for the base model
    run_id: str | None  # the training run that made it, for save_weights_and_get_sampling_client
    created_at: datetime


class CheckpointRow(msgspec.Struct, frozen=True):
    run_id: str
    kind: CheckpointKind
    name: str
    owner: str
    created_at: datetime
    size_bytes: int | None
    user_metadata: dict[str, str]
    expires_at: datetime | None
    public: bool

    @property
    def path(self) -> TinkerPath:
        return TinkerPath(run_id=self.run_id, kind=self.kind, name=self.name)

    @property
    def tinker_path(self) -> str:
        return self.path.uri

    @property
    def checkpoint_id(self) -> str:
        return self.path.checkpoint_id

    @property
    def checkpoint_type(self) -> str:
        return self.kind.checkpoint_type


class UsageRow(msgspec.Struct, frozen=True):
    """Tokens one session used of one kind ("training", "sampling_prefill", "sampling_sample") in one hour."""

    bucket_start: datetime
    session_id: str
    owner: str
    base_model: str
    kind: str
    tokens: int


class RequestState(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    LOST = "lost"  # pending when the daemon stopped; its result will never come


class RequestFinish(msgspec.Struct, frozen=True):
    request_id: str
    finished: datetime


class StoreStatistics(msgspec.Struct, frozen=True):
    sessions: int
    runs: int
    samplers: int
    checkpoints: int
    checkpoint_bytes: int
    pending_requests: int


# --- schema -----------------------------------------------------------------------------------------

# Times are integer microseconds since the epoch, UTC: exact, and they sort.
# JSON columns hold msgspec-encoded dicts and lists.
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


def _to_us(when: datetime) -> int:
    if when.tzinfo is None:
        raise ValueError(f"naive datetime {when!r}: the store keeps UTC times only")
    return (when - _EPOCH) // timedelta(microseconds=1)


def _from_us(us: int | None) -> datetime | None:
    return None if us is None else _EPOCH + timedelta(microseconds=us)


def _at(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


_json = msgspec.json.encode


def _user_metadata(metadata: object, what: str) -> bytes:
    """Encode a user_metadata dict, refusing anything but str -> str."""
    try:
        return _json(msgspec.convert(metadata, dict[str, str]))
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{what} user_metadata: expected string keys and values: {exc}") from exc


def _page(limit: int, offset: int) -> tuple[int, int]:
    if limit < 0:
        raise BadRequest(f"limit: expected 0 or more, got {limit}")
    if offset < 0:
        raise BadRequest(f"offset: expected 0 or more, got {offset}")
    return limit, offset


# --- the store --------------------------------------------------------------------------------------


class Store:
    """SQLite metadata and checkpoint directories under one data dir. Use `Store.open`."""

    def __init__(
        self, data_dir: Path, conn: sqlite3.Connection, lock_file: IO[bytes], now: Callable[[], datetime],
        layout: _CheckpointLayout,
    ) -> None:
        self.data_dir = data_dir
        self._conn = conn
        # The request log only has to outlive the process, not the machine: a
        # second connection with synchronous=NORMAL, which WAL keeps durable
        # across a process crash, spares every request an fsync.
        self._log = sqlite3.connect(data_dir / DB_NAME, isolation_level=None, check_same_thread=False)
        self._log.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        self._log.execute("PRAGMA synchronous = NORMAL")
        self._lock_file = lock_file
        self._now = now
        self._checkpoints = layout.root
        self._checkpoints_resolved = layout.resolved_root
        self._tmp = layout.staging
        self._replaced_suffix = layout.replaced_suffix
        self.is_shared = layout.is_shared
        self._history_tables: list[HistoryTable] = []

    # --- lifecycle ----------------------------------------------------------------------------------

    @classmethod
    def open(
        cls, data_dir: Path, *, checkpoint_root: Path | None = None, now: Callable[[], datetime] = utc_now
    ) -> Store:
        """Open (creating if needed) the store in `data_dir`, and recover from a crash.

        Args:
            data_dir: the node's data dir; made absolute here.
            checkpoint_root: a directory shared by the cluster's nodes to keep
                checkpoints in; None keeps them in <data_dir>/checkpoints.
            now: the wall clock (UTC); tests pass a fixed one.

        Raises:
            ServerError: another Store holds the data dir, its schema is not ours,
                or `checkpoint_root` is not an existing directory.
        """
        data_dir = data_dir.expanduser().absolute()
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_file = (data_dir / "lock").open("ab")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise ServerError(f"data dir {data_dir} is in use by another openrld process") from None
        try:
            layout = _checkpoint_layout(data_dir, checkpoint_root)
            _remove_staging(layout.staging)
            layout.root.mkdir(mode=0o700, exist_ok=True)
            _recover_replaces(layout.root, layout.replaced_suffix)
            conn = _connect(data_dir / DB_NAME)
        except BaseException:
            lock_file.close()
            raise
        store = cls(data_dir, conn, lock_file, now, layout)
        # Results lived in the dead process's memory, so a request it finished
        # but nobody read is as lost as one it never ran.
        pending = store._count("SELECT count(*) FROM requests WHERE state = ?", (RequestState.PENDING,))
        store._conn.execute(
            "UPDATE requests SET state = ?, finished_us = coalesce(finished_us, ?) WHERE state != ?",
            (RequestState.LOST, _to_us(now()), RequestState.LOST),
        )
        store.prune_requests(now() - REQUEST_LOG_KEEP)
        if pending:
            logger.warning("data_dir=%s: %d requests pending at the last stop are now lost", data_dir, pending)
        return store

    def close(self) -> None:
        for table in self._history_tables:
            table.close()
        self._log.close()
        self._conn.close()
        self._lock_file.close()  # releases the flock

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def history_table(self, *, max_points: int, max_buckets: int, bucket_s: float) -> HistoryTable:
        """The runs' curves on a connection of their own, for a worker thread (history_table.py); closed with the store."""
        table = HistoryTable(self.data_dir / DB_NAME, max_points=max_points, max_buckets=max_buckets, bucket_s=bucket_s)
        self._history_tables.append(table)
        return table

    def _one(self, sql: str, args: tuple[object, ...]) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._conn.execute(sql, args).fetchone()
        return row

    def _count(self, sql: str, args: tuple[object, ...] = ()) -> int:
        row = self._one(sql, args)
        assert row is not None
        return int(row[0])

    # --- sessions -----------------------------------------------------------------------------------

    def create_session(
        self,
        session_id: str,
        owner: str,
        tags: list[str],
        user_metadata: dict[str, str],
        sdk_version: str,
        project_id: str | None,
        display_name: str | None,
    ) -> SessionRow:
        """Record a new session. Raises Conflict if the id is taken."""
        now_us = _to_us(self._now())
        try:
            self._conn.execute(
                "INSERT INTO sessions (session_id, owner, tags, user_metadata, sdk_version, project_id,"
                " display_name, created_us, heartbeat_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session_id, owner, _json(list(tags)), _user_metadata(user_metadata, "session"),
                    sdk_version, project_id, display_name, now_us, now_us,
                ),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise Conflict(f"session {session_id!r} already exists") from None
        row = self.get_session(session_id)
        assert row is not None
        return row

    def get_session(self, session_id: str) -> SessionRow | None:
        row = self._one("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        return None if row is None else _session_row(row)

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[SessionRow]:
        """`owner`'s sessions, newest first."""
        limit, offset = _page(limit, offset)
        rows = self._conn.execute(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        return [_session_row(row) for row in rows]

    def heartbeat(self, session_id: str) -> None:
        """Note that the session's client is alive.

        Raises:
            NotFound: no such session.
            Gone: the session has finished (the SDK stops heartbeating on 410).
        """
        updated = self._conn.execute(
            "UPDATE sessions SET heartbeat_us = ? WHERE session_id = ? AND finish_reason IS NULL",
            (_to_us(self._now()), session_id),
        ).rowcount
        if updated == 0:
            session = self.get_session(session_id)
            if session is None:
                raise NotFound(f"session {session_id!r} not found")
            raise Gone(f"session {session_id!r} has finished ({session.finish_reason})")

    def finish_session(self, session_id: str, reason: str, detail: str | None) -> bool:
        """End a session. The first reason wins; returns whether this call's did.

        Raises:
            NotFound: no such session.
        """
        updated = self._conn.execute(
            "UPDATE sessions SET finished_us = ?, finish_reason = ?, finish_detail = ?"
            " WHERE session_id = ? AND finish_reason IS NULL",
            (_to_us(self._now()), reason, detail, session_id),
        ).rowcount
        if updated == 0 and self.get_session(session_id) is None:
            raise NotFound(f"session {session_id!r} not found")
        return updated == 1

    def session_checkpoint_usage(self, session_id: str) -> tuple[int, int]:
        """(count, total size_bytes) of the checkpoints of the session's runs."""
        row = self._one(
            "SELECT count(*), coalesce(sum(c.size_bytes), 0) FROM checkpoints c"
            " JOIN runs r ON r.run_id = c.run_id WHERE r.session_id = ?",
            (session_id,),
        )
        assert row is not None
        return int(row[0]), int(row[1])

    # --- training runs ------------------------------------------------------------------------------

    def create_run(
        self,
        run_id: str,
        session_id: str,
        owner: str,
        base_model: str,
        model_dir: str,
        lora: dict[str, JsonScalar] | None,
        settings: dict[str, JsonScalar],
        user_metadata: dict[str, str],
        optimizer_config: dict[str, JsonScalar],
    ) -> RunRow:
        """Record a new training run. Raises Conflict if the id is taken, BadRequest if it is unsafe."""
        validate_name(run_id, "run id")
        now_us = _to_us(self._now())
        try:
            self._conn.execute(
                "INSERT INTO runs (run_id, session_id, owner, base_model, model_dir, lora, settings,"
                " user_metadata, optimizer_config, created_us, last_request_us)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id, session_id, owner, base_model, str(model_dir),
                    None if lora is None else _json(lora), _json(settings),
                    _user_metadata(user_metadata, "training run"), _json(optimizer_config), now_us, now_us,
                ),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise Conflict(f"training run {run_id!r} already exists") from None
        row = self.get_run(run_id)
        assert row is not None
        return row

    def get_run(self, run_id: str) -> RunRow | None:
        row = self._one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return None if row is None else _run_row(row)

    def list_runs(
        self, owner: str, limit: int, offset: int, *, accessible: bool = False, every_owner: bool = False
    ) -> tuple[list[RunRow], int]:
        """A page of `owner`'s runs, newest first, and how many there are in all.

        With `accessible`, other users' runs that have a published checkpoint count too;
        with `every_owner` (an operator's view), every run does.
        """
        limit, offset = _page(limit, offset)
        where = "owner = ?"
        if every_owner:
            where = "(owner = ? OR 1 = 1)"  # keeps the one parameter the queries below pass
        elif accessible:
            where += " OR run_id IN (SELECT run_id FROM checkpoints WHERE public = 1)"
        rows = self._conn.execute(
            f"SELECT * FROM runs WHERE {where} ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        page = [_run_row(row) for row in rows]
        return page, self._count(f"SELECT count(*) FROM runs WHERE {where}", (owner,))

    def has_public_checkpoint(self, run_id: str) -> bool:
        return self._one("SELECT 1 FROM checkpoints WHERE run_id = ? AND public = 1 LIMIT 1", (run_id,)) is not None

    def touch_run(self, run_id: str) -> None:
        """Set the run's last_request_time to now. Raises NotFound for an unknown run.

        On the request log's connection: a time that lags by the last few
        requests after a power loss is harmless, and this runs on every request.
        """
        updated = self._log.execute(
            "UPDATE runs SET last_request_us = ? WHERE run_id = ?", (_to_us(self._now()), run_id)
        ).rowcount
        if updated == 0:
            raise NotFound(f"training run {run_id!r} not found")

    def session_runs(self, session_id: str) -> list[str]:
        """The session's run ids, in creation order."""
        rows = self._conn.execute(
            "SELECT run_id FROM runs WHERE session_id = ? ORDER BY created_us, rowid", (session_id,)
        )
        return [row[0] for row in rows]

    # --- sampling sessions --------------------------------------------------------------------------

    def create_sampler(
        self,
        sampler_id: str,
        session_id: str,
        owner: str,
        base_model: str,
        model_path: str | None,
        run_id: str | None,
    ) -> SamplerRow:
        """Record a new sampling session. Raises Conflict if the id is taken."""
        try:
            self._conn.execute(
                "INSERT INTO samplers (sampler_id, session_id, owner, base_model, model_path, run_id, created_us)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (sampler_id, session_id, owner, base_model, model_path, run_id, _to_us(self._now())),
            )
        except sqlite3.IntegrityError:
            raise Conflict(f"sampling session {sampler_id!r} already exists") from None
        row = self.get_sampler(sampler_id)
        assert row is not None
        return row

    def get_sampler(self, sampler_id: str) -> SamplerRow | None:
        row = self._one("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,))
        if row is None:
            return None
        return SamplerRow(
            sampler_id=row["sampler_id"],
            session_id=row["session_id"],
            owner=row["owner"],
            base_model=row["base_model"],
            model_path=row["model_path"],
            run_id=row["run_id"],
            created_at=_at(row["created_us"]),
        )

    def session_samplers(self, session_id: str) -> list[str]:
        """The session's sampler ids, in creation order."""
        rows = self._conn.execute(
            "SELECT sampler_id FROM samplers WHERE session_id = ? ORDER BY created_us, rowid", (session_id,)
        )
        return [row[0] for row in rows]

    def base_models(self) -> list[str]:
        """Every base model name a run or a sampling session here was created on, sorted, each once."""
        rows = self._conn.execute("SELECT base_model FROM runs UNION SELECT base_model FROM samplers ORDER BY 1")
        return [row[0] for row in rows]

    # --- checkpoints --------------------------------------------------------------------------------

    def add_checkpoint(
        self,
        run_id: str,
        kind: CheckpointKind,
        name: str,
        owner: str,
        size_bytes: int | None,
        user_metadata: dict[str, str],
        expires_at: datetime | None,
        public: bool = False,
        *,
        overwrite: bool = False,
        created_at: datetime | None = None,
    ) -> CheckpointRow:
        """Record a checkpoint whose directory `commit_dir` has put in place.

        `created_at` (default: now) is its manifest's, so that every node that
        adopts the checkpoint lists the same time as this one.

        Raises:
            BadRequest: an unsafe run id or name, or an unknown kind.
            Conflict: the checkpoint exists and `overwrite` is false.
        """
        path = TinkerPath.of(run_id, kind, name)
        verb = "INSERT OR REPLACE" if overwrite else "INSERT"
        try:
            self._conn.execute(
                f"{verb} INTO checkpoints (run_id, kind, name, owner, size_bytes, user_metadata, created_us,"
                " expires_us, public) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    path.run_id, path.kind.value, path.name, owner, size_bytes,
                    _user_metadata(user_metadata, "checkpoint"), _to_us(created_at or self._now()),
                    None if expires_at is None else _to_us(expires_at), int(public),
                ),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise Conflict(f"checkpoint {path.uri} already exists") from None
        row = self.get_checkpoint(path.run_id, path.kind, path.name)
        assert row is not None
        return row

    def get_checkpoint(self, run_id: str, kind: CheckpointKind, name: str) -> CheckpointRow | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
            (run_id, parse_checkpoint_kind(kind).value, name),
        )
        return None if row is None else _checkpoint_row(row)

    def list_checkpoints(self, run_id: str) -> list[CheckpointRow]:
        """The run's checkpoints, oldest first."""
        rows = self._conn.execute(
            "SELECT * FROM checkpoints WHERE run_id = ? ORDER BY created_us, rowid", (run_id,)
        )
        return [_checkpoint_row(row) for row in rows]

    def list_user_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[CheckpointRow], int]:
        """A page of `owner`'s checkpoints across runs, newest first, and how many they have in all."""
        limit, offset = _page(limit, offset)
        rows = self._conn.execute(
            "SELECT * FROM checkpoints WHERE owner = ? ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        page = [_checkpoint_row(row) for row in rows]
        return page, self._count("SELECT count(*) FROM checkpoints WHERE owner = ?", (owner,))

    def last_checkpoint(self, run_id: str, kind: CheckpointKind) -> CheckpointRow | None:
        """The run's newest checkpoint of `kind`, if any."""
        row = self._one(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? ORDER BY created_us DESC, rowid DESC LIMIT 1",
            (run_id, parse_checkpoint_kind(kind).value),
        )
        return None if row is None else _checkpoint_row(row)

    def delete_checkpoint(self, run_id: str, kind: CheckpointKind, name: str) -> None:
        """Remove a checkpoint's row, then its directory.

        The row goes first: a crash in between leaves an unlisted directory,
        never a listed checkpoint with no files. The directory is renamed into
        tmp/ before it is removed, so a half-deleted one is never visible.
        The daemon runs the two halves apart (`delete_checkpoint_row` on the
        event loop, `remove_checkpoint_files` in a thread: actors/checkpoints.py).

        Raises:
            NotFound: no such checkpoint.
        """
        self.remove_checkpoint_files(self.delete_checkpoint_row(run_id, kind, name))

    def delete_checkpoint_row(self, run_id: str, kind: CheckpointKind | str, name: str) -> TinkerPath:
        """The row half of `delete_checkpoint`; touches no file. Returns the checkpoint's path.

        Raises:
            NotFound: no such checkpoint.
        """
        path = TinkerPath.of(run_id, kind, name)
        deleted = self._conn.execute(
            "DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
            (path.run_id, path.kind.value, path.name),
        ).rowcount
        if deleted == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def remove_checkpoint_files(self, path: TinkerPath) -> None:
        """The file half of `delete_checkpoint`, once the row is gone; touches no row (for a worker thread)."""
        directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
        if directory.exists():
            doomed = self._tmp / f"deleted-{secrets.token_hex(8)}"
            try:
                os.rename(directory, doomed)
            except FileNotFoundError:
                return  # on a shared root, another node that had its row (an expiry sweep) removed it first
            shutil.rmtree(doomed)

    # --- checkpoint directories ---------------------------------------------------------------------

    def checkpoint_dir(self, run_id: str, kind: CheckpointKind | str, name: str) -> Path:
        """<checkpoint root>/<run_id>/<kind>/<name>; it need not exist yet.

        The root is <data_dir>/checkpoints, or the shared checkpoint root.

        Raises:
            BadRequest: an unsafe run id or name ('..', '/', an absolute path...), or an unknown kind.
            ServerError: the path resolves outside the checkpoint root (a symlink planted in it).
        """
        path = TinkerPath.of(run_id, kind, name)
        directory = self._checkpoints / path.run_id / path.kind.value / path.name
        self._require_under(directory)
        return directory

    @property
    def checkpoint_files(self) -> tuple[Path, Path]:
        """(the checkpoint root, this node's staging under which checkpoints are written): what a
        worker outside this process must see, at the same paths, to read and write checkpoints."""
        return self._checkpoints, self._tmp

    def staging_dir(self) -> Path:
        """A fresh, empty directory in this node's staging (tmp/, or its own under a shared root)
        to write a checkpoint into before `commit_dir`."""
        staging = self._tmp / f"staging-{secrets.token_hex(8)}"
        staging.mkdir(mode=0o700)
        return staging

    def commit_dir(
        self, staging: Path, final: Path, *, replace: bool = False, manifest: CheckpointManifest | None = None
    ) -> None:
        """Make a staging directory the checkpoint directory `final`, durably and whole.

        `manifest`, when given, is written into `staging` first, so that it
        lands with the files. Every file and directory in `staging` is
        fsynced, then it is renamed to `final` and the parents are fsynced.
        With `replace`, an existing `final` is first moved aside to
        "<name>#old" ("<name>#old-<node_id>" on a shared root) and removed
        after; if the daemon dies in between, the next open puts back
        whichever is whole.

        Args:
            staging: a directory from `staging_dir`.
            final: a path from `checkpoint_dir`.
            replace: whether an existing checkpoint at `final` is replaced.
            manifest: the checkpoint's manifest (`manifest_for`); every
                checkpoint of a run carries one, so that another node can adopt it.

        Raises:
            Conflict: `final` exists and `replace` is false.
            ServerError: `staging` is not a staging dir, holds something other
                than files and directories, `final` escapes the checkpoint root,
                or `manifest` names another checkpoint than `final`.
        """
        if staging.parent != self._tmp or not staging.name.startswith("staging-") or not staging.is_dir():
            raise ServerError(f"{staging} is not a staging dir of this store")
        self._require_under(final)
        if manifest is not None:
            if self.checkpoint_dir(manifest.run_id, manifest.kind, manifest.name) != final:
                raise ServerError(f"the manifest of {manifest.path.uri} does not belong in {final}")
            write_manifest(staging, manifest)
        _fsync_tree(staging)
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.lexists(final):
            if not replace:
                raise Conflict(f"checkpoint {self._uri_of(final)} already exists")
            aside = final.with_name(final.name + self._replaced_suffix)
            if os.path.lexists(aside):
                shutil.rmtree(aside)
            os.rename(final, aside)
            os.rename(staging, final)
            _fsync_dir(final.parent)
            shutil.rmtree(aside)
        else:
            os.rename(staging, final)
        # The rename is durable once the parent is; parents made just now need theirs too.
        for directory in (final.parent, final.parent.parent, final.parent.parent.parent):
            _fsync_dir(directory)

    def _uri_of(self, directory: Path) -> str:
        run_id, kind, name = directory.relative_to(self._checkpoints).parts
        return f"tinker://{run_id}/{kind}/{name}"

    def _require_under(self, path: Path) -> None:
        # The expected root was fixed at open (see _checkpoint_layout), so a
        # symlink planted later, at any level, is refused.
        expected_root = self._checkpoints_resolved
        resolved = path.resolve()
        if resolved != expected_root and not resolved.is_relative_to(expected_root):
            logger.error("data_dir=%s: path %s resolves to %s, outside %s", self.data_dir, path, resolved, expected_root)
            raise ServerError(f"{path} resolves outside {expected_root}; refusing to use it")

    # --- manifests and adoption (a shared checkpoint root) ------------------------------------------

    def manifest_for(
        self, run_id: str, kind: CheckpointKind | str, name: str, *, size_bytes: int | None,
        user_metadata: dict[str, str], expires_at: datetime | None,
    ) -> CheckpointManifest:
        """The manifest of a new checkpoint of `run_id`, from the run's row; created now.

        Raises:
            BadRequest: an unsafe name or unknown kind.
            NotFound: no such run.
        """
        path = TinkerPath.of(run_id, kind, name)
        run = self.get_run(path.run_id)
        if run is None:
            raise NotFound(f"training run {path.run_id!r} not found")
        return CheckpointManifest(
            format=MANIFEST_FORMAT, run_id=run.run_id, kind=path.kind, name=path.name, owner=run.owner,
            session_id=run.session_id, base_model=run.base_model, model_dir=run.model_dir, lora=run.lora,
            settings=run.settings, optimizer_config=run.optimizer_config,
            run_user_metadata=run.user_metadata, run_created_at=run.created_at,
            user_metadata=msgspec.convert(user_metadata, dict[str, str]), size_bytes=size_bytes,
            created_at=self._now(), expires_at=expires_at, public=False,
        )

    def adopt_checkpoint(self, path: TinkerPath) -> CheckpointRow | None:
        """On a shared root, the rows of a checkpoint another node wrote, inserted from its manifest.

        Called when `path` has no row here. The run's row is inserted too if
        this node lacks it. Who may read the result is the caller's check, on
        the row's owner, exactly as for a checkpoint written here.

        Returns:
            The new checkpoint row; None when the root is not shared, there is
            no such directory or manifest, the manifest is refused (logged: it
            is malformed or names another checkpoint), or this node has a run
            of that id with another owner.

        Raises:
            ServerError: the directory resolves outside the root (a planted symlink).
        """
        return self.insert_adopted(path, self.read_adoptable(path))

    def read_adoptable(self, path: TinkerPath) -> CheckpointManifest | None:
        """The file half of `adopt_checkpoint`: the manifest to adopt `path` from, or None; touches no row.

        Raises:
            ServerError: the directory resolves outside the root (a planted symlink).
        """
        if not self.is_shared:
            return None  # alone, a directory without a row is a checkpoint being deleted or never recorded
        directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
        try:
            return read_manifest(directory, path)
        except ManifestError as exc:
            logger.warning("checkpoint_root=%s tinker_path=%s: not adopted: %s", self._checkpoints, path.uri, exc)
            return None

    def insert_adopted(self, path: TinkerPath, manifest: CheckpointManifest | None) -> CheckpointRow | None:
        """The row half of `adopt_checkpoint`, from what `read_adoptable` returned; touches no file."""
        if manifest is None:
            return None
        with _transaction(self._conn):
            run = self.get_run(manifest.run_id)
            if run is None:
                self._conn.execute(
                    "INSERT INTO runs (run_id, session_id, owner, base_model, model_dir, lora, settings,"
                    " user_metadata, optimizer_config, created_us, last_request_us)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        manifest.run_id, manifest.session_id, manifest.owner, manifest.base_model, manifest.model_dir,
                        None if manifest.lora is None else _json(manifest.lora), _json(manifest.settings),
                        _json(manifest.run_user_metadata), _json(manifest.optimizer_config),
                        _to_us(manifest.run_created_at), _to_us(manifest.created_at),
                    ),
                )  # fmt: skip
            elif run.owner != manifest.owner:
                logger.warning(
                    "checkpoint_root=%s tinker_path=%s: not adopted: its manifest's owner differs from run %s's here",
                    self._checkpoints, path.uri, run.run_id,
                )
                return None
            self._conn.execute(
                "INSERT OR IGNORE INTO checkpoints (run_id, kind, name, owner, size_bytes, user_metadata, created_us,"
                " expires_us, public) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    manifest.run_id, manifest.kind.value, manifest.name, manifest.owner, manifest.size_bytes,
                    _json(manifest.user_metadata), _to_us(manifest.created_at),
                    None if manifest.expires_at is None else _to_us(manifest.expires_at), int(manifest.public),
                ),
            )  # fmt: skip
        logger.info("checkpoint_root=%s tinker_path=%s owner=%s: adopted", self._checkpoints, path.uri, manifest.owner)
        return self.get_checkpoint(path.run_id, path.kind, path.name)

    def adopt_run(self, run_id: str) -> RunRow | None:
        """On a shared root, a run's row with each of its checkpoints under the root that this node lacks.

        The REST routes that name a run call it, so that a run another node
        wrote (a dead node's) lists here whole. Directory entries that are not
        checkpoint names (a replace's "#old" aside) are skipped, and each
        checkpoint is adopted as `adopt_checkpoint` does, manifest checks included.

        Returns:
            The run's row; None when the root is not shared or nothing of the run could be adopted.

        Raises:
            BadRequest: an unsafe run id.
            ServerError: the run's directory resolves outside the root.
        """
        if not self.is_shared:
            return None
        for path in self.run_checkpoint_paths(run_id):
            if self.get_checkpoint(path.run_id, path.kind, path.name) is None:
                self.adopt_checkpoint(path)
        return self.get_run(run_id)

    def run_checkpoint_paths(self, run_id: str) -> list[TinkerPath]:
        """The checkpoints under a run's directory on a shared root ([] when not shared); touches no row.

        A directory listing of the shared root: `adopt_run` reads it, and the daemon in a thread.

        Raises:
            BadRequest: an unsafe run id.
            ServerError: the run's directory resolves outside the root.
        """
        if not self.is_shared:
            return []
        run_dir = self._checkpoints / validate_name(run_id, "run id")
        self._require_under(run_dir)
        paths: list[TinkerPath] = []
        for kind in CheckpointKind:
            try:
                names = sorted(os.listdir(run_dir / kind.value))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                try:
                    paths.append(TinkerPath.of(run_id, kind, name))
                except BadRequest:
                    continue
        return paths

    # --- requests -----------------------------------------------------------------------------------

    def record_request(self, request_id: str, model_id: str, kind: str) -> None:
        """Note a request whose future is pending. Raises Conflict if the id is taken.

        On the request's own path, before its id is answered: a daemon killed later answers
        the id with 410, on which the SDK resubmits the request (404 would fail the client).
        """
        try:
            self._log.execute(
                "INSERT INTO requests (request_id, model_id, kind, state, created_us) VALUES (?, ?, ?, ?, ?)",
                (request_id, model_id, kind, RequestState.PENDING, _to_us(self._now())),
            )
        except sqlite3.IntegrityError:
            raise Conflict(f"request {request_id!r} already exists") from None

    def finish_requests(self, finished: Sequence[RequestFinish]) -> None:
        """Note, in one transaction, that these requests' results are in (the future table
        batches them off the request path). An unknown or already finished id changes nothing."""
        with _transaction(self._log):
            self._log.executemany(
                "UPDATE requests SET state = ?, finished_us = ? WHERE request_id = ? AND state = ?",
                [(RequestState.DONE, _to_us(r.finished), r.request_id, RequestState.PENDING) for r in finished],
            )

    def request_state(self, request_id: str) -> RequestState | None:
        row = self._one("SELECT state FROM requests WHERE request_id = ?", (request_id,))
        return None if row is None else RequestState(row[0])

    def prune_requests(self, finished_before: datetime) -> int:
        """Forget done and lost requests finished before a time; returns how many."""
        return self._conn.execute(
            "DELETE FROM requests WHERE state != ? AND finished_us < ?",
            (RequestState.PENDING, _to_us(finished_before)),
        ).rowcount

    # --- checkpoint lifecycle, projects, audit and usage (issue 5) ----------------------------------

    def set_checkpoint_public(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> None:
        """Publish (other users may read it) or unpublish a checkpoint: its row, then its manifest. Raises NotFound.

        The daemon runs the halves apart: `set_checkpoint_public_row` on the event loop,
        `update_manifest` in a thread (actors/checkpoints.py).
        """
        self.update_manifest(self.set_checkpoint_public_row(run_id, kind, name, public), public=public)

    def set_checkpoint_public_row(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> TinkerPath:
        """The row half of `set_checkpoint_public`; touches no file. Raises NotFound."""
        path = TinkerPath.of(run_id, kind, name)
        updated = self._conn.execute(
            "UPDATE checkpoints SET public = ? WHERE run_id = ? AND kind = ? AND name = ?",
            (int(public), path.run_id, path.kind.value, path.name),
        ).rowcount
        if updated == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def set_checkpoint_expiry(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> None:
        """Set (or, with None, remove) when a checkpoint expires: its row, then its manifest. Raises NotFound."""
        self.update_manifest(self.set_checkpoint_expiry_row(run_id, kind, name, expires_at), expires_at=expires_at)

    def set_checkpoint_expiry_row(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> TinkerPath:
        """The row half of `set_checkpoint_expiry`; touches no file. Raises NotFound."""
        path = TinkerPath.of(run_id, kind, name)
        updated = self._conn.execute(
            "UPDATE checkpoints SET expires_us = ? WHERE run_id = ? AND kind = ? AND name = ?",
            (None if expires_at is None else _to_us(expires_at), path.run_id, path.kind.value, path.name),
        ).rowcount
        if updated == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def update_manifest(self, path: TinkerPath, **changes: object) -> None:
        """Rewrite a checkpoint's manifest with `changes`, so that a node adopting it later sees them.

        The new manifest is written and fsynced in staging, then renamed over
        the old one: a reader sees one or the other, whole. A checkpoint with no
        valid manifest (written before manifests), or deleted meanwhile, is left
        as it is. Touches no row (for a worker thread).
        """
        try:
            directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
            manifest = read_manifest(directory, path)
        except (ManifestError, ServerError) as exc:  # the row changed; a planted symlink is never written through
            logger.warning("tinker_path=%s: manifest not updated: %s", path.uri, exc)
            return
        if manifest is None:
            return
        staging = self.staging_dir()
        try:
            write_manifest(staging, msgspec.structs.replace(manifest, **changes))
            _fsync_tree(staging)
            os.replace(staging / MANIFEST_NAME, directory / MANIFEST_NAME)
            _fsync_dir(directory)
        except FileNotFoundError as exc:  # a delete moved the directory away after the read
            logger.warning("tinker_path=%s: manifest not updated: %s", path.uri, exc)
            shutil.rmtree(staging, ignore_errors=True)
            return
        staging.rmdir()

    def expired_checkpoints(self, now: datetime) -> list[CheckpointRow]:
        """Checkpoints whose expiry is at or before `now`, oldest expiry first."""
        rows = self._conn.execute(
            "SELECT * FROM checkpoints WHERE expires_us IS NOT NULL AND expires_us <= ? ORDER BY expires_us",
            (_to_us(now),),
        )
        return [_checkpoint_row(row) for row in rows]

    def set_session_project(self, session_id: str, project_id: str) -> None:
        """Move a session (and so its runs and checkpoints) into a project. Raises NotFound."""
        updated = self._conn.execute(
            "UPDATE sessions SET project_id = ? WHERE session_id = ?", (project_id, session_id)
        ).rowcount
        if updated == 0:
            raise NotFound(f"session {session_id!r} not found")

    def all_sessions(self, owner: str) -> list[SessionRow]:
        """Every session of `owner`, newest first (for search, which filters in Python)."""
        rows = self._conn.execute(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created_us DESC, session_id DESC", (owner,)
        )
        return [_session_row(row) for row in rows]

    def session_requests(self, session_id: str) -> list[tuple[str, str, str, datetime, datetime | None]]:
        """(request_id, model_id, kind, created, finished) of the session's logged requests, oldest first."""
        rows = self._conn.execute(
            "SELECT request_id, model_id, kind, created_us, finished_us FROM requests"
            " WHERE model_id >= ? AND model_id < ? ORDER BY created_us",
            (session_id + ":", session_id + ";"),  # ';' sorts right after ':': a prefix range
        )
        return [(r[0], r[1], r[2], _at(r[3]), _from_us(r[4])) for r in rows]

    def storage_by_project(self, owner: str) -> list[tuple[str | None, int, int]]:
        """(project_id, checkpoint count, bytes) of `owner`'s checkpoints, by their session's project."""
        rows = self._conn.execute(
            "SELECT s.project_id, count(*), coalesce(sum(c.size_bytes), 0) FROM checkpoints c"
            " LEFT JOIN runs r ON r.run_id = c.run_id LEFT JOIN sessions s ON s.session_id = r.session_id"
            " WHERE c.owner = ? GROUP BY s.project_id ORDER BY s.project_id",
            (owner,),
        )
        return [(r[0], int(r[1]), int(r[2])) for r in rows]

    def record_audit(self, owner: str, event: str, details: dict[str, str]) -> None:
        """Append one audit event (`<resource>_<action>`) of `owner`'s."""
        self._conn.execute(
            "INSERT INTO audit (owner, event, details, at_us) VALUES (?, ?, ?, ?)",
            (owner, event, _json(details), _to_us(self._now())),
        )

    def audit_events(self, owner: str, since: datetime, until: datetime) -> list[tuple[datetime, str, dict[str, str]]]:
        """`owner`'s audit events in [since, until), oldest first."""
        rows = self._conn.execute(
            "SELECT at_us, event, details FROM audit WHERE owner = ? AND at_us >= ? AND at_us < ? ORDER BY at_us, rowid",
            (owner, _to_us(since), _to_us(until)),
        )
        return [(_at(r[0]), r[1], _decode_str_dict(r[2])) for r in rows]

    def add_usage(self, rows: list[UsageRow]) -> None:
        """Add token counts into their hourly buckets (one transaction)."""
        with _transaction(self._conn):
            for row in rows:
                self._conn.execute(
                    "INSERT INTO usage (bucket_us, session_id, owner, base_model, kind, tokens)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (bucket_us, session_id, base_model, kind)"
                    " DO UPDATE SET tokens = tokens + excluded.tokens",
                    (_to_us(row.bucket_start), row.session_id, row.owner, row.base_model, row.kind, row.tokens),
                )

    def usage(self, owner: str, since: datetime, until: datetime) -> list[UsageRow]:
        """`owner`'s hourly token counts with buckets starting in [since, until)."""
        rows = self._conn.execute(
            "SELECT * FROM usage WHERE owner = ? AND bucket_us >= ? AND bucket_us < ?"
            " ORDER BY bucket_us, tokens DESC",
            (owner, _to_us(since), _to_us(until)),
        )
        return [
            UsageRow(
                bucket_start=_at(r["bucket_us"]), session_id=r["session_id"], owner=r["owner"],
                base_model=r["base_model"], kind=r["kind"], tokens=int(r["tokens"]),
            )
            for r in rows
        ]

    # --- observability ------------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        checkpoints = self._one("SELECT count(*), coalesce(sum(size_bytes), 0) FROM checkpoints", ())
        assert checkpoints is not None
        return StoreStatistics(
            sessions=self._count("SELECT count(*) FROM sessions"),
            runs=self._count("SELECT count(*) FROM runs"),
            samplers=self._count("SELECT count(*) FROM samplers"),
            checkpoints=int(checkpoints[0]),
            checkpoint_bytes=int(checkpoints[1]),
            pending_requests=self._count("SELECT count(*) FROM requests WHERE state = ?", (RequestState.PENDING,)),
        )


# --- opening and recovery -------------------------------------------------------------------------


def _connect(db_path: Path) -> sqlite3.Connection:
    # isolation_level=None: every statement commits on its own; the few
    # multi-statement steps use _transaction explicitly.
    conn = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL, not NORMAL: NORMAL may lose the last commits on power loss,
        # and a run or checkpoint row must outlive the node, not just the process.
        conn.execute("PRAGMA synchronous = FULL")
        with _transaction(conn):
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
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class _CheckpointLayout(msgspec.Struct, frozen=True):
    """Where a store keeps checkpoints and stages them, fixed at open."""

    root: Path  # the checkpoint root as configured
    resolved_root: Path  # what every checkpoint path must resolve under
    staging: Path  # this node's own staging; on the root's filesystem
    replaced_suffix: str  # the name a replace moves the old directory aside under
    is_shared: bool


def _checkpoint_layout(data_dir: Path, checkpoint_root: Path | None) -> _CheckpointLayout:
    """The layout for `data_dir`, alone or on a shared root, or ServerError if the root is not a directory."""
    if checkpoint_root is None:
        # The resolved data dir, then "checkpoints" unresolved: a symlinked checkpoints/ is refused.
        return _CheckpointLayout(
            root=data_dir / "checkpoints", resolved_root=data_dir.resolve() / "checkpoints",
            staging=data_dir / "tmp", replaced_suffix=_REPLACED_SUFFIX, is_shared=False,
        )
    root = checkpoint_root.expanduser().absolute()
    # Never created here: a missing root is an unmounted share, and checkpoints
    # written to the local disk in its place would be invisible to every other node.
    if not root.is_dir():
        raise ServerError(f"checkpoint_root {root} is not an existing directory (is the shared filesystem mounted?)")
    node_id = _node_id(data_dir)
    return _CheckpointLayout(
        root=root, resolved_root=root.resolve(), staging=root / SHARED_STAGING_DIR / node_id,
        replaced_suffix=f"{_REPLACED_SUFFIX}-{node_id}", is_shared=True,
    )


def _node_id(data_dir: Path) -> str:
    """This data dir's node id (16 hex characters), made on first use and kept in <data_dir>/node_id.

    It names this node's staging on a shared root; the data dir's lock makes
    it one node's at a time, and it outlives restarts so recovery finds its own leftovers.
    """
    path = data_dir / NODE_ID_FILE
    try:
        node_id = path.read_text().strip()
    except FileNotFoundError:
        node_id = secrets.token_hex(8)
        partial = data_dir / f"{NODE_ID_FILE}.partial"
        with partial.open("w") as file:
            file.write(node_id + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.rename(partial, path)
        _fsync_dir(data_dir)
        return node_id
    if len(node_id) != 16 or any(c not in "0123456789abcdef" for c in node_id):
        raise ServerError(f"{path} holds {node_id!r}; expected 16 lowercase hex characters (delete it to make a new one)")
    return node_id


def _remove_staging(tmp: Path) -> None:
    """Empty this node's staging: whatever is there was being written or deleted when the daemon died."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700, parents=True)


def _recover_replaces(checkpoints: Path, suffix: str) -> None:
    """Finish or undo replaces a crash interrupted (see `Store.commit_dir`).

    "<name><suffix>" next to "<name>": the new one was in place; drop the old.
    "<name><suffix>" alone: the crash came between the two renames; put it back.
    On a shared root the suffix names this node, so another node's replace in
    progress is never touched.
    """
    for aside in checkpoints.glob(f"*/*/*{suffix}"):
        final = aside.with_name(aside.name[: -len(suffix)])
        if os.path.lexists(final):
            shutil.rmtree(aside)
        else:
            os.rename(aside, final)
            _fsync_dir(final.parent)
            logger.warning("restored checkpoint dir %s after an interrupted replace", final)


# --- fsync ----------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file and directory under `top`, refusing anything else.

    A symlink or device inside a checkpoint would be followed by whoever
    loads it later, so only plain files and directories are accepted.
    """
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        for entry in (*filenames, *dirnames):
            mode = os.lstat(os.path.join(dirpath, entry)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ServerError(f"{os.path.join(dirpath, entry)}: a checkpoint holds only files and directories")
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


# --- row decoding ---------------------------------------------------------------------------------

_decode_str_dict = msgspec.json.Decoder(dict[str, str]).decode
_decode_json_dict = msgspec.json.Decoder(dict[str, JsonScalar]).decode
_decode_tags = msgspec.json.Decoder(tuple[str, ...]).decode


def _session_row(row: sqlite3.Row) -> SessionRow:
    return SessionRow(
        session_id=row["session_id"],
        owner=row["owner"],
        tags=_decode_tags(row["tags"]),
        user_metadata=_decode_str_dict(row["user_metadata"]),
        sdk_version=row["sdk_version"],
        project_id=row["project_id"],
        display_name=row["display_name"],
        created_at=_at(row["created_us"]),
        last_heartbeat_at=_at(row["heartbeat_us"]),
        finished_at=_from_us(row["finished_us"]),
        finish_reason=row["finish_reason"],
        finish_detail=row["finish_detail"],
    )


def _run_row(row: sqlite3.Row) -> RunRow:
    return RunRow(
        run_id=row["run_id"],
        session_id=row["session_id"],
        owner=row["owner"],
        base_model=row["base_model"],
        model_dir=row["model_dir"],
        lora=None if row["lora"] is None else _decode_json_dict(row["lora"]),
        settings=_decode_json_dict(row["settings"]),
        user_metadata=_decode_str_dict(row["user_metadata"]),
        optimizer_config=_decode_json_dict(row["optimizer_config"]),
        created_at=_at(row["created_us"]),
        last_request_at=_at(row["last_request_us"]),
        corrupted=bool(row["corrupted"]),
    )


def _checkpoint_row(row: sqlite3.Row) -> CheckpointRow:
    return CheckpointRow(
        run_id=row["run_id"],
        kind=CheckpointKind(row["kind"]),
        name=row["name"],
        owner=row["owner"],
        created_at=_at(row["created_us"]),
        size_bytes=row["size_bytes"],
        user_metadata=_decode_str_dict(row["user_metadata"]),
        expires_at=_from_us(row["expires_us"]),
        public=bool(row["public"]),
    )
