"""The ASGI plumbing the layers of the front share: a body read within its limit, the one reply type
and its sending, a body replayed.

The gate, the relay (`cluster/relay.py`) and the fast path each speak plain
ASGI; what they read and send goes through here, so that a body is counted
against `max_body_bytes` and a reply framed (its Content-Length last) in one
place. Every layer's reply is a `Reply`, a peer's passed on by the relay too
(`cluster/peer_client.py`); quart's routes carry one as quart's Response
(`app.response_of`). No layer buffers a body another has already read: the
relay hands on the bytes it read with `replay`.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
import trio

from openrld.api import wire

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Reply(msgspec.Struct, frozen=True):
    """An HTTP reply, whole: what a handler returns, and what the gate, the fast path and the relay send
    (`send_whole`). The relay keeps a peer's reply, or this node's app's, in one too while it passes it
    back or reads it (`cluster/peer_client.py`, `cluster/reach.py`): those come with their Content-Type
    among their headers, kept in the order they came, and `content_type` None."""

    body: bytes
    content_type: str | None = "application/json"  # sent first; None: any Content-Type is in `headers`
    status: int = 200
    headers: tuple[tuple[bytes, bytes], ...] = ()  # lower-case names, no Content-Length (the sender sets it)

    def all_headers(self) -> list[tuple[bytes, bytes]]:
        """Its headers as sent: the Content-Type first (unless it is among `headers`), then `headers`."""
        if self.content_type is None:
            return list(self.headers)
        return [(b"content-type", self.content_type.encode()), *self.headers]

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), the Content-Type included."""
        return next((value for key, value in self.all_headers() if key == name), None)


_json = msgspec.json.Encoder()


def json_reply(value: Any, status: int = 200, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Reply:
    return Reply(_json.encode(value), status=status, headers=headers)


def detail_reply(status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Reply:
    """`wire.ErrorResponse` with `status`: the FastAPI-style body the SDK and the CLI read `detail` from."""
    return Reply(wire.error_body(detail), status=status, headers=headers)


class Unread(enum.Enum):
    """Why a body was not read whole."""

    TOO_LARGE = "too large"  # past max_body_bytes; no more of it was read
    DISCONNECTED = "disconnected"  # the client went away mid-body


async def read_body(receive: Receive, max_body_bytes: int) -> bytes | Unread:
    """The request's whole body, or why it was not read whole.

    A body that came as one message (as most do: `http1.py` sends a body that arrived
    whole at once, and `replay` always does) is handed on as it is, not copied.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return Unread.DISCONNECTED
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body_bytes:
            return Unread.TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_reply(send: Send, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> None:
    """One whole reply: `headers` (lower-case names, no Content-Length), then its Content-Length, then `body`."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_whole(send: Send, reply: Reply) -> None:
    """`reply` sent as one ASGI response, its Content-Type first."""
    await send_reply(send, reply.status, reply.all_headers(), reply.body)


def replay(body: bytes, then: Receive | None = None) -> Receive:
    """An ASGI receive that hands over `body` once, then passes on the connection's own
    messages (`then`: its disconnect), or waits like a connection that stays open."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if then is not None:
            return await then()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return receive
