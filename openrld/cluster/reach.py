"""How a relayed call reaches the node that answers it, and its answer comes back.

Another member is reached through the peer client, with the caller's own
headers and, for a request that creates a job, the caller's session signed
(`relayed_session.py`); this node through its own app, whose answer is kept
rather than sent. A home that is lost is tried once more, briefly (a node
declared dead may only have been slow), and otherwise answered with a 410
naming the node and the last checkpoint to restore from. A lost job that
auto-saves to the shared checkpoint root is not answered so: a survivor is
adopting it (`adoption.py`), so the call waits, up to `ADOPTION_HOLD_S`, for
the directory to show the job's new home, and goes there. Which node is the
home is the relay's to say (`relay.py`); this module only goes there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import trio

from openrld.actors.sessions import SessionSnapshot
from openrld.api.asgi import Reply, detail_reply, replay
from openrld.cluster.body_ids import Call
from openrld.cluster.directory import Directory, Home, Where
from openrld.cluster.membership.messages import MemberState
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import (
    CONNECT_S,
    DEAD_CONNECT_S,
    RELAY_FAILED,
    PeerClient,
    RelayCounters,
)
from openrld.cluster.relayed_session import session_headers

# A call to a job whose home died waits this long at most for a survivor to adopt it; then it is answered
# 503 (the SDK retries). Adopting takes the survivor a group start and a load of the auto-save.
ADOPTION_HOLD_S = 30.0
# Past this long after its home was seen dead, a job nobody adopted is lost (no complete auto-save, no
# survivor that can hold it): its calls are answered 410 as for a job that never auto-saved. Long enough
# for the adopter to load a large base model, and within the SDK's 5 minutes of retrying a request.
ADOPTION_GIVE_UP_S = 240.0
ADOPTION_POLL_S = 0.05


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

    async def to(self, call: Call, home: Home, what: str) -> Reply | None:
        """`call` sent to `home`; None where this node answers it (the home is here, or unknown)."""
        if home.where in (Where.LOCAL, Where.UNKNOWN):
            return None
        assert home.member is not None
        if home.where is Where.LOST:
            answer = await self.if_it_answers(call, home, what)
            if answer is not None:
                return answer
            if is_adoptable(home):
                adopted = await self.adopted_home(what, home)
                if adopted is not None:
                    return await self.to(call, adopted, what)
            return self.unadopted(what, home)
        return await self.forward(call, home.member, what)

    def unadopted(self, what: str, home: Home) -> Reply:
        """The answer for a call to a lost job that no survivor has adopted: 503 while one may yet (the SDK
        retries), else 410 naming the node and what to restore from."""
        if is_adoptable(home) and not _gave_up(home):
            return detail_reply(503, _adopting_detail(what, home))
        self._counters.lost += 1
        return detail_reply(410, _lost_detail(what, home))

    async def adopted_home(self, model_id: str, lost: Home) -> Home | None:
        """The home of job `model_id` once a survivor has adopted it (this node, or a live member);
        None if none has within ADOPTION_HOLD_S, or ever will (ADOPTION_GIVE_UP_S after the death)."""
        assert lost.member is not None
        deadline = min(trio.current_time() + ADOPTION_HOLD_S, lost.member.state_since_s + ADOPTION_GIVE_UP_S)
        while True:
            home = self._directory.model(model_id)
            if home.where in (Where.LOCAL, Where.REMOTE):
                return home
            if trio.current_time() >= deadline:
                return None
            await trio.sleep(ADOPTION_POLL_S)

    async def if_it_answers(self, call: Call, home: Home, what: str) -> Reply | None:
        """A node declared dead may have been only slow (a loaded machine, a short partition): if it still
        answers at once, its answer stands and the job is not lost. A node that left is gone for good."""
        assert home.member is not None
        if home.member.state is not MemberState.DEAD:
            return None
        answer = await self.forward(call, home.member, what, connect_timeout_s=DEAD_CONNECT_S)
        return None if answer.status == 503 and RELAY_FAILED in answer.body.decode(errors="replace") else answer

    async def forward(self, call: Call, member: Member, what: str, connect_timeout_s: float = CONNECT_S) -> Reply:
        """`call` relayed to `member`; a creating request carries its caller's session, signed."""
        snapshot = self._session_snapshot(call.session_id) if call.session_id else None
        extra = session_headers(snapshot, self._key) if snapshot is not None else []
        return await self._peers.relay(
            member, call.scope, call.body, what, extra_headers=extra, connect_timeout_s=connect_timeout_s
        )

    def asker(self, call: Call, what: str) -> Callable[[Member, dict], Awaitable[Reply]]:
        """Asks one member, this node included, `call` under another scope (a list's page, a finish)."""

        async def ask(member: Member, scope: dict) -> Reply:
            if member.name == self._directory.local_name:
                return await self.local(scope, call.body)
            return await self.forward(replace(call, scope=scope), member, what)

        return ask

    async def local(self, scope: dict, body: bytes) -> Reply:
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
        return Reply(answer["body"], content_type=None, status=answer.get("status", 500), headers=tuple(headers))


def is_adoptable(home: Home) -> bool:
    """A lost job that auto-saved to the shared checkpoint root: a survivor adopts it (`adoption.py`)."""
    return home.note is not None and home.note.autosave_steps > 0


def _gave_up(home: Home) -> bool:
    assert home.member is not None
    return trio.current_time() >= home.member.state_since_s + ADOPTION_GIVE_UP_S


def _adopting_detail(what: str, home: Home) -> str:
    assert home.member is not None
    return (
        f"{what} lived on node {home.member.name}, which is {home.member.state.name.lower()}; a surviving node is "
        "adopting it from its auto-save: retry"
    )


def _lost_detail(what: str, home: Home) -> str:
    assert home.member is not None
    state = home.member.state.name.lower()
    if is_adoptable(home):
        return (
            f"{what} was lost with node {home.member.name} ({state}): no surviving node adopted it from its "
            f"auto-save within {ADOPTION_GIVE_UP_S:g} s (see the nodes' logs)"
            + (f"; its last checkpoint is {home.note.last_checkpoint}" if home.note and home.note.last_checkpoint else "")
        )
    restore = home.note.last_checkpoint if home.note is not None else ""
    hint = (
        f"its last checkpoint is {restore}: resume with create_training_client_from_state"
        if restore else "it saved no checkpoint this cluster knows of"
    )
    return f"{what} was lost with node {home.member.name} ({state}); {hint}"
