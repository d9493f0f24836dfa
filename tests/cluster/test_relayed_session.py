"""A relayed session is taken only when the cluster's relay key signed it."""

from __future__ import annotations

from openrld.cluster.peer_client import relay_key, sign
from openrld.cluster.relayed_session import (
    SESSION_HEADER,
    SESSION_TAG_HEADER,
    SessionSnapshot,
    session_headers,
    session_of,
)

KEY = relay_key("cluster-secret")
SNAPSHOT = SessionSnapshot("s-1", "alice", ["openrl.exclusive=true"], {"team": "rl"}, "0.38.0", None, "run")


def received(headers: list[tuple[str, str]]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in headers}


def test_a_signed_session_round_trips():
    assert session_of(received(session_headers(SNAPSHOT, KEY)), KEY) == SNAPSHOT


def test_a_session_signed_with_another_secret_is_dropped():
    assert session_of(received(session_headers(SNAPSHOT, relay_key("another"))), KEY) is None


def test_a_session_changed_after_signing_is_dropped():
    headers = received(session_headers(SNAPSHOT, KEY))
    forged = session_headers(SessionSnapshot("s-1", "mallory", [], {}, "0.38.0", None, None), KEY)[0][1]
    assert session_of({**headers, SESSION_HEADER.encode(): forged.encode()}, KEY) is None


def test_a_signed_value_that_does_not_decode_is_dropped():
    assert session_of({SESSION_HEADER.encode(): b"!!", SESSION_TAG_HEADER.encode(): sign(KEY, b"!!").encode()}, KEY) is None


def test_a_request_without_a_session_carries_none():
    assert session_of({}, KEY) is None
    assert session_of({SESSION_HEADER.encode(): b"x"}, KEY) is None
