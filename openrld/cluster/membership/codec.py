"""Encoding of membership messages and their authentication with the cluster secret.

A datagram is `version (1 byte) | tag (16 bytes) | msgpack array of messages`,
where the tag is HMAC-SHA256 over a purpose label, the version byte and the
body, cut to 16 bytes. A push-pull body is the msgpack `PushPull` alone; its
tag travels in an HTTP header (`push_pull_tag`), computed the same way under
a different label, so a captured datagram can never pass as a push-pull body
or the other way round. Anything malformed, oversized, of a version outside
the supported range, or with a wrong tag raises `BadFrame` naming why; the
caller drops it and counts it. This module holds no state and does no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from openrld.cluster.membership.messages import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Message,
    PushPull,
)

TAG_BYTES = 16  # 128 bits of HMAC-SHA256: forging one is out of reach, and it keeps datagrams small
HEADER_BYTES = 1 + TAG_BYTES
MAX_DATAGRAM_BYTES = 65_507  # the most a UDP/IPv4 datagram can carry
MAX_PUSH_PULL_BYTES = 16 * 1024 * 1024  # a full state of thousands of members with their jobs, with room

_DATAGRAM_LABEL = b"openrld-gossip-datagram"
_PUSH_PULL_LABEL = b"openrld-gossip-pushpull"

_encoder = msgspec.msgpack.Encoder()
_messages_decoder = msgspec.msgpack.Decoder(list[Message])
_push_pull_decoder = msgspec.msgpack.Decoder(PushPull)


class DropReason(enum.Enum):
    TOO_SHORT = "too_short"
    TOO_LARGE = "too_large"
    BAD_VERSION = "bad_version"
    BAD_TAG = "bad_tag"
    UNDECODABLE = "undecodable"


class BadFrame(Exception):
    """A datagram or body that is dropped; `reason` says which check it failed."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


def _tag(key: bytes, label: bytes, version: int, body: bytes) -> bytes:
    return hmac.digest(key, label + bytes((version,)) + body, hashlib.sha256)[:TAG_BYTES]


def secret_key(cluster_secret: str) -> bytes:
    """The HMAC key for a cluster secret (its UTF-8 bytes; HMAC hashes long keys itself)."""
    if not cluster_secret:
        raise ValueError("the cluster secret must not be empty")
    return cluster_secret.encode()


def encode_messages(messages: list[Message]) -> bytes:
    """The msgpack body of a datagram; `seal_datagram` adds the header."""
    return _encoder.encode(messages)


def encoded_size(message: Message) -> int:
    """Bytes one message adds to a datagram body (msgpack array framing aside)."""
    return len(_encoder.encode(message))


def seal_datagram(key: bytes, body: bytes) -> bytes:
    version = PROTOCOL_VERSION
    return bytes((version,)) + _tag(key, _DATAGRAM_LABEL, version, body) + body


def open_datagram(key: bytes, frame: bytes) -> list[Message]:
    """The messages in a datagram.

    Raises:
        BadFrame: too short or too long, an unsupported version, a wrong tag, or a body
            that is not a list of known messages.
    """
    if len(frame) <= HEADER_BYTES:
        raise BadFrame(DropReason.TOO_SHORT, f"{len(frame)} bytes")
    if len(frame) > MAX_DATAGRAM_BYTES:
        raise BadFrame(DropReason.TOO_LARGE, f"{len(frame)} bytes")
    version = frame[0]
    if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
        raise BadFrame(DropReason.BAD_VERSION, f"version {version}")
    body = frame[HEADER_BYTES:]
    if not hmac.compare_digest(frame[1:HEADER_BYTES], _tag(key, _DATAGRAM_LABEL, version, body)):
        raise BadFrame(DropReason.BAD_TAG, "the tag does not match the cluster secret")
    try:
        return _messages_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise BadFrame(DropReason.UNDECODABLE, str(exc)) from exc


def encode_push_pull(key: bytes, state: PushPull) -> tuple[bytes, str]:
    """(body, hex tag) for a push-pull request or answer."""
    body = _encoder.encode(state)
    return body, _tag(key, _PUSH_PULL_LABEL, PROTOCOL_VERSION, body).hex()


def push_pull_tag_matches(key: bytes, body: bytes, tag_hex: str) -> bool:
    """Whether `tag_hex` is this cluster's tag over `body` (constant-time)."""
    expected = _tag(key, _PUSH_PULL_LABEL, PROTOCOL_VERSION, body).hex()
    return hmac.compare_digest(expected, tag_hex.strip().lower())


def decode_push_pull(key: bytes, body: bytes, tag_hex: str) -> PushPull:
    """A push-pull whose tag was checked.

    Raises:
        BadFrame: oversized, a wrong tag, or not a PushPull.
    """
    if len(body) > MAX_PUSH_PULL_BYTES:
        raise BadFrame(DropReason.TOO_LARGE, f"{len(body)} bytes")
    if not push_pull_tag_matches(key, body, tag_hex):
        raise BadFrame(DropReason.BAD_TAG, "the tag does not match the cluster secret")
    try:
        return _push_pull_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise BadFrame(DropReason.UNDECODABLE, str(exc)) from exc
