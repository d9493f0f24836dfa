"""Sessions: the ServiceClient sessions this node is home to, or mirrors for another node.

It owns a session's record (created, heartbeats, finished) through the store,
and the ownership rule for sessions: a session that is not the caller's is a
404, as if it did not exist. It validates a session's `openrl.*` tags and
user_metadata at creation, so a bad tag fails at the first call, not at the
first model. It also makes and takes the `SessionSnapshot` that the relay sends
with a request placed on another node.

It never touches jobs, groups or sampling sessions: what ends with a session
(its jobs with a group of their own) is the job table's (actors/jobs.py).
Sync, no trio; its methods never wait.
"""

from __future__ import annotations

import msgspec

from openrld import ids, settings as job_settings
from openrld.actors.durable_commits import DurableCommits
from openrld.errors import Gone, NotFound
from openrld.store import SessionRow, Store

# The sdk_version of a session recorded by adoption, which knew only its id and owner (no SDK sends it).
ADOPTED_SESSION = "unknown (recorded by adoption)"


class SessionSnapshot(msgspec.Struct, frozen=True):
    """A session as its home node sends it with a relayed request, for the node the job is placed on."""

    session_id: str
    owner: str
    tags: list[str]
    user_metadata: dict[str, str]
    sdk_version: str
    project_id: str | None
    display_name: str | None


class SessionTable:
    def __init__(self, *, store: Store, commits: DurableCommits | None = None, id_tag: str = "") -> None:
        self._store = store
        self._commits = commits if commits is not None else DurableCommits(store.database.sync)
        self._id_tag = id_tag  # a clustered node's tag, at the front of the ids it mints (ids.node_tag)

    async def create(
        self, owner: str, *, tags: list[str], user_metadata: dict[str, str], sdk_version: str,
        project_id: str | None, display_name: str | None,
    ) -> str:
        """create_session: a new session of `owner`'s, on disk when this returns; returns its id.

        Raises:
            BadRequest: an `openrl.*` tag or user_metadata key is unknown or has a bad value.
        """
        job_settings.parse_settings(tags, user_metadata, {})
        session_id = ids.new_session_id(self._id_tag)
        self._store.sessions.create(
            session_id, owner=owner, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version,
            project_id=project_id, display_name=display_name,
        )
        await self._commits.durable()
        return session_id

    def owned(self, owner: str, session_id: str) -> SessionRow:
        """The session's record. Raises NotFound for a session that is not `owner`'s."""
        row = self._store.sessions.get(session_id)
        if row is None or row.owner != owner:
            raise NotFound(f"no session {session_id!r}")
        return row

    def is_finished(self, session_id: str) -> bool:
        """Whether the session is known here and has finished."""
        row = self._store.sessions.get(session_id)
        return row is not None and row.is_finished

    def is_home_to(self, session_id: str) -> bool:
        return self._store.sessions.get(session_id) is not None

    def heartbeat(self, owner: str, session_id: str) -> None:
        """Raises NotFound for a session not `owner`'s, Gone for a finished one."""
        row = self.owned(owner, session_id)
        if row.is_finished:
            raise Gone(f"session {session_id} has finished")
        self._store.sessions.heartbeat(session_id)

    def finish(self, owner: str, session_id: str, reason: str, detail: str | None) -> None:
        """Record the finish (the first reason given is kept). Raises NotFound for a session not `owner`'s."""
        self.owned(owner, session_id)
        self._store.sessions.finish(session_id, reason, detail)

    def snapshot(self, session_id: str) -> SessionSnapshot | None:
        """This node's session `session_id`, to send along with a request relayed to another node."""
        row = self._store.sessions.get(session_id)
        if row is None or row.sdk_version == ADOPTED_SESSION:
            return None
        return SessionSnapshot(
            session_id=row.session_id, owner=row.owner, tags=list(row.tags), user_metadata=dict(row.user_metadata),
            sdk_version=row.sdk_version, project_id=row.project_id, display_name=row.display_name,
        )

    def mirror_adopted(self, session_id: str, owner: str) -> None:
        """Record the session of a job this node adopted, if it holds no record of it: the id and owner
        are all the job's run says, enough for its finish to reach the job here (the home finishes it on
        every member holding its jobs). The home's first relayed account of it fills in the rest; until
        then, this record is never sent on as the session's account (`snapshot`)."""
        if self._store.sessions.get(session_id) is None:
            self._store.sessions.create(
                session_id, owner=owner, tags=[], user_metadata={}, sdk_version=ADOPTED_SESSION,
                project_id=None, display_name=None,
            )

    def mirror(self, snapshot: SessionSnapshot) -> None:
        """Record another node's session here, so that jobs and samplers placed here can belong to it.

        The home node keeps the heartbeats and the finish; the mirror carries
        what settings and ownership need (tags, user_metadata, owner).
        """
        row = self._store.sessions.get(snapshot.session_id)
        if row is not None:
            if row.sdk_version == ADOPTED_SESSION and row.owner == snapshot.owner:
                # A mirror made by adoption knew only the id and owner: the home's account replaces it.
                self._store.sessions.refresh(
                    snapshot.session_id, snapshot.tags, snapshot.user_metadata, snapshot.sdk_version,
                    snapshot.project_id, snapshot.display_name,
                )
            return
        self._store.sessions.create(
            snapshot.session_id, owner=snapshot.owner, tags=snapshot.tags, user_metadata=snapshot.user_metadata,
            sdk_version=snapshot.sdk_version, project_id=snapshot.project_id, display_name=snapshot.display_name,
        )
