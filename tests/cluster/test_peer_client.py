"""The peer client's calls, against httpx's in-memory transport at the network edge, and the locate answer."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from openrld.api.asgi import detail_reply
from openrld.cluster.membership.messages import MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import (
    LOCATE_PATH,
    LOCATE_TAG_HEADER,
    RELAYED_HEADER,
    LocateQuery,
    PeerClient,
    RelayCounters,
    answer_locate,
    relay_key,
    sign,
)

KEY = relay_key("cluster-secret")


def member(name: str, state: MemberState = MemberState.ALIVE) -> Member:
    return Member(name, f"{name}:7946", 1, state, NodePayload(peer_url=f"http://{name}"), 0.0)


def peers(handler, counters: RelayCounters | None = None) -> PeerClient:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return PeerClient(
        client, local_name="node-a", key=KEY, relay_timeout_s=60.0, tls=False, counters=counters or RelayCounters()
    )


SCOPE = {
    "type": "http", "method": "POST", "path": "/api/v1/optim_step", "query_string": b"x=1",
    "headers": [(b"x-api-key", b"tml-a"), (b"host", b"node-a"), (b"content-length", b"2"), (b"accept-encoding", b"zstd")],
}


async def test_a_relayed_request_keeps_the_callers_headers_and_says_who_relayed_it():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"{}", headers={"x-kept": "1", "keep-alive": "timeout=5"})

    counters = RelayCounters()
    answer = await peers(handler, counters).relay(member("node-b"), SCOPE, b"{}", "m-1", extra_headers=[("x-extra", "e")])
    request = seen[0]
    assert (str(request.url), request.method, request.content) == ("http://node-b/api/v1/optim_step?x=1", "POST", b"{}")
    assert (request.headers["x-api-key"], request.headers["host"], request.headers[RELAYED_HEADER]) == ("tml-a", "node-b", "node-a")
    assert request.headers["x-extra"] == "e"
    assert request.headers["accept-encoding"] != "zstd"  # httpx negotiates its own: it hands back the decoded body
    assert (answer.status, answer.body, (b"x-kept", b"1") in answer.headers) == (200, b"{}", True)
    assert all(k not in (b"keep-alive", b"content-length") for k, _ in answer.headers)
    assert (counters.relayed, counters.unreachable) == (1, 0)


async def test_a_peer_that_does_not_answer_is_a_503_naming_it_and_is_counted():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    counters = RelayCounters()
    answer = await peers(handler, counters).relay(member("node-b"), SCOPE, b"{}", "m-1")
    assert answer == detail_reply(
        503, "m-1 lives on node node-b, which did not answer (ConnectError); retry, or wait until the cluster declares it dead"
    )
    assert (counters.relayed, counters.unreachable) == (1, 1)


async def test_locate_asks_only_live_members_other_than_this_node_and_names_the_one_that_is_home():
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == LOCATE_PATH
        assert request.headers[LOCATE_TAG_HEADER] == sign(KEY, request.content)
        asked.append(request.url.host)
        return httpx.Response(200, json={"here": request.url.host == "node-c"})

    members = [member("node-a"), member("node-b"), member("node-c"), member("node-d", MemberState.DEAD)]
    assert await peers(handler).locate(members, "model", "m-1") == "node-c"
    assert sorted(asked) in (["node-b", "node-c"], ["node-c"])  # node-b's answer may be cut short by node-c's


async def test_locate_with_no_member_home_is_none():
    assert await peers(lambda request: httpx.Response(200, json={"here": False})).locate([member("node-b")], "model", "m") is None


QUERY = msgspec.json.encode(LocateQuery("model", "m-1"))


@pytest.mark.parametrize(
    ("method", "body", "tag", "expected"),
    [
        ("POST", QUERY, sign(KEY, QUERY), (200, {"here": True})),
        ("POST", QUERY, sign(relay_key("another"), QUERY), (403, {"detail": "locate needs a tag made with the cluster secret"})),
        ("GET", QUERY, sign(KEY, QUERY), (400, {"detail": "locate takes a small POST body"})),
        ("POST", None, "", (400, {"detail": "locate takes a small POST body"})),
    ],
    ids=["signed", "another-secret", "get", "unread-body"],
)
def test_answer_locate(method, body, tag, expected):
    answer = answer_locate(method, body, tag, KEY, lambda query: query == LocateQuery("model", "m-1"))
    assert (answer.status, msgspec.json.decode(answer.body)) == expected


def test_a_signed_locate_body_that_does_not_decode_is_400():
    answer = answer_locate("POST", b"[]", sign(KEY, b"[]"), KEY, lambda query: True)
    assert answer.status == 400
    assert msgspec.json.decode(answer.body)["detail"].startswith("invalid locate body: ")
