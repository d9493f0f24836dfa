"""The HTTP server against slow and hostile clients: its deadlines, caps and TLS, over real loopback sockets.

Each test runs `api/http1.Server` with small limits in the test's trio loop,
misbehaves as a raw-socket client would, checks that the connection ends at its
deadline (and is counted), and then checks that a normal request is still answered.
"""

from __future__ import annotations

import contextlib
import resource
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import msgspec
import trio
import trustme

from openrld.api.http1 import Server
from openrld.api.metrics import HttpCounters
from openrld.config import HttpLimits
from tests.api.test_http1 import Client, answer, echo, post

QUICK = HttpLimits(head_timeout=0.3, body_timeout=0.3, keep_alive_timeout=5.0, discard_timeout=0.3, write_timeout=0.3)


@contextlib.asynccontextmanager
async def serving(
    app, limits: HttpLimits = QUICK, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, HttpCounters]]:
    counters = HttpCounters()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        server = Server(app, limits, ssl_context=ssl_context, counters=counters)
        urls = await nursery.start(server.serve, "127.0.0.1", 0, stop)
        yield urlsplit(urls[0]).port, counters
        stop.set()


def or_echo(app):
    """`app`, except that /after is echoed: the request each test ends with."""

    async def routed(scope, receive, send):
        await (echo if scope.get("path") == "/after" else app)(scope, receive, send)

    return routed


async def still_answers(port: int) -> None:
    client = await Client.open(port)
    await client.send(post("/after", b"ok"))
    status, _, body = await client.reply()
    assert (status, msgspec.json.decode(body)["path"]) == (200, "/after")


async def closed_after(client: Client, seconds: float) -> float:
    """How long until the server closes `client`, waiting at most `seconds` more."""
    start = trio.current_time()
    with trio.move_on_after(seconds):
        while await client.stream.receive_some(65536):
            pass
        return trio.current_time() - start
    raise AssertionError(f"the connection was still open after {seconds} s")


async def test_a_connection_that_sends_nothing_closes_at_the_head_timeout() -> None:
    async with serving(echo) as (port, counters):
        client = await Client.open(port)
        waited = await closed_after(client, 3.0)
        assert 0.25 <= waited < 2.0
        assert counters.timeouts["head"] == 1
        await still_answers(port)


async def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_head_timeout() -> None:
    async with serving(echo) as (port, counters):
        client = await Client.open(port)
        head = post("/", b"")
        start = trio.current_time()
        for byte in head[:-2]:
            try:
                await client.send(bytes([byte]))
            except trio.BrokenResourceError:
                break
            await trio.sleep(0.05)
        assert trio.current_time() - start < 2.0
        status, _, body = await client.reply()
        assert (status, msgspec.json.decode(body)) == (408, {"detail": "request head not received within 0.3 s"})
        assert counters.timeouts["head"] == 1
        await still_answers(port)


async def test_a_kept_alive_connection_has_the_head_timeout_once_its_next_request_begins() -> None:
    async with serving(echo) as (port, counters):
        client = await Client.open(port)
        await client.send(post("/first", b""))
        assert (await client.reply())[0] == 200
        await trio.sleep(0.5)  # idle longer than head_timeout, within keep_alive_timeout: still open
        await client.send(b"POST /second HTTP/1.1\r\nHost: t\r\n")
        status, _, _ = await client.reply()
        assert status == 408
        assert (counters.timeouts["head"], counters.timeouts["keep_alive"]) == (1, 0)


async def test_an_idle_kept_alive_connection_is_counted_as_a_keep_alive_timeout() -> None:
    async with serving(echo, msgspec.structs.replace(QUICK, keep_alive_timeout=0.2)) as (port, counters):
        client = await Client.open(port)
        await client.send(post("/", b""))
        assert (await client.reply())[0] == 200
        await closed_after(client, 3.0)
        assert (counters.timeouts["keep_alive"], counters.timeouts["head"]) == (1, 0)


