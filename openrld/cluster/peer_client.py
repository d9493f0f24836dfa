"""Node-to-node HTTP for the relay: a caller's request sent on to its home node, and locate queries.

Both halves of the locate query are here: `PeerClient.locate` asks, and
`answer_locate` (pure) is what the node asked answers.

Every call the relay makes to another member goes through `PeerClient` (gossip's
push-pull has its own, `membership/peer_client.py`). It owns the shared
`httpx.AsyncClient`, the relay timeouts, the rule that a caller's key never
crosses the network in plain HTTP from a node that speaks TLS, and the relay
counters for /metrics. It keeps no state of its own and makes no decision:
the relay says where a request goes, `placement/` which node is offered
a job. A peer's answer is an `asgi.Reply`, the one reply type every layer
sends, with the peer's headers kept as they came (its `content_type` None). A peer
that does not answer is a Reply too (503 naming the node), never an exception, so
that one dead member fails only the calls that needed it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable

import httpx
import msgspec
import trio

from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.cluster.membership.table import Member

logger = logging.getLogger(__name__)

class RelayStatistics(msgspec.Struct, frozen=True):
    relayed: int  # requests sent on to their home node
    unreachable: int  # of those, the ones whose home did not answer
    lost: int  # requests answered 410 because their home is dead or gone
    placed: int  # jobs and samplers a placement offered and a node took
    refused: int  # offers a node refused for want of room (the next node was tried)
    adopted: int = 0  # jobs this node took over from a dead home node (adoption.py)
    replayed: int = 0  # requests this node kept for a dead home and replayed on its job's adopter (replay.py)
    unreplayable: int = 0  # of those kept, the ones that could not be replayed: their clients were told what was lost


class RelayCounters:
    """Counted by the relay (relay.py), this client, the placer (placement/), adoption and replay; read by /metrics."""

    def __init__(self) -> None:
        self.relayed = self.unreachable = self.lost = self.placed = self.refused = 0
        self.adopted = self.replayed = self.unreplayable = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            self.relayed, self.unreachable, self.lost, self.placed, self.refused, self.adopted, self.replayed,
            self.unreplayable,
        )



RELAYED_HEADER = "x-openrl-relayed-by"  # the node that relayed the request; the receiver never relays it again
LOCATE_PATH = "/openrl/peer/v1/locate"
LOCATE_TAG_HEADER = "x-openrl-locate-tag"  # HMAC of the locate body with the relay key
CONNECT_S = 5.0  # to connect to a live member
DEAD_CONNECT_S = 1.0  # to a member declared dead: a call to a lost job must fail at once, not hang
LOCATE_S = 5.0  # a whole locate query to one member
RELAY_FAILED = "did not answer"  # in the 503 detail of a relay the peer did not answer

# Not passed on: hop-by-hop headers, the length (recomputed), and compression
# negotiation (httpx hands us the decoded body).
_DROPPED_REQUEST_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding", b"accept-encoding"}
_DROPPED_RESPONSE_HEADERS = {"content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive"}


class Located(msgspec.Struct, frozen=True):
    """The body of a locate answer."""

    here: bool  # the member asked is home to the id


class LocateQuery(msgspec.Struct, frozen=True):
    kind: str  # "model" or "sampler"
    id: str


def relay_key(secret: str) -> bytes:
    """The key that signs relayed sessions and locate queries (not the gossip key: another purpose)."""
    return hashlib.sha256(b"openrl-relay\0" + secret.encode()).digest()


def sign(key: bytes, value: bytes) -> str:
    return hmac.new(key, value, hashlib.sha256).hexdigest()


class PeerClient:
    """Sends requests to other members of the cluster; see the module docstring."""

    def __init__(
        self, client: httpx.AsyncClient, *, local_name: str, key: bytes, relay_timeout_s: float, tls: bool,
        counters: RelayCounters,
    ) -> None:
        self._client = client
        self._local_name = local_name  # sent in RELAYED_HEADER
        self._key = key  # relay_key(cluster secret): signs locate queries
        self._timeout_s = relay_timeout_s  # a relayed call's read timeout: the home node's long-poll and a margin
        self._tls = tls  # this node speaks TLS: a caller's key never goes to a peer in plain HTTP
        self._counters = counters  # relayed and unreachable, for /metrics

    async def relay(
        self, member: Member, scope: dict, body: bytes, what: str, *,
        extra_headers: Iterable[tuple[str, str]] = (), connect_timeout_s: float = CONNECT_S,
    ) -> Reply:
        """The ASGI request `scope` with `body`, sent to `member` with the caller's own headers; `what` names
        the id it is about, for the 503 when the member cannot be reached."""
        if self._tls and not member.peer_url.startswith("https://"):
            # The caller's key crosses the network with the request; under TLS it never goes in plain text.
            self._counters.unreachable += 1
            return detail_reply(
                503, f"{what} lives on node {member.name}, which serves plain HTTP ({member.peer_url}) while this "
                "node uses TLS; give every node of the cluster tls_certfile and tls_keyfile"
            )
        out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _DROPPED_REQUEST_HEADERS]
        out.append((RELAYED_HEADER, self._local_name))
        out.extend(extra_headers)
        query = scope.get("query_string")
        url = member.peer_url + scope["path"] + (("?" + query.decode()) if query else "")
        self._counters.relayed += 1
        try:
            response = await self._client.request(
                scope["method"], url, headers=out, content=body,
                timeout=httpx.Timeout(self._timeout_s, connect=connect_timeout_s),
            )
        except httpx.HTTPError as exc:
            self._counters.unreachable += 1
            logger.warning("relay failed node=%s id=%s: %s", member.name, what, exc)
            return detail_reply(
                503, f"{what} lives on node {member.name}, which {RELAY_FAILED} ({type(exc).__name__}); retry, or "
                "wait until the cluster declares it dead"
            )
        kept = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in response.headers.multi_items()
            if k.lower() not in _DROPPED_RESPONSE_HEADERS
        ]
        return Reply(response.content, content_type=None, status=response.status_code, headers=tuple(kept))

    async def locate(self, members: Iterable[Member], kind: str, some_id: str) -> str | None:
        """The first of `members` (live ones other than this node are asked) that says it is home to `some_id`."""
        body = msgspec.json.encode(LocateQuery(kind, some_id))
        tag = sign(self._key, body)
        found: list[str] = []

        async def ask(member: Member, cancel: trio.CancelScope) -> None:
            try:
                response = await self._client.post(
                    member.peer_url + LOCATE_PATH, content=body, headers={LOCATE_TAG_HEADER: tag}, timeout=LOCATE_S
                )
                if response.status_code == 200 and msgspec.json.decode(response.content, type=Located).here:
                    found.append(member.name)
                    cancel.cancel()
            except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
                return

        async with trio.open_nursery() as nursery:
            for member in members:
                if member.is_alive and member.name != self._local_name:
                    nursery.start_soon(ask, member, nursery.cancel_scope)
        return found[0] if found else None


def answer_locate(method: str, body: bytes | None, tag: str, key: bytes, is_here: Callable[[LocateQuery], bool]) -> Reply:
    """This node's answer to a member's locate query (`body`: None when it was not read whole)."""
    if body is None or method != "POST":
        return detail_reply(400, "locate takes a small POST body")
    if not hmac.compare_digest(sign(key, body), tag):
        return detail_reply(403, "locate needs a tag made with the cluster secret")
    try:
        query = msgspec.json.decode(body, type=LocateQuery)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return detail_reply(400, f"invalid locate body: {exc}")
    return json_reply(Located(here=is_here(query)))
