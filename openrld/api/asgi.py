"""The ASGI plumbing the layers of the front share: a body read within its limit, a reply sent, a body replayed.

The gate, the relay (`cluster/relay.py`) and the fast path each speak plain
ASGI; what they read and send goes through here, so that a body is counted
against `max_body_bytes` and a reply framed (its Content-Length last) in one
place. No layer buffers a body another has already read: the relay hands on
the bytes it read with `replay`.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable

import trio

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


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