async def test_a_body_that_never_comes_gets_408_at_the_body_timeout() -> None:
    seen: list[dict] = []

    async def reader(scope, receive, send):
        if scope["type"] == "http":
            seen.append(await receive())

    async with serving(or_echo(reader)) as (port, counters):
        client = await Client.open(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n")
        status, headers, body = await client.reply()
        assert (status, body, headers[b"connection"]) == (408, b"request body not received in time", b"close")
        assert seen == [{"type": "http.disconnect"}]
        assert counters.timeouts["body"] == 1
        assert await client.closed()
        await still_answers(port)


async def test_a_body_sent_slowly_gets_408_at_the_body_timeout_however_steady_its_bytes() -> None:
    async with serving(echo) as (port, counters):
        client = await Client.open(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n")
        start = trio.current_time()
        with contextlib.suppress(trio.BrokenResourceError):
            for _ in range(100):
                await client.send(b"x")
                await trio.sleep(0.02)
                if trio.current_time() - start > 1.0:
                    break
        status, _, _ = await client.reply()
        assert status == 408
        assert counters.timeouts["body"] == 1
        await still_answers(port)


async def test_an_unread_body_that_stalls_is_discarded_for_the_discard_timeout_then_closed() -> None:
    async def refusing(scope, receive, send):
        if scope["type"] == "http":
            await answer(send, 401, [(b"content-length", b"0")])

    async with serving(or_echo(refusing), msgspec.structs.replace(QUICK, body_timeout=30.0)) as (port, counters):
        client = await Client.open(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
        assert (await client.reply())[0] == 401
        waited = await closed_after(client, 5.0)
        assert waited < 3.0
        assert counters.timeouts["discard"] == 1
        await still_answers(port)


async def test_a_client_that_never_reads_its_reply_is_dropped_at_the_write_timeout() -> None:
    big = b"x" * (64 << 20)  # far more than the loopback socket buffers hold

    async def flood(scope, receive, send):
        if scope["type"] == "http":
            await answer(send, 200, [(b"content-length", str(len(big)).encode())], big)

    async with serving(or_echo(flood)) as (port, counters):
        client = await Client.open(port)
        await client.send(post("/", b""))
        await trio.sleep(1.5)  # read nothing
        assert counters.timeouts["write"] == 1
        assert counters.open_connections == 0
        await still_answers(port)


async def test_pipelined_requests_past_the_per_connection_cap_are_not_served() -> None:
    async with serving(echo, msgspec.structs.replace(QUICK, keep_alive_max_requests=3)) as (port, _):
        client = await Client.open(port)
        await client.send(b"".join(post(f"/{n}", b"") for n in range(5)))
        paths, connection_headers = [], []
        for _ in range(3):
            status, headers, body = await client.reply()
            assert status == 200
            paths.append(msgspec.json.decode(body)["path"])
            connection_headers.append(headers.get(b"connection"))
        assert paths == ["/0", "/1", "/2"]
        assert connection_headers == [None, None, b"close"]
        assert await client.closed()
        await still_answers(port)


async def test_a_connection_past_max_connections_is_closed_at_once_and_counted() -> None:
    limits = msgspec.structs.replace(QUICK, max_connections=3, head_timeout=5.0)
    async with serving(echo, limits) as (port, counters):
        held = [await Client.open(port) for _ in range(3)]
        while counters.open_connections < 3:
            await trio.sleep(0.01)
        extra = await Client.open(port)
        assert await closed_after(extra, 1.0) < 0.5
        assert (counters.refused_connections, counters.open_connections) == (1, 3)
        await held[0].stream.aclose()
        while counters.open_connections > 2:
            await trio.sleep(0.01)
        await still_answers(port)


def _raise_open_file_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def test_ten_thousand_idle_connections_all_end_and_a_request_is_still_answered() -> None:
    connections = 10_000
    limits = msgspec.structs.replace(QUICK, head_timeout=8.0)  # max_connections at its default, 4096
    # The clients' sockets and the server's both live in this process.
    wanted = connections + limits.max_connections + 512
    assert _raise_open_file_limit(wanted) >= wanted
    async with serving(echo, limits) as (port, counters):
        sockets = []
        try:
            start = trio.current_time()
            for _ in range(connections):
                sock = trio.socket.socket()
                sockets.append(sock)
                await sock.connect(("127.0.0.1", port))
            with trio.fail_after(5):
                while counters.open_connections + counters.refused_connections < connections:
                    await trio.sleep(0.05)
            assert trio.current_time() - start < limits.head_timeout, "connecting took longer than the deadline"
            assert (counters.open_connections, counters.refused_connections) == (4096, connections - 4096)
            with trio.fail_after(limits.head_timeout + 5):
                while counters.open_connections:
                    await trio.sleep(0.1)
            assert counters.timeouts["head"] == 4096
            for sock in sockets:
                with contextlib.suppress(ConnectionResetError):  # closed unread: a reset is a close too
                    assert await sock.recv(1) == b""
            await still_answers(port)
        finally:
            for sock in sockets:
                sock.close()


async def test_the_app_sees_the_client_go_away_while_it_works() -> None:
    seen = []

    async def waiting(scope, receive, send):
        if scope["type"] == "http":
            await receive()  # the body
            seen.append(await receive())  # blocks until the client has gone

    async with serving(or_echo(waiting)) as (port, _):
        client = await Client.open(port)
        await client.send(post("/", b"body"))
        await trio.sleep(0.1)
        await client.stream.aclose()
        with trio.fail_after(2):
            while not seen:
                await trio.sleep(0.01)
        assert seen == [{"type": "http.disconnect"}]
        await still_answers(port)


async def test_a_request_pipelined_while_the_app_watches_for_a_disconnect_is_served_next() -> None:
    async def watching(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)  # reads the socket for a close while this request works
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        await answer(send, 200, [(b"content-length", str(len(scope["path"])).encode())], scope["path"].encode())

    async with serving(watching) as (port, _):
        client = await Client.open(port)
        await client.send(post("/one", b""))
        await trio.sleep(0.05)
        await client.send(post("/two", b"2"))
        assert (await client.reply())[2] == b"/one"
        assert (await client.reply())[2] == b"/two"


async def test_an_app_shutdown_that_hangs_is_stopped_after_the_shutdown_timeout() -> None:
    async def hanging(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await trio.sleep_forever()

    stop = trio.Event()
    limits = msgspec.structs.replace(QUICK, shutdown_timeout=0.2)
    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            await nursery.start(Server(hanging, limits).serve, "127.0.0.1", 0, stop)
            stop.set()


@contextlib.asynccontextmanager
async def tls_serving(app) -> AsyncIterator[tuple[int, ssl.SSLContext]]:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    async with serving(app, ssl_context=server_context) as (port, _):
        yield port, client_context


async def test_under_tls_requests_are_served_over_https_with_the_https_scheme() -> None:
    schemes = []

    async def scheme(scope, receive, send):
        if scope["type"] == "http":
            schemes.append(scope["scheme"])
            await answer(send, 200, [(b"content-length", b"2")], b"ok")

    async with tls_serving(scheme) as (port, client_context):
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        client = Client(trio.SSLStream(raw, client_context, server_hostname="127.0.0.1", https_compatible=True))
        await client.send(post("/", b""))
        assert (await client.reply())[:1] == (200,)
        await client.send(post("/", b""))
        assert (await client.reply())[2] == b"ok"
        assert schemes == ["https", "https"]


async def test_under_tls_a_plain_http_request_is_refused_and_the_server_keeps_serving() -> None:
    async with tls_serving(echo) as (port, client_context):
        plain = await Client.open(port)
        await plain.send(post("/", b""))
        assert await closed_after(plain, 2.0) < 1.0
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        client = Client(trio.SSLStream(raw, client_context, server_hostname="127.0.0.1", https_compatible=True))
        await client.send(post("/after", b""))
        assert (await client.reply())[0] == 200


async def test_under_tls_a_handshake_that_never_comes_ends_at_the_head_timeout() -> None:
    async with tls_serving(echo) as (port, _):
        client = await Client.open(port)
        waited = await closed_after(client, 3.0)
        assert 0.25 <= waited < 2.0



async def test_a_client_that_leaves_mid_body_is_a_disconnect_to_the_app_and_the_server_keeps_serving() -> None:
    seen: list[dict] = []

    async def reader(scope, receive, send):
        if scope["type"] == "http":
            while True:
                message = await receive()
                seen.append({"type": message["type"], "body": len(message.get("body", b""))})
                if not message.get("more_body", False):
                    return

    async with serving(or_echo(reader), msgspec.structs.replace(QUICK, body_timeout=10.0)) as (port, counters):
        client = await Client.open(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
        await trio.sleep(0.1)
        await client.stream.aclose()
        with trio.fail_after(2):
            while counters.open_connections:
                await trio.sleep(0.01)
        assert seen == [{"type": "http.request", "body": 100}, {"type": "http.disconnect", "body": 0}]
        assert counters.timeouts["body"] == 0
        await still_answers(port)
