"""Checkpoint rows: which checkpoints exist, whose they are, their size, expiry and publication.

It owns the `checkpoints` table. A row is added only once its directory is
in place (checkpoint_files.py) and removed before its directory is, so a
listed checkpoint always has its files. It never touches the files itself.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime

from openrld.checkpoint_manifest import CheckpointManifest
from openrld.errors import NotFound
from openrld.ids import CheckpointKind, TinkerPath, parse_checkpoint_kind
from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import CheckpointRow

_COLUMNS = "(run_id, kind, name, owner, size_bytes, user_metadata, created_us, expires_us, public)"


class CheckpointRepository(Repository):
    def add(
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
        self._insert_new(
            f"{verb} INTO checkpoints {_COLUMNS} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                path.run_id, path.kind.value, path.name, owner, size_bytes,
                db.user_metadata(user_metadata, "checkpoint"), db.to_us(created_at or self._db.now()),
                None if expires_at is None else db.to_us(expires_at), int(public),
            ),
            f"checkpoint {path.uri}",
        )  # fmt: skip
        row = self.get(path.run_id, path.kind, path.name)
        assert row is not None
        return row

    def insert_from_manifest(self, manifest: CheckpointManifest) -> None:
        """The checkpoint's row as its manifest describes it, unless one exists (adoption.py)."""
        self._db.conn.execute(
            f"INSERT OR IGNORE INTO checkpoints {_COLUMNS} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                manifest.run_id, manifest.kind.value, manifest.name, manifest.owner, manifest.size_bytes,
                db.json(manifest.user_metadata), db.to_us(manifest.created_at),
                None if manifest.expires_at is None else db.to_us(manifest.expires_at), int(manifest.public),
            ),
        )  # fmt: skip

    def get(self, run_id: str, kind: CheckpointKind | str, name: str) -> CheckpointRow | None:
        row = self._db.one(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
            (run_id, parse_checkpoint_kind(kind).value, name),
        )
        return None if row is None else _checkpoint_row(row)

    def of_run(self, run_id: str) -> list[CheckpointRow]:
        """The run's checkpoints, oldest first."""
        rows = self._db.conn.execute(
            "SELECT * FROM checkpoints WHERE run_id = ? ORDER BY created_us, rowid", (run_id,)
        )
        return [_checkpoint_row(row) for row in rows]

    def of_owner(self, owner: str, limit: int, offset: int) -> tuple[list[CheckpointRow], int]:
        """A page of `owner`'s checkpoints across runs, newest first, and how many they have in all."""
        limit, offset = db.page(limit, offset)
        rows = self._db.conn.execute(
            "SELECT * FROM checkpoints WHERE owner = ? ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        page = [_checkpoint_row(row) for row in rows]
        return page, self._db.count("SELECT count(*) FROM checkpoints WHERE owner = ?", (owner,))

    def last(self, run_id: str, kind: CheckpointKind | str) -> CheckpointRow | None:
        """The run's newest checkpoint of `kind`, if any."""
        row = self._db.one(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? ORDER BY created_us DESC, rowid DESC LIMIT 1",
            (run_id, parse_checkpoint_kind(kind).value),
        )
        return None if row is None else _checkpoint_row(row)

    def has_public(self, run_id: str) -> bool:
        return self._db.one("SELECT 1 FROM checkpoints WHERE run_id = ? AND public = 1 LIMIT 1", (run_id,)) is not None

    def expired(self, now: datetime) -> list[CheckpointRow]:
        """Checkpoints whose expiry is at or before `now`, oldest expiry first."""
        rows = self._db.conn.execute(
            "SELECT * FROM checkpoints WHERE expires_us IS NOT NULL AND expires_us <= ? ORDER BY expires_us",
            (db.to_us(now),),
        )
        return [_checkpoint_row(row) for row in rows]

    def delete(self, run_id: str, kind: CheckpointKind | str, name: str) -> TinkerPath:
        """Remove a checkpoint's row; touches no file. Returns the checkpoint's path.

        Raises:
            NotFound: no such checkpoint.
        """
        path = TinkerPath.of(run_id, kind, name)
        deleted = self._db.conn.execute(
            "DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
            (path.run_id, path.kind.value, path.name),
        ).rowcount
        if deleted == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def set_public(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> TinkerPath:
        """Publish (other users may read it) or unpublish a checkpoint's row; touches no file. Raises NotFound."""
        path = TinkerPath.of(run_id, kind, name)
        updated = self._db.conn.execute(
            "UPDATE checkpoints SET public = ? WHERE run_id = ? AND kind = ? AND name = ?",
            (int(public), path.run_id, path.kind.value, path.name),
        ).rowcount
        if updated == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def set_expiry(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> TinkerPath:
        """Set (or, with None, remove) when a checkpoint expires, in its row; touches no file. Raises NotFound."""
        path = TinkerPath.of(run_id, kind, name)
        updated = self._db.conn.execute(
            "UPDATE checkpoints SET expires_us = ? WHERE run_id = ? AND kind = ? AND name = ?",
            (None if expires_at is None else db.to_us(expires_at), path.run_id, path.kind.value, path.name),
        ).rowcount
        if updated == 0:
            raise NotFound(f"checkpoint {path.uri} not found")
        return path

    def usage_of_session(self, session_id: str) -> tuple[int, int]:
        """(count, total size_bytes) of the checkpoints of the session's runs."""
        row = self._db.one(
            "SELECT count(*), coalesce(sum(c.size_bytes), 0) FROM checkpoints c"
            " JOIN runs r ON r.run_id = c.run_id WHERE r.session_id = ?",
            (session_id,),
        )
        assert row is not None
        return int(row[0]), int(row[1])

    def storage_by_project(self, owner: str) -> list[tuple[str | None, int, int]]:
        """(project_id, checkpoint count, bytes) of `owner`'s checkpoints, by their session's project."""
        rows = self._db.conn.execute(
            "SELECT s.project_id, count(*), coalesce(sum(c.size_bytes), 0) FROM checkpoints c"
            " LEFT JOIN runs r ON r.run_id = c.run_id LEFT JOIN sessions s ON s.session_id = r.session_id"
            " WHERE c.owner = ? GROUP BY s.project_id ORDER BY s.project_id",
            (owner,),
        )
        return [(r[0], int(r[1]), int(r[2])) for r in rows]


def _checkpoint_row(row: sqlite3.Row) -> CheckpointRow:
    return CheckpointRow(
        run_id=row["run_id"],
        kind=CheckpointKind(row["kind"]),
        name=row["name"],
        owner=row["owner"],
        created_at=db.at(row["created_us"]),
        size_bytes=row["size_bytes"],
        user_metadata=db.decode_str_dict(row["user_metadata"]),
        expires_at=db.from_us(row["expires_us"]),
        public=bool(row["public"]),
    )
