"""The relay's handling of bodies and transports, driven as an ASGI app in the test's trio loop.

What it must never do: relay a body cut short by the client's disconnect, buffer
a body past the limit to answer 413, or send a caller's key to a peer in plain
HTTP when this node speaks TLS. None of these reach the directory or a peer,
so the relay is built here without a cluster.
"""

from __future__ import annotations

import httpx
import msgspec
import trio

from openrld.api.routes import TABLE
from openrld.cluster.membership.messages import MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import PeerClient, RelayCounters
from openrld.cluster.relay import Relay

MAX_BODY = 1000


class Inner:
    """The node's own app behind the relay: records whether it was reached."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1


def relay(inner: Inner) -> Relay:
    counters = RelayCounters()
    peers = PeerClient(httpx.AsyncClient(), local_name="node-a", key=b"k", relay_timeout_s=60.0, tls=False, counters=counters)
    return Relay(
        inner, directory=None, peers=peers, placement=None, key=b"k", counters=counters,  # type: ignore[arg-type]
        user_for=lambda key: "alice", session_snapshot=lambda session: None, mirror_session=lambda snapshot: None,
        resolve_model=lambda name: name, accept_jobs=True, max_body_bytes=MAX_BODY, routes=TABLE,
    )


def scope(path: str = "/api/v1/optim_step") -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": [(b"x-api-key", b"tml-a")], "query_string": b""}


def receiving(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


async def test_a_body_cut_short_by_a_disconnect_is_neither_relayed_nor_answered() -> None:
    inner, sent = Inner(), []

    async def send(message: dict) -> None:
        sent.append(message)

    receive = receiving(
        {"type": "http.request", "body": b'{"model_id": "m', "more_body": True}, {"type": "http.disconnect"}
    )
    await relay(inner)(scope(), receive, send)
    assert (inner.calls, sent) == (0, [])


async def test_a_body_over_the_limit_is_answered_413_by_the_relay_itself() -> None:
    inner, sent = Inner(), []

    async def send(message: dict) -> None:
        sent.append(message)

    receive = receiving({"type": "http.request", "body": b"x" * (MAX_BODY + 1), "more_body": True})
    await relay(inner)(scope(), receive, send)
    assert inner.calls == 0
    assert (sent[0]["status"], msgspec.json.decode(sent[1]["body"])) == (413, {"detail": f"request body over {MAX_BODY} bytes"})


async def test_under_tls_a_plain_http_peer_is_never_sent_the_callers_request() -> None:
    member = Member("node-b", "127.0.0.1:1", 1, MemberState.ALIVE, NodePayload(peer_url="http://127.0.0.1:9"), 0.0)
    peers = PeerClient(
        httpx.AsyncClient(), local_name="node-a", key=b"k", relay_timeout_s=60.0, tls=True, counters=RelayCounters()
    )
    answer = await peers.relay(member, scope(), b"{}", "m-1")
    assert (answer.status, msgspec.json.decode(answer.body)["detail"]) == (
        503, "m-1 lives on node node-b, which serves plain HTTP (http://127.0.0.1:9) while this node uses TLS; "
        "give every node of the cluster tls_certfile and tls_keyfile",
    )


async def test_a_relayed_long_poll_ends_when_its_client_goes_away() -> None:
    inner, sent = Inner(), []
    waiting_at_home = trio.Event()

    async def send(message: dict) -> None:
        sent.append(message)

    async def held_at_home(home_by, call):
        waiting_at_home.set()
        await trio.sleep_forever()  # the home node holds the poll for up to longpoll_s

    messages = [{"type": "http.request", "body": b'{"request_id": "r-1"}', "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await waiting_at_home.wait()
        return {"type": "http.disconnect"}  # then the client closes its socket

    front = relay(inner)
    front._route = held_at_home  # type: ignore[method-assign]  # the peer at the edge: it never answers
    with trio.fail_after(2):
        await front(scope("/api/v1/retrieve_future"), receive, send)
    assert (inner.calls, sent) == (0, [])
