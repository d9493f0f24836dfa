"""The daemon's HTTP/1.1 server (api/http1.py), driven over real loopback sockets.

Each test runs the server on port 0 in the test's trio loop with a small ASGI
app, and speaks HTTP to it as raw bytes, reading replies with an h11 client.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import h11
import msgspec
import pytest
import trio

from openrld.api.http1 import UNREAD_BODY_BYTES, Server
from openrld.config import HttpLimits


async def answer(send, status: int, headers: list, body: bytes = b"", *, more_body: bool = False) -> None:
    """An ASGI reply: its start, then one body message."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


async def echo(scope: dict, receive, send) -> None:
    """Answers with what it saw: method, path, query, the body's parts and one header."""
    if scope["type"] != "http":
        return
    parts = []
    while True:
        message = await receive()
        parts.append(len(message.get("body", b"")))
        if not message.get("more_body", False):
            break
    headers = dict(scope["headers"])
    seen = {
        "method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
        "parts": parts, "body": sum(parts), "x-api-key": headers.get(b"x-api-key", b"").decode(),
        "client_host": scope["client"][0],
    }
    body = msgspec.json.encode(seen)
    await answer(send, 200, [(b"content-length", str(len(body)).encode())], body)


@contextlib.asynccontextmanager
async def serving(app, limits: HttpLimits = HttpLimits()) -> AsyncIterator[tuple[int, trio.Event]]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(Server(app, limits).serve, "127.0.0.1", 0, stop)
        yield urlsplit(urls[0]).port, stop
        stop.set()


class Client:
    """One raw connection; replies are parsed by h11's client side."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    @classmethod
    async def open_url(cls, url: str) -> Client:
        parts = urlsplit(url)
        return cls(await trio.open_tcp_stream(parts.hostname, parts.port))

    async def send(self, raw: bytes) -> None:
        await self.stream.send_all(raw)

    async def reply(self) -> tuple[int, dict[bytes, bytes], bytes]:
        """The next reply's status, headers and body, or status 0 once the server closed."""
        if self.h11.our_state is h11.IDLE:  # the request went as raw bytes: tell h11's client side one did
            self.h11.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
            self.h11.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
                    self.h11.start_next_cycle()
                return status, headers, body
            elif isinstance(event, h11.ConnectionClosed):
                return 0, {}, b""

    async def closed(self) -> bool:
        with trio.move_on_after(5):
            return await self.stream.receive_some(1) == b""
        return False


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def test_one_connection_carries_several_requests() -> None:
    async with serving(echo) as (port, _):
        client = await Client.open(port)
        for path in ("/a", "/b?x=1"):
            await client.send(post(path, b"{}", "X-Api-Key: k1"))
            status, _, body = await client.reply()
            assert status == 200
            assert msgspec.json.decode(body) == {
                "method": "POST", "path": path.split("?")[0], "query": path.partition("?")[2], "parts": [2],
                "body": 2, "x-api-key": "k1", "client_host": "127.0.0.1",
            }


async def test_a_percent_encoded_path_reaches_the_app_decoded() -> None:
    async with serving(echo) as (port, _):
        client = await Client.open(port)
        await client.send(b"GET /files/a%20b HTTP/1.1\r\nHost: t\r\n\r\n")
        assert msgspec.json.decode((await client.reply())[2])["path"] == "/files/a b"


