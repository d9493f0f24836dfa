"""Session rows: a client's session from create_session to its finish, and its project.

It owns the `sessions` table: creating a session, heartbeats, the first
finish reason, project assignment and the owner's listings. Who may see a
session is the caller's check on `owner`. It never touches checkpoint files.
"""

from __future__ import annotations

import builtins
import sqlite3

from openrld.errors import Gone, NotFound
from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import SessionRow


class SessionRepository(Repository):
    def create(
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
        now_us = db.to_us(self._db.now())
        self._insert_new(
            "INSERT INTO sessions (session_id, owner, tags, user_metadata, sdk_version, project_id,"
            " display_name, created_us, heartbeat_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                session_id, owner, db.json(list(tags)), db.user_metadata(user_metadata, "session"),
                sdk_version, project_id, display_name, now_us, now_us,
            ),
            f"session {session_id!r}",
        )  # fmt: skip
        row = self.get(session_id)
        assert row is not None
        return row

    def get(self, session_id: str) -> SessionRow | None:
        row = self._db.one("SELECT * FROM sessions WHERE session_id = ?", (session_id,))
        return None if row is None else _session_row(row)

    def list(self, owner: str, limit: int, offset: int) -> list[SessionRow]:
        """`owner`'s sessions, newest first."""
        limit, offset = db.page(limit, offset)
        rows = self._db.conn.execute(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        return [_session_row(row) for row in rows]

    def all(self, owner: str) -> builtins.list[SessionRow]:  # `list` in this class is the method above
        """Every session of `owner`, newest first (for search, which filters in Python)."""
        rows = self._db.conn.execute(
            "SELECT * FROM sessions WHERE owner = ? ORDER BY created_us DESC, session_id DESC", (owner,)
        )
        return [_session_row(row) for row in rows]

    def heartbeat(self, session_id: str) -> None:
        """Note that the session's client is alive.

        Raises:
            NotFound: no such session.
            Gone: the session has finished (the SDK stops heartbeating on 410).
        """
        updated = self._db.conn.execute(
            "UPDATE sessions SET heartbeat_us = ? WHERE session_id = ? AND finish_reason IS NULL",
            (db.to_us(self._db.now()), session_id),
        ).rowcount
        if updated == 0:
            session = self.get(session_id)
            if session is None:
                raise NotFound(f"session {session_id!r} not found")
            raise Gone(f"session {session_id!r} has finished ({session.finish_reason})")

    def finish(self, session_id: str, reason: str, detail: str | None) -> bool:
        """End a session. The first reason wins; returns whether this call's did.

        Raises:
            NotFound: no such session.
        """
        updated = self._db.conn.execute(
            "UPDATE sessions SET finished_us = ?, finish_reason = ?, finish_detail = ?"
            " WHERE session_id = ? AND finish_reason IS NULL",
            (db.to_us(self._db.now()), reason, detail, session_id),
        ).rowcount
        if updated == 0 and self.get(session_id) is None:
            raise NotFound(f"session {session_id!r} not found")
        return updated == 1

    def refresh(
        self,
        session_id: str,
        tags: builtins.list[str],
        user_metadata: dict[str, str],
        sdk_version: str,
        project_id: str | None,
        display_name: str | None,
    ) -> None:
        """Replace what a mirrored session says of itself with its home's newer account. Raises NotFound."""
        updated = self._db.conn.execute(
            "UPDATE sessions SET tags = ?, user_metadata = ?, sdk_version = ?, project_id = ?, display_name = ?"
            " WHERE session_id = ?",
            (
                db.json(list(tags)), db.user_metadata(user_metadata, "session"), sdk_version, project_id,
                display_name, session_id,
            ),
        ).rowcount  # fmt: skip
        if updated == 0:
            raise NotFound(f"session {session_id!r} not found")

    def set_project(self, session_id: str, project_id: str) -> None:
        """Move a session (and so its runs and checkpoints) into a project. Raises NotFound."""
        updated = self._db.conn.execute(
            "UPDATE sessions SET project_id = ? WHERE session_id = ?", (project_id, session_id)
        ).rowcount
        if updated == 0:
            raise NotFound(f"session {session_id!r} not found")


def _session_row(row: sqlite3.Row) -> SessionRow:
    return SessionRow(
        session_id=row["session_id"],
        owner=row["owner"],
        tags=db.decode_tags(row["tags"]),
        user_metadata=db.decode_str_dict(row["user_metadata"]),
        sdk_version=row["sdk_version"],
        project_id=row["project_id"],
        display_name=row["display_name"],
        created_at=db.at(row["created_us"]),
        last_heartbeat_at=db.at(row["heartbeat_us"]),
        finished_at=db.from_us(row["finished_us"]),
        finish_reason=row["finish_reason"],
        finish_detail=row["finish_detail"],
    )
