"""The shared ASGI plumbing: a body read within its limit, and a reply framed with its length."""

from __future__ import annotations

from openrld.api.asgi import Unread, read_body, replay, send_reply


def receiving(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


async def test_a_body_in_one_message_is_handed_on_as_the_same_bytes_object() -> None:
    body = b'{"model_id": "m-1"}'
    assert await read_body(replay(body), 100) is body


async def test_a_body_in_several_messages_is_joined() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"cd"}
    )
    assert await read_body(receive, 4) == b"abcd"


async def test_a_body_past_the_limit_is_too_large_and_no_more_is_read() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"abc", "more_body": True},
        {"type": "http.request", "body": b"de", "more_body": True},
        {"type": "http.request", "body": b"never read"},
    )
    assert await read_body(receive, 4) is Unread.TOO_LARGE


async def test_a_client_that_leaves_mid_body_is_disconnected() -> None:
    receive = receiving({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})
    assert await read_body(receive, 100) is Unread.DISCONNECTED


async def test_a_reply_carries_its_headers_then_its_content_length_then_its_body() -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await send_reply(send, 429, [(b"content-type", b"application/json"), (b"retry-after", b"1")], b"{}")
    assert sent == [
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"), (b"content-length", b"2")],
        },
        {"type": "http.response.body", "body": b"{}"},
    ]