async def test_a_chunked_request_body_reaches_the_app_in_its_chunks() -> None:
    async with serving(echo) as (port, _):
        client = await Client.open(port)
        await client.send(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
        status, _, body = await client.reply()
        assert (status, msgspec.json.decode(body)["body"]) == (200, 7)


async def test_a_reply_without_a_length_is_sent_chunked() -> None:
    async def streamed(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
        await send({"type": "http.response.body", "body": b"second"})

    async with serving(streamed) as (port, _):
        client = await Client.open(port)
        await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, body = await client.reply()
        assert (status, headers[b"transfer-encoding"], body) == (200, b"chunked", b"first second")


async def test_bytes_that_are_not_http_get_a_400_and_the_server_keeps_serving() -> None:
    async with serving(echo) as (port, _):
        bad = await Client.open(port)
        await bad.send(b"this is not http\r\n\r\n")
        status, _, body = await bad.reply()
        assert status == 400
        assert msgspec.json.decode(body)["detail"].startswith("bad HTTP request")
        assert await bad.closed()
        good = await Client.open(port)
        await good.send(post("/after", b""))
        assert (await good.reply())[0] == 200


async def test_a_head_longer_than_the_limit_gets_431() -> None:
    async with serving(echo, HttpLimits(h11_max_incomplete_size=1024)) as (port, _):
        client = await Client.open(port)
        await client.send(post("/", b"", "X-Big: " + "a" * 2000))
        assert (await client.reply())[0] == 431


async def test_an_app_error_answers_500_and_the_connection_carries_on() -> None:
    async def failing(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/fail":
            raise RuntimeError("boom")
        await echo(scope, receive, send)

    async with serving(failing) as (port, _):
        client = await Client.open(port)
        await client.send(post("/fail", b"{}"))
        assert (await client.reply())[0] == 500
        await client.send(post("/ok", b"{}"))
        assert (await client.reply())[0] == 200


async def test_an_app_that_returns_without_answering_gets_500() -> None:
    async def silent(scope, receive, send):
        return None

    async with serving(silent) as (port, _):
        client = await Client.open(port)
        await client.send(post("/", b""))
        assert (await client.reply())[:2] == (500, {b"content-length": b"0"})


async def test_a_body_the_app_did_not_read_is_skipped_and_the_connection_carries_on() -> None:
    async def refusing(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/refuse":  # answers before reading, as a 413 for an oversized body does
            await answer(send, 413, [(b"content-length", b"0")])
            return
        await echo(scope, receive, send)

    async with serving(refusing) as (port, _):
        client = await Client.open(port)
        await client.send(post("/refuse", b"x" * 5000))
        assert (await client.reply())[0] == 413
        await client.send(post("/next", b"{}"))
        status, _, body = await client.reply()
        assert (status, msgspec.json.decode(body)["path"]) == (200, "/next")


async def test_a_connection_closes_after_a_reply_to_a_body_over_the_unread_limit() -> None:
    async def refusing(scope, receive, send):
        if scope["type"] == "http":
            await answer(send, 413, [(b"content-length", b"0")])

    async with serving(refusing) as (port, _):
        client = await Client.open(port)
        size = 4 * UNREAD_BODY_BYTES
        await client.send(f"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n\r\n".encode())
        with contextlib.suppress(trio.BrokenResourceError):
            await client.send(b"x" * (2 * UNREAD_BODY_BYTES))
        assert (await client.reply())[0] == 413
        assert await client.closed()


async def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    async with serving(echo) as (port, _):
        client = await Client.open(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        interim = await client.stream.receive_some(65536)
        assert interim.startswith(b"HTTP/1.1 100 ")
        client.h11.receive_data(interim)
        await client.send(b"abc")
        status, _, body = await client.reply()
        assert (status, msgspec.json.decode(body)["body"]) == (200, 3)


async def test_an_idle_connection_closes_after_the_keep_alive() -> None:
    async with serving(echo, HttpLimits(keep_alive_timeout=0.2)) as (port, _):
        client = await Client.open(port)
        await client.send(post("/", b""))
        assert (await client.reply())[0] == 200
        start = trio.current_time()
        assert await client.closed()
        assert trio.current_time() - start >= 0.2


async def test_the_app_lifespan_starts_before_serving_and_stops_after() -> None:
    events: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        events.append("request")
        await echo(scope, receive, send)

    async with serving(app) as (port, _):
        assert events == ["lifespan.startup"]
        client = await Client.open(port)
        await client.send(post("/", b""))
        await client.reply()
    assert events == ["lifespan.startup", "request", "lifespan.shutdown"]


async def test_a_drain_lets_a_request_in_flight_answer_and_closes_idle_connections() -> None:
    started = trio.Event()

    async def slow(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            started.set()
            await trio.sleep(0.3)
        await echo(scope, receive, send)

    async with serving(slow) as (port, stop):
        idle = await Client.open(port)
        await idle.send(post("/", b""))
        assert (await idle.reply())[0] == 200
        busy = await Client.open(port)
        await busy.send(post("/slow", b""))
        await started.wait()
        stop.set()
        assert await idle.closed()
        status, headers, _ = await busy.reply()
        assert (status, headers[b"connection"]) == (200, b"close")
        assert await busy.closed()
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)


async def test_a_drain_cancels_a_request_that_outlasts_the_grace() -> None:
    cancelled = trio.Event()

    async def stuck(scope, receive, send):
        if scope["type"] != "http":
            return
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with serving(stuck, HttpLimits(graceful_timeout=0.1)) as (port, stop):
        client = await Client.open(port)
        await client.send(post("/", b""))
        await trio.sleep(0.05)
        stop.set()
        with trio.fail_after(5):
            await cancelled.wait()
        assert await client.closed()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_an_ipv6_listener_reports_its_url_with_brackets() -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(Server(echo).serve, "::1", 0, stop)
        assert urls[0].startswith("http://[::1]:")
        client = await Client.open_url(urls[0])
        await client.send(post("/v6", b""))
        assert (await client.reply())[0] == 200
        stop.set()


async def test_a_reply_head_h11_refuses_becomes_a_500_and_the_connection_carries_on() -> None:
    async def invalid(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/invalid":
            await answer(send, 200, [(b"bad header", b"x")], b"never sent")
            return
        await echo(scope, receive, send)

    async with serving(invalid) as (port, _):
        client = await Client.open(port)
        await client.send(post("/invalid", b""))
        assert await client.reply() == (500, {b"content-length": b"0"}, b"")
        await client.send(post("/after", b""))
        assert (await client.reply())[0] == 200


async def test_an_app_failing_mid_reply_closes_that_connection_and_the_server_keeps_serving() -> None:
    async def failing_midway(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/midway":
            await answer(send, 200, [(b"content-length", b"100")], b"only part", more_body=True)
            raise RuntimeError("boom")
        await echo(scope, receive, send)

    async with serving(failing_midway) as (port, _):
        cut = await Client.open(port)
        await cut.send(post("/midway", b""))
        with pytest.raises(h11.RemoteProtocolError, match="without sending complete message body"):
            await cut.reply()
        fresh = await Client.open(port)
        await fresh.send(post("/after", b""))
        assert (await fresh.reply())[0] == 200
