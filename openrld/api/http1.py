"""HTTP/1.1 for the daemon's ASGI app: h11 for the protocol, trio for the sockets.

Each connection is one task: it reads a request, calls the app inline, writes
the reply, and waits for the next request on the same connection. The SDK keeps
its connections alive and never pipelines, so that is all the concurrency a
connection needs. h11 owns the protocol (framing, keep-alive, chunked bodies,
what may follow what); this module moves bytes and translates between h11's
events and ASGI's messages.

Why not hypercorn, which served the app before: per request it spawns a task
for the app, restarts an idle-timeout task twice, and takes a lock and a
shielded scope for each write. On the training and sampling loop's small POSTs
that cost 1.6-1.8 ms of event-loop CPU per request against 0.6-0.75 ms here
(`bench/http_server.py`), on the thread whose GIL the model's step thread needs.

It keeps the protections hypercorn gave, and adds the ones an exposed server
needs; each is a setting of `config.HttpLimits` (`[http]` in the config file;
docs/http-server.md sets them beside hypercorn's options):
- Deadlines. A new connection has `head_timeout` to deliver its first request
  head, TLS handshake included; a kept-alive one waits `keep_alive_timeout` for
  the next request to begin, then `head_timeout` for the rest of its head. A
  body has `body_timeout` from the end of its head; a body the app left unread
  gets `discard_timeout` to be read and dropped; every write must make
  progress within `write_timeout`. A deadline closes the connection, after a
  408 when a request had begun and nothing was answered.
- Caps. Head size (`h11_max_incomplete_size`, else 431), requests per
  connection (`keep_alive_max_requests`; the last reply says `Connection:
  close`), open connections (`max_connections`; one more is closed at once,
  unread).
- The client's going away. Once the app has the body, the socket is still
  read while the app works, so `receive()` answers `http.disconnect` when the
  client closes (a long-poll then stops waiting); bytes of a next request that
  arrive meanwhile are kept for it.
- Shutdown. Stop accepting, close idle connections, give requests in flight
  `graceful_timeout` to answer, cancel what is left, and give the app's
  lifespan shutdown `shutdown_timeout`.
Counts of open, refused and timed-out connections go to `metrics.HttpCounters`.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import TypeAlias
from urllib.parse import unquote_to_bytes

import h11
import trio

from openrld.api.metrics import HttpCounters
from openrld.api.wire import error_body
from openrld.config import HttpLimits

logger = logging.getLogger(__name__)

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
Stream = trio.SocketStream | trio.SSLStream

# What h11's `next_event` answers: an event, or that it needs more bytes, or is paused after a message.
_Parsed: TypeAlias = "h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]"

RECEIVE_BYTES = 64 * 1024
SEND_BYTES = 256 * 1024  # a write larger than this goes in pieces, each with its own write_timeout
UNREAD_BODY_BYTES = 1 << 20  # after a reply, read at most this much of a body the app left, then close
LINGER_S = 2.0  # closing with a body still arriving: how long to drain it so that the reply is not reset


class Server:
    """Serves one ASGI app on TCP listeners until `stop` is set, then drains."""

    def __init__(
        self,
        app: ASGIApp,
        limits: HttpLimits = HttpLimits(),
        *,
        ssl_context: ssl.SSLContext | None = None,
        counters: HttpCounters | None = None,
    ) -> None:
        self._app = app
        self._limits = limits
        self._ssl_context = ssl_context
        self._counters = counters if counters is not None else HttpCounters()
        self._lifespan_state: dict = {}
        self._idle: set[trio.CancelScope] = set()  # connections waiting for their next request
        self._in_flight = 0
        self._draining = False
        self._drained = trio.Event()

    async def serve(
        self,
        host: str,
        port: int,
        stop: trio.Event,
        *,
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the app's lifespan, bind, report the bound URLs, serve until `stop`, drain, shut the app down."""
        lifespan = _Lifespan(self._app, self._lifespan_state)
        async with trio.open_nursery() as outer:
            await outer.start(lifespan.run)
            listeners = await trio.open_tcp_listeners(port, host=host)
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    serve = partial(trio.serve_listeners, self._connection, listeners, handler_nursery=connections)
                    accepting.start_soon(serve)
                    scheme = "https" if self._ssl_context is not None else "http"
                    task_status.started([_url(listener, scheme) for listener in listeners])
                    await stop.wait()
                    accepting.cancel_scope.cancel()
                for listener in listeners:
                    await listener.aclose()
                await self._drain()
                connections.cancel_scope.cancel()
            with trio.move_on_after(self._limits.shutdown_timeout) as waited:
                await lifespan.shutdown()
            if waited.cancelled_caught:
                logger.warning("the app's shutdown took over shutdown_timeout=%ss; stopped", self._limits.shutdown_timeout)
            outer.cancel_scope.cancel()

    async def _drain(self) -> None:
        """Close idle connections, and give the requests in flight `graceful_timeout` to answer."""
        self._draining = True
        for scope in self._idle:
            scope.cancel()
        if self._in_flight:
            with trio.move_on_after(self._limits.graceful_timeout):
                await self._drained.wait()

    def _closes_after(self, is_last: bool) -> bool:
        """Whether a reply is its connection's last: the server drains, or it is the last the cap allows."""
        return self._draining or is_last

    async def _connection(self, raw: trio.SocketStream) -> None:
        counters = self._counters
        if counters.open_connections >= self._limits.max_connections:
            counters.refused_connections += 1
            await raw.aclose()  # at once and unread: a connection held open here is what the cap prevents
            return
        counters.open_connections += 1
        stream: Stream = raw
        if self._ssl_context is not None:
            # The handshake runs inside the first read, so head_timeout bounds it too.
            stream = trio.SSLStream(raw, self._ssl_context, server_side=True, https_compatible=True)
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=self._limits.h11_max_incomplete_size)
        client, local = _addresses(raw)
        try:
            served = 0
            while not self._draining:
                request = await self._next_request(connection, stream, is_first=served == 0)
                if request is None:
                    return
                served += 1
                is_last = served >= self._limits.keep_alive_max_requests
                scope = _scope(request, client, local, self._lifespan_state, "https" if stream is not raw else "http")
                exchange = _Exchange(connection, stream, self._limits, counters, partial(self._closes_after, is_last))
                self._in_flight += 1
                try:
                    await exchange.run(self._app, scope)
                finally:
                    self._in_flight -= 1
                    if self._draining and not self._in_flight:
                        self._drained.set()
                if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                    break  # the reply was cut short, or one side asked to close
                connection.start_next_cycle()
            if connection.their_state is h11.SEND_BODY:
                await _linger(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away, or its TLS handshake failed
        except Exception:  # a bug here ends this connection, never the server
            logger.exception("HTTP connection failed client=%s", client)
        finally:
            counters.open_connections -= 1
            # TLS says goodbye unless the client stalls; the socket closes either way.
            with trio.CancelScope(shield=True, relative_deadline=LINGER_S):
                await stream.aclose()

    async def _next_request(self, connection: h11.Connection, stream: Stream, *, is_first: bool) -> h11.Request | None:
        """The next request's head; None once the client closed, ran out of time, or sent something that is not HTTP.

        A new connection's whole first head is due within head_timeout. A kept-alive connection
        may idle for keep_alive_timeout; once its next request begins, the head is due within
        head_timeout of that.
        """
        limits = self._limits
        begun = bool(connection.trailing_data[0])  # a pipelined request may have begun already
        idle = trio.CancelScope(
            relative_deadline=limits.head_timeout if is_first or begun else limits.keep_alive_timeout
        )
        if not begun:
            self._idle.add(idle)
        received = 0
        try:
            with idle:
                while True:
                    try:
                        event = connection.next_event()
                    except h11.RemoteProtocolError as error:
                        await _refuse(connection, stream, error.error_status_hint, f"bad HTTP request: {error}")
                        return None
                    if isinstance(event, h11.Request):
                        # h11 bounds a head still incomplete; one that arrived whole in a large read is
                        # measured here (the usual head came in a read under the limit: nothing to count).
                        limit = limits.h11_max_incomplete_size
                        if received > limit and _head_bytes(event) > limit:
                            await _refuse(connection, stream, 431, f"request head over {limit} bytes")
                            return None
                        return event
                    if event is not h11.NEED_DATA:
                        return None  # ConnectionClosed
                    data = await stream.receive_some(RECEIVE_BYTES)
                    if data and not begun:
                        begun = True
                        self._idle.discard(idle)  # a request is arriving: a drain lets it finish
                        if not is_first:
                            idle.deadline = trio.current_time() + limits.head_timeout
                    received += len(data)
                    _feed(connection, data)
        finally:
            self._idle.discard(idle)
        if idle.cancelled_caught and not self._draining:
            self._counters.timeouts["head" if begun or is_first else "keep_alive"] += 1
            if begun:
                with trio.move_on_after(limits.write_timeout):
                    await _refuse(connection, stream, 408, f"request head not received within {limits.head_timeout} s")
        return None


class _Exchange:
    """One request and its reply: the `receive` and `send` of one ASGI call."""

    def __init__(
        self,
        connection: h11.Connection,
        stream: Stream,
        limits: HttpLimits,
        counters: HttpCounters,
        closing: Callable[[], bool],
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._limits = limits
        self._counters = counters
        self._closing = closing  # the reply is this connection's last: the server drains, or the cap is reached
        self._body_deadline = trio.current_time() + limits.body_timeout
        self._timed_out = False  # the body did not arrive in time: the connection ends with this exchange
        self._response: h11.Response | None = None  # from http.response.start, sent with the first body
        self._body_read = False
        self._held: _Parsed | None = None  # an event read ahead while looking for the body's end
        self._over = trio.Event()  # the app has returned, or the client has gone
        self._watch: trio.CancelScope | None = None  # the read that waits for the client's close

    async def run(self, app: ASGIApp, scope: dict) -> None:
        try:
            await app(scope, self._receive, self._send)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise  # the client went away mid-reply: its connection ends, quietly
        except Exception:  # one request's failure is its own; the connection closes if its reply was cut short
            logger.exception("unhandled error in the app path=%s", scope["path"])
        finally:
            self._over.set()
            if self._watch is not None:
                self._watch.cancel()
        if self._connection.our_state is h11.SEND_RESPONSE:  # the app failed or returned before answering
            status, detail = (408, b"request body not received in time") if self._timed_out else (500, b"")
            await self._emit({"type": "http.response.start", "status": status, "headers": [(b"content-length", str(len(detail)).encode())]})
            await self._emit({"type": "http.response.body", "body": detail})
        if not self._timed_out:
            await self._discard_unread_body()

    async def _discard_unread_body(self) -> None:
        """Read the rest of a body the app did not read (a refused upload), up to UNREAD_BODY_BYTES.

        Then the connection can carry on; past the limit or discard_timeout it closes. Either way
        the client gets its reply: a socket closed with unread input resets, which can destroy a
        reply still in flight.
        """
        left = UNREAD_BODY_BYTES
        with trio.move_on_after(self._limits.discard_timeout) as discarding:
            while self._connection.their_state is h11.SEND_BODY and self._connection.our_state is h11.DONE and left > 0:
                message = await self._receive()
                left -= len(message.get("body", b""))
                if message["type"] == "http.disconnect":
                    return
        if discarding.cancelled_caught:
            self._counters.timeouts["discard"] += 1

    async def _receive(self) -> dict:
        if self._body_read:
            return await self._until_disconnect()
        if self._connection.client_is_waiting_for_100_continue:
            await self._write(self._connection.send(h11.InformationalResponse(status_code=100, headers=[])))
        event = await self._next_body_event()
        if isinstance(event, h11.Data):
            # A body that arrived whole goes up as one message, as most do.
            following = self._next_parsed()
            if isinstance(following, h11.EndOfMessage):
                self._body_read = True
                return {"type": "http.request", "body": bytes(event.data), "more_body": False}
            self._held = following
            return {"type": "http.request", "body": bytes(event.data), "more_body": True}
        self._body_read = True
        if isinstance(event, h11.EndOfMessage):
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}  # the client closed mid-body, or its body ran out of time

    async def _until_disconnect(self) -> dict:
        """ASGI's message after the body: `http.disconnect`, once the app has answered or the client has gone.

        The socket is read meanwhile, so that a client's close is seen while the app still
        works (a long-poll stops holding a result for nobody). What arrives instead is a
        pipelined next request: h11 keeps it, and reading stops once a whole head's worth
        is kept. One caller reads; any other waits with it.
        """
        if self._watch is None and not self._over.is_set():
            with trio.CancelScope() as self._watch:
                while len(self._connection.trailing_data[0]) <= self._limits.h11_max_incomplete_size:
                    data = await self._stream.receive_some(RECEIVE_BYTES)
                    _feed(self._connection, data)  # b"" tells h11 of the close, for the next request
                    if not data:
                        self._over.set()
                        break
        await self._over.wait()
        return {"type": "http.disconnect"}

    async def _next_body_event(self) -> h11.Data | h11.EndOfMessage | h11.ConnectionClosed:
        event, self._held = self._held, None
        if event is None:
            event = self._next_parsed()
        while event is h11.NEED_DATA:
            with trio.move_on_at(self._body_deadline):
                _feed(self._connection, await self._stream.receive_some(RECEIVE_BYTES))
                event = self._next_parsed()
                continue
            self._timed_out = True
            self._counters.timeouts["body"] += 1
            return h11.ConnectionClosed()
        if isinstance(event, h11.Data | h11.EndOfMessage | h11.ConnectionClosed):
            return event
        return h11.ConnectionClosed()  # h11 gives nothing else within a body; were it to, the exchange ends

    def _next_parsed(self) -> _Parsed:
        """h11's next event from what has arrived: NEED_DATA when it needs more bytes."""
        try:
            return self._connection.next_event()
        except h11.RemoteProtocolError:
            return h11.ConnectionClosed()  # a malformed body ends the exchange as a disconnect would

    async def _send(self, message: dict) -> None:
        if self._timed_out:
            return  # the app was told the client had gone; the server answers 408 itself
        await self._emit(message)

    async def _emit(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if self._closing() or self._timed_out:
                headers.append((b"connection", b"close"))
            self._response = h11.Response(status_code=message["status"], headers=headers)
            return
        state = self._connection.our_state
        writable = state is h11.SEND_RESPONSE or state is h11.SEND_BODY
        if message["type"] != "http.response.body" or self._response is None or not writable:
            return  # a body before the start, or after the end: nothing to write
        data = self._connection.send(self._response) if state is h11.SEND_RESPONSE else b""
        body = message.get("body", b"")
        if body:
            data += self._connection.send(h11.Data(data=body))
        if not message.get("more_body", False):
            data += self._connection.send(h11.EndOfMessage())
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        """Send `data`; each SEND_BYTES of it must go within write_timeout, else the connection ends."""
        view = memoryview(data) if len(data) > SEND_BYTES else data
        for start in range(0, len(data), SEND_BYTES):
            with trio.move_on_after(self._limits.write_timeout):
                await self._stream.send_all(view[start : start + SEND_BYTES])
                continue
            self._counters.timeouts["write"] += 1
            raise trio.BrokenResourceError("the client read nothing within write_timeout")


class _Lifespan:
    """ASGI's lifespan protocol, so that the app's startup and shutdown hooks run.

    An app that returns from the lifespan scope (or raises on it) does not speak
    the protocol; it then needs no start or stop, and nothing waits for it.
    """

    def __init__(self, app: ASGIApp, state: dict) -> None:
        self._app = app
        self._state = state
        self._to_app_send, self._to_app = trio.open_memory_channel[dict](math.inf)
        self._started = trio.Event()
        self._stopped = trio.Event()
        self._failure: str | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the app's lifespan task; report started once the app has answered startup."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._app_task)
            self._to_app_send.send_nowait({"type": "lifespan.startup"})
            await self._started.wait()
            if self._failure is not None:
                raise RuntimeError(f"the app failed to start: {self._failure}")
            task_status.started()

    async def shutdown(self) -> None:
        self._to_app_send.send_nowait({"type": "lifespan.shutdown"})
        await self._stopped.wait()

    async def _app_task(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self._state}
        try:
            await self._app(scope, self._to_app.receive, self._from_app)
        except Exception:
            logger.debug("the app does not take the lifespan scope", exc_info=True)
        finally:
            self._started.set()
            self._stopped.set()

    async def _from_app(self, message: dict) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            self._failure = message.get("message", "")
        if kind.startswith("lifespan.startup."):
            self._started.set()
        elif kind.startswith("lifespan.shutdown."):
            self._stopped.set()


def _scope(
    request: h11.Request,
    client: tuple[str, int] | None,
    local: tuple[str, int] | None,
    lifespan_state: dict,
    scheme: str,
) -> dict:
    path, _, query = request.target.partition(b"?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.http_version.decode(),
        "method": request.method.decode(),
        "scheme": scheme,
        "path": unquote_to_bytes(path).decode("utf-8", "surrogateescape") if b"%" in path else path.decode("latin-1"),
        "raw_path": path,
        "query_string": query,
        "root_path": "",
        "headers": list(request.headers),
        "client": client,
        "server": local,
        "state": dict(lifespan_state),
    }


async def _linger(stream: Stream) -> None:
    """Close the way out, then discard what the client still sends for a moment before the socket closes.

    Closing a socket with unread input sends a reset, and a reset can destroy the
    reply still on its way to a client that is busy sending a body nobody reads.
    (TLS has no half-close: there the discarding alone has to do.)
    """
    if isinstance(stream, trio.SocketStream):
        await stream.send_eof()
    with trio.move_on_after(LINGER_S):
        while await stream.receive_some(RECEIVE_BYTES):
            pass


def _head_bytes(request: h11.Request) -> int:
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + len(b": \r\n") for name, value in request.headers)


async def _refuse(connection: h11.Connection, stream: Stream, status: int, detail: str) -> None:
    """Answer a request that never reaches the app, and close: h11 could not parse it, or its head is too long."""
    if connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = error_body(detail)
    # Written by hand: h11 sends a response only to a request it has parsed, and a head that
    # timed out never was one. The connection closes after it, so h11's state does not matter.
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    await stream.send_all(head.encode() + body)


def _feed(connection: h11.Connection, data: bytes | bytearray) -> None:
    """Hand h11 what the socket read. A TLS stream's read is a bytearray; h11 annotates bytes but only
    appends the data to its own bytearray buffer, so either serves, and a bytes() copy would cost every read."""
    connection.receive_data(data)  # type: ignore[arg-type]  # h11's stub says bytes; it takes any buffer


def _addresses(stream: trio.SocketStream) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    try:
        peer, local = stream.socket.getpeername(), stream.socket.getsockname()
    except OSError:
        return None, None
    return (peer[0], peer[1]), (local[0], local[1])


def _url(listener: trio.SocketListener, scheme: str) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
