"""The fast path's long-poll routes: a handler's error is its answer, and a client that leaves ends the wait."""

from __future__ import annotations

import msgspec
import trio

from openrld.api.asgi import Reply
from openrld.api.fastpath import Call, FastPath
from openrld.errors import NotFound

PATH = "/api/v1/retrieve_future"


def scope() -> dict:
    return {"type": "http", "method": "POST", "path": PATH, "headers": [], "query_string": b""}


async def serve(handler, leave_after_s: float | None) -> list[dict]:
    """The messages the fast path sends for one long-poll; the client leaves after `leave_after_s`, or stays."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if leave_after_s is None:
            await trio.sleep_forever()
        await trio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    app = FastPath(None, {PATH: handler}, max_body_bytes=100, longpolls=frozenset({PATH}))  # type: ignore[arg-type]
    await app(scope(), receive, send)
    return sent


async def test_a_long_polls_error_is_answered_with_its_status() -> None:
    async def missing(call: Call) -> Reply:
        raise NotFound("no request 'r-1'")

    sent = await serve(missing, None)
    assert (sent[0]["status"], msgspec.json.decode(sent[1]["body"])) == (404, {"detail": "no request 'r-1'"})


async def test_a_long_poll_whose_client_leaves_stops_waiting_and_sends_nothing(autojump_clock) -> None:
    async def held(call: Call) -> Reply:
        await trio.sleep(30)
        return Reply(b"{}")

    with trio.fail_after(1):
        assert await serve(held, 0.5) == []


async def test_a_long_poll_answered_before_its_client_leaves_is_sent() -> None:
    async def ready(call: Call) -> Reply:
        return Reply(b'{"done": true}')

    sent = await serve(ready, None)
    assert (sent[0]["status"], sent[1]["body"]) == (200, b'{"done": true}')
