"""How a relayed call reaches the node that answers it, and its answer comes back.

Another member is reached through the peer client, with the caller's own
headers and, for a request that creates a job, the caller's session signed
(`relayed_session.py`); this node through its own app, whose answer is kept
rather than sent. A home that is lost is tried once more, briefly (a node
declared dead may only have been slow), and otherwise answered with a 410
naming the node and the last checkpoint to restore from. Which node is the
home is the relay's to say (`relay.py`); this module only goes there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from openrld.actors.sessions import SessionSnapshot
from openrld.api.asgi import replay
from openrld.cluster.body_ids import Call
from openrld.cluster.directory import Directory, Home, Where
from openrld.cluster.membership.messages import MemberState
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import (
    CONNECT_S,
    DEAD_CONNECT_S,
    RELAY_FAILED,
    Answer,
    PeerClient,
    RelayCounters,
    detail_answer,
)
from openrld.cluster.relayed_session import session_headers


class Reach:
    """Sends a call to a member, or through this node's own app, and brings its answer back."""

    def __init__(
        self,
        inner: Callable[..., Awaitable[None]],
        *,
        directory: Directory,
        peers: PeerClient,
        key: bytes,
        counters: RelayCounters,
        session_snapshot: Callable[[str], SessionSnapshot | None],
    ) -> None:
        self._inner = inner  # this node's own app
        self._directory = directory
        self._peers = peers
        self._key = key  # relay_key(cluster secret): signs the sessions creating requests carry
        self._counters = counters  # ids lost with their node
        self._session_snapshot = session_snapshot

    async def to(self, call: Call, home: Home, what: str) -> Answer | None:
        """`call` sent to `home`; None where this node answers it (the home is here, or unknown)."""
        if home.where in (Where.LOCAL, Where.UNKNOWN):
            return None
        assert home.member is not None
        if home.where is Where.LOST:
            answer = await self.if_it_answers(call, home, what)
            if answer is not None:
                return answer
            self._counters.lost += 1
            return detail_answer(410, _lost_detail(what, home))
        return await self.forward(call, home.member, what)

    async def if_it_answers(self, call: Call, home: Home, what: str) -> Answer | None:
        """A node declared dead may have been only slow (a loaded machine, a short partition): if it still
        answers at once, its answer stands and the job is not lost. A node that left is gone for good."""
        assert home.member is not None
        if home.member.state is not MemberState.DEAD:
            return None
        answer = await self.forward(call, home.member, what, connect_timeout_s=DEAD_CONNECT_S)
        return None if answer.status == 503 and RELAY_FAILED in answer.body.decode(errors="replace") else answer

    async def forward(self, call: Call, member: Member, what: str, connect_timeout_s: float = CONNECT_S) -> Answer:
        """`call` relayed to `member`; a creating request carries its caller's session, signed."""
        snapshot = self._session_snapshot(call.session_id) if call.session_id else None
        extra = session_headers(snapshot, self._key) if snapshot is not None else []
        return await self._peers.relay(
            member, call.scope, call.body, what, extra_headers=extra, connect_timeout_s=connect_timeout_s
        )

    def asker(self, call: Call, what: str) -> Callable[[Member, dict], Awaitable[Answer]]:
        """Asks one member, this node included, `call` under another scope (a list's page, a finish)."""

        async def ask(member: Member, scope: dict) -> Answer:
            if member.name == self._directory.local_name:
                return await self.local(scope, call.body)
            return await self.forward(replace(call, scope=scope), member, what)

        return ask

    async def local(self, scope: dict, body: bytes) -> Answer:
        """Run a request through this node's own app and keep its answer."""
        answer: dict[str, Any] = {"headers": [], "body": b""}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")

        await self._inner(scope, replay(body), capture)
        headers = [(k, v) for k, v in answer["headers"] if k != b"content-length"]
        return Answer(answer.get("status", 500), headers, answer["body"])


def _lost_detail(what: str, home: Home) -> str:
    assert home.member is not None
    state = home.member.state.name.lower()
    restore = home.note.last_checkpoint if home.note is not None else ""
    hint = (
        f"its last checkpoint is {restore}: resume with create_training_client_from_state"
        if restore else "it saved no checkpoint this cluster knows of"
    )
    return f"{what} was lost with node {home.member.name} ({state}); {hint}"
