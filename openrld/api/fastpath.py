"""The hot routes as plain ASGI, in front of the quart app.

The training and sampling loop spends its HTTP time on four POSTs: submit a
forward_backward, an optim_step or a sample, and long-poll `retrieve_future`.
Quart's request machinery costs about as much as the whole HTTP round trip on
these, so they are served here directly: read the bounded body, authenticate,
call the route's handler, write the reply. Every other path goes to quart.
The handlers are the same code either way; only the framing differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import trio

from openrld.api.asgi import Reply, Unread, detail_reply, read_body, send_whole
from openrld.api.auth import SCOPE_USER
from openrld.api.http1 import ASGIApp
from openrld.api.metrics import RequestMetrics
from openrld.errors import InvalidToken, OpenrldError

logger = logging.getLogger(__name__)

# Beside an error that means "not here, maybe elsewhere" (errors.NoCapacity), for a node placing a job.
NO_CAPACITY_HEADER = b"x-openrl-no-capacity"


class Call(msgspec.Struct, frozen=True):
    """One request as a handler sees it."""

    body: bytes
    api_key: str | None
    user: str | None  # the user the gate found for api_key; None where it looked for none (api/auth.py user_in)
    content_encoding: str | None
    content_type: str | None = None  # None: read as JSON (api/media.py)
    accept: str | None = None  # picks the form of a result that has two (api/media.py)


Handler = Callable[[Call], Awaitable[Reply]]
T = TypeVar("T")

class FastPath:
    """ASGI: POST routes in `routes` are served directly; everything else goes to `fallback`."""

    def __init__(
        self,
        fallback: ASGIApp,
        routes: dict[str, Handler],
        *,
        max_body_bytes: int,
        metrics: RequestMetrics | None = None,
        longpolls: frozenset[str] = frozenset(),
    ) -> None:
        self._fallback = fallback
        self._routes = routes
        self._max_body_bytes = max_body_bytes
        self._longpolls = longpolls  # their handler is cancelled when the client goes away
        self._metrics = metrics  # the quart app counts the requests it serves; this counts the hot routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        handler = self._routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self._fallback(scope, receive, send)
            return
        arrived_s = time.perf_counter()
        reply = await self._serve(handler, scope, receive)
        if reply is None:
            return  # the client went away: nobody to answer
        if self._metrics is not None:
            self._metrics.observe(scope["path"], "POST", reply.status, time.perf_counter() - arrived_s)
        await send_whole(send, reply)

    async def _serve(self, handler: Handler, scope: dict, receive: Callable) -> Reply | None:
        headers = {name.lower(): value for name, value in scope["headers"]}
        body = await read_body(receive, self._max_body_bytes)
        if body is Unread.DISCONNECTED:
            return None  # mid-body: a truncated body is never handled
        if body is Unread.TOO_LARGE:
            return detail_reply(413, f"request body over {self._max_body_bytes} bytes")
        call = Call(
            body=body,
            api_key=_text(headers.get(b"x-api-key")),
            user=scope.get(SCOPE_USER),
            content_encoding=_text(headers.get(b"content-encoding")),
            content_type=_text(headers.get(b"content-type")),
            accept=_text(headers.get(b"accept")),
        )
        try:
            if scope["path"] in self._longpolls:
                return await until_disconnect(receive, handler, call)
            return await handler(call)
        except OpenrldError as error:
            return error_reply(error)
        except Exception as error:  # one request's failure is its own; the daemon keeps serving
            logger.exception("unhandled error path=%s", scope.get("path"))
            return detail_reply(500, f"internal error: {type(error).__name__}")


async def until_disconnect(receive: Callable[[], Awaitable[dict]], fn: Callable[..., Awaitable[T]], *args: Any) -> T | None:
    """`fn(*args)`, or None once the client goes away first (after the body, ASGI's next message says so).

    What `fn` raises is raised as it is, not inside the nursery's ExceptionGroup, so that
    callers catch an OpenrldError here as they would without the watch.
    """
    outcome: list[T | _Raised] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            await receive()  # http.disconnect: the client has gone
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            outcome.append(await fn(*args))
        except Exception as error:  # trio.Cancelled is no Exception: a disconnect still cancels
            outcome.append(_Raised(error))
        nursery.cancel_scope.cancel()
    if not outcome:
        return None
    if isinstance(outcome[0], _Raised):
        raise outcome[0].error
    return outcome[0]


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def error_headers(error: OpenrldError) -> tuple[tuple[bytes, bytes], ...]:
    """The headers the SDK reads beside an error status."""
    if isinstance(error, InvalidToken):
        return ((b"www-authenticate", b'Bearer realm="openrld", error="invalid_token"'),)
    if error.status == 401:
        return ((b"www-authenticate", b'ApiKey realm="openrld"'),)
    if error.status == 429:
        return ((b"retry-after", b"1"),)
    if getattr(error, "no_capacity", False):
        return ((NO_CAPACITY_HEADER, b"1"),)  # a placer offering the job here tries the next node
    return ()


def error_reply(error: OpenrldError) -> Reply:
    return detail_reply(error.status, error.detail, error_headers(error))


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")
