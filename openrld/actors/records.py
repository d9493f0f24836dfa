"""Records: the durable rows that the REST, lifecycle and admin routes read, and the few they change.

It owns the routes' access to sessions (listing, search, project, the request
log behind a trace), training runs (listing, lookup), the audit log and token
usage, under the API's owner rule: a session that is not the caller's is a
404, exactly as a missing one. Checkpoints are not here: their rows and files
belong to the checkpoint actor (actors/checkpoints.py).

Each call is a short SQLite statement on the daemon's thread; it never
touches a file and never waits. Sync, no trio.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from openrld import ids
from openrld.actors.usage import UsageMeter
from openrld.errors import BadRequest, NotFound
from openrld.store import RunRow, SessionRow, Store, StoreStatistics, UsageRow


class Records:
    def __init__(self, store: Store, usage: UsageMeter) -> None:
        self._sessions = store.sessions
        self._samplers = store.samplers
        self._runs = store.runs
        self._checkpoints = store.checkpoints
        self._requests = store.requests
        self._audit = store.audit
        self._usage_ledger = store.usage_ledger
        self._store = store
        self._usage = usage

    # ------------------------------------------------------------ sessions

    def session(self, session_id: str) -> SessionRow | None:
        return self._sessions.get(session_id)

    def own_session(self, user: str, session_id: str) -> SessionRow:
        """The session if `user` owns it; NotFound otherwise, as for a missing one."""
        row = self._sessions.get(session_id)
        if row is None or row.owner != user:
            raise NotFound(f"no session {session_id!r}")
        return row

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[SessionRow]:
        return self._sessions.list(owner, limit, offset)

    def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """(its training run ids, its sampler ids), each in creation order."""
        return self._runs.of_session(session_id), self._samplers.of_session(session_id)

    def search_sessions(
        self, owner: str, keep: Callable[[SessionRow], bool], *, before: tuple[datetime, str] | None, limit: int
    ) -> list[tuple[SessionRow, int, int]]:
        """Up to `limit` + 1 of `owner`'s sessions that `keep` accepts, newest first, each with its
        checkpoints' (count, bytes); only those strictly before `before` (created_at, session_id)."""
        found: list[tuple[SessionRow, int, int]] = []
        for row in self._sessions.all(owner):
            if before is not None and (row.created_at, row.session_id) >= before:
                continue
            if not keep(row):
                continue
            count, size = self._checkpoints.usage_of_session(row.session_id)
            found.append((row, count, size))
            if len(found) > limit:
                break
        return found

    def assign_project(self, user: str, session_id: str, project_id: str) -> None:
        """Move `user`'s session into a project, and audit it.

        Raises:
            NotFound: no such session of `user`'s.
            BadRequest: an empty or overlong project id.
        """
        self.own_session(user, session_id)
        if not project_id or len(project_id) > ids.MAX_NAME_CHARS:
            raise BadRequest(f"project_id: expected 1..{ids.MAX_NAME_CHARS} characters, got {len(project_id)}")
        self._sessions.set_project(session_id, project_id)
        self._audit.record(user, "project_session_assigned", {"session_id": session_id, "project_id": project_id, "actor": user})

    def session_requests(self, session_id: str) -> list[tuple[str, str, str, datetime, datetime | None]]:
        """(request_id, model_id, kind, created, finished) of the session's logged requests, oldest first."""
        return self._requests.of_session(session_id)

    # ------------------------------------------------------------ training runs

    def run(self, run_id: str) -> RunRow | None:
        return self._runs.get(run_id)

    def list_runs(self, owner: str, limit: int, offset: int, *, accessible: bool) -> tuple[list[RunRow], int]:
        return self._runs.list(owner, limit, offset, accessible=accessible)

    def has_public_checkpoint(self, run_id: str) -> bool:
        return self._checkpoints.has_public(run_id)

    # ------------------------------------------------------------ audit and usage

    def audit(self, owner: str, event: str, details: dict[str, str]) -> None:
        self._audit.record(owner, event, details)

    def audit_events(self, owner: str, since: datetime, until: datetime) -> list[tuple[datetime, str, dict[str, str]]]:
        return self._audit.events(owner, since, until)

    def usage(self, owner: str, since: datetime, until: datetime) -> list[UsageRow]:
        """`owner`'s hourly token counts in [since, until), the meter's latest counts included."""
        self._usage.flush(self._store)
        return self._usage_ledger.of_owner(owner, since, until)

    def storage_by_project(self, owner: str) -> list[tuple[str | None, int, int]]:
        return self._checkpoints.storage_by_project(owner)

    # ------------------------------------------------------------ observability

    def statistics(self) -> StoreStatistics:
        """How many rows of each kind the store holds, for /metrics."""
        return self._store.statistics()
