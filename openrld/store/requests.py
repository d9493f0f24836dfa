"""The request log: every request whose future was handed out, pending until its result is in.

It owns the `requests` table, written on the database's second connection
(it must outlive the process, not the machine, so nothing awaits a sync for
it; database.py says how commits are made durable). At open, requests left pending by a dead daemon become
"lost", so their ids answer 410 instead of polling forever; finished ones are
forgotten after REQUEST_LOG_KEEP. It never touches checkpoint files.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from datetime import datetime, timedelta

from openrld.errors import Conflict
from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import RequestFinish, RequestState

# How long a lost request id still answers 410 rather than 404 after a restart.
REQUEST_LOG_KEEP = timedelta(days=7)


class RequestLog(Repository):
    def record(self, request_id: str, model_id: str, kind: str) -> None:
        """Note a request whose future is pending. Raises Conflict if the id is taken.

        On the request's own path, before its id is answered: a daemon killed later answers
        the id with 410, on which the SDK resubmits the request (404 would fail the client).
        """
        try:
            self._db.log.execute(
                "INSERT INTO requests (request_id, model_id, kind, state, created_us) VALUES (?, ?, ?, ?, ?)",
                (request_id, model_id, kind, RequestState.PENDING, db.to_us(self._db.now())),
            )
        except sqlite3.IntegrityError:
            raise Conflict(f"request {request_id!r} already exists") from None

    def finish(self, finished: Sequence[RequestFinish]) -> None:
        """Note, in one transaction, that these requests' results are in (the future table
        batches them off the request path). An unknown or already finished id changes nothing."""
        with db.transaction(self._db.log):
            self._db.log.executemany(
                "UPDATE requests SET state = ?, finished_us = ? WHERE request_id = ? AND state = ?",
                [(RequestState.DONE, db.to_us(r.finished), r.request_id, RequestState.PENDING) for r in finished],
            )

    def state(self, request_id: str) -> RequestState | None:
        row = self._db.one("SELECT state FROM requests WHERE request_id = ?", (request_id,))
        return None if row is None else RequestState(row[0])

    def pending(self) -> int:
        return self._db.count("SELECT count(*) FROM requests WHERE state = ?", (RequestState.PENDING,))

    def mark_all_lost(self, now: datetime) -> None:
        """At open: results lived in the dead process's memory, so a request it finished
        but nobody read is as lost as one it never ran."""
        self._db.conn.execute(
            "UPDATE requests SET state = ?, finished_us = coalesce(finished_us, ?) WHERE state != ?",
            (RequestState.LOST, db.to_us(now), RequestState.LOST),
        )

    def prune(self, finished_before: datetime) -> int:
        """Forget done and lost requests finished before a time; returns how many."""
        return self._db.conn.execute(
            "DELETE FROM requests WHERE state != ? AND finished_us < ?",
            (RequestState.PENDING, db.to_us(finished_before)),
        ).rowcount

    def of_session(self, session_id: str) -> list[tuple[str, str, str, datetime, datetime | None]]:
        """(request_id, model_id, kind, created, finished) of the session's logged requests, oldest first."""
        rows = self._db.conn.execute(
            "SELECT request_id, model_id, kind, created_us, finished_us FROM requests"
            " WHERE model_id >= ? AND model_id < ? ORDER BY created_us",
            (session_id + ":", session_id + ";"),  # ';' sorts right after ':': a prefix range
        )
        return [(r[0], r[1], r[2], db.at(r[3]), db.from_us(r[4])) for r in rows]
