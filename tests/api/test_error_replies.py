"""Error replies, driven without a daemon: every layer of the front answers an error with the same
status, `{"detail"}` body and headers (`fastpath.error_reply`), whichever layer meets it."""

from __future__ import annotations

import trio

from openrld.api.app import error_response, response_of
from openrld.api.asgi import Reply, detail_reply, replay
from openrld.api.auth import Authenticator
from openrld.api.fastpath import Call, FastPath
from openrld.api.gate import Gate
from openrld.api.metrics import RequestMetrics
from openrld.api.routes import TABLE
from openrld.errors import TooManyRequests


async def answer_of(app, scope: dict, body: bytes = b"{}") -> tuple[int, dict[bytes, bytes], bytes]:
    """Drive one request through an ASGI layer: its status, headers and body."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "headers": [], **scope}, replay(body), send)
    start, whole = sent
    return start["status"], dict(start["headers"]), whole["body"]


def hot(handler) -> FastPath:
    """A fast path serving `handler` at POST /api/v1/optim_step, and nothing else."""
    return FastPath(None, {"/api/v1/optim_step": handler}, max_body_bytes=100)  # type: ignore[arg-type]


async def test_an_error_a_hot_handler_raises_is_its_status_detail_and_headers() -> None:
    async def handler(call: Call) -> Reply:
        raise TooManyRequests("the queue is full")

    status, headers, body = await answer_of(hot(handler), {"method": "POST", "path": "/api/v1/optim_step"})
    assert (status, body) == (429, b'{"detail":"the queue is full"}')
    assert headers == {b"content-type": b"application/json", b"retry-after": b"1", b"content-length": b"30"}


async def test_an_unexpected_exception_in_a_hot_handler_answers_500_naming_only_its_type() -> None:
    async def handler(call: Call) -> Reply:
        raise ValueError("a secret path /var/lib/x")

    status, _, body = await answer_of(hot(handler), {"method": "POST", "path": "/api/v1/optim_step"})
    assert (status, body) == (500, b'{"detail":"internal error: ValueError"}')


async def test_a_body_past_the_limit_is_413_before_the_handler_runs() -> None:
    calls: list[Call] = []

    async def handler(call: Call) -> Reply:
        calls.append(call)
        return Reply(b"{}")

    status, _, body = await answer_of(hot(handler), {"method": "POST", "path": "/api/v1/optim_step"}, b"x" * 101)
    assert (status, body, calls) == (413, b'{"detail":"request body over 100 bytes"}', [])


async def test_the_gate_refuses_a_keyed_route_without_a_key_with_401_and_the_scheme_to_use() -> None:
    gate = Gate(
        trio.sleep_forever, auth=Authenticator({"tml-a": "alice"}), routes=TABLE, max_body_bytes=100, metrics=RequestMetrics()
    )
    status, headers, body = await answer_of(gate, {"method": "POST", "path": "/api/v1/optim_step"})
    assert (status, body) == (401, b'{"detail":"missing X-API-Key header"}')
    assert headers[b"www-authenticate"] == b'ApiKey realm="openrld"'


async def test_a_quart_route_error_has_the_same_bytes_as_the_fast_paths() -> None:
    response = error_response(404, "no route GET /nope")
    assert (response.status_code, response.content_type) == (404, "application/json")
    assert await response.get_data() == detail_reply(404, "no route GET /nope").body == b'{"detail":"no route GET /nope"}'


async def test_quart_carries_a_reply_with_its_status_content_type_headers_and_body() -> None:
    response = response_of(Reply(b"busy", content_type="text/plain", status=409, headers=((b"retry-after", b"1"),)))
    assert (response.status_code, response.content_type, response.headers["Retry-After"]) == (409, "text/plain", "1")
    assert await response.get_data() == b"busy"
