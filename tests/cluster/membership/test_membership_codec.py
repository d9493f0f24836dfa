"""The membership codec: compact msgpack, the cluster-secret tag, and what gets dropped."""

from __future__ import annotations

import pytest

from openrld.cluster.membership.codec import (
    BadFrame,
    DropReason,
    decode_push_pull,
    encode_messages,
    encode_push_pull,
    open_datagram,
    seal_datagram,
)
from openrld.cluster.membership.messages import (
    Ack,
    Alive,
    DeviceSlot,
    GroupLoad,
    MemberRecord,
    MemberState,
    NodePayload,
    Ping,
    PushPull,
)

KEY = b"secret"


def test_datagram_round_trips_and_a_ping_is_small() -> None:
    messages = [Ping(7, "node-b", "node-a"), Ack(7)]
    frame = seal_datagram(KEY, encode_messages(messages))
    assert open_datagram(KEY, frame) == messages
    # 1 version byte + 16 tag bytes + msgpack [[1, 7, "node-b", "node-a"], [3, 7]]: 1 + (1+1+1+7+7) + 3 bytes
    assert len(frame) == 17 + 21


def test_payload_round_trips() -> None:
    payload = NodePayload(
        peer_url="http://10.0.0.2:8000",
        devices=(DeviceSlot("cuda:0", "cuda", 80 << 30, 60 << 30),),
        groups=(GroupLoad("Qwen/Qwen3-8B", 3, 5),),
        jobs=("m-1", "m-2"),
    )
    frame = seal_datagram(KEY, encode_messages([Alive("b", 4, "10.0.0.2:7946", payload)]))
    assert open_datagram(KEY, frame) == [Alive("b", 4, "10.0.0.2:7946", payload)]


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda f: f[:10], DropReason.TOO_SHORT),
        (lambda f: bytes((9,)) + f[1:], DropReason.BAD_VERSION),
        (lambda f: f[:-1] + bytes((f[-1] ^ 1,)), DropReason.BAD_TAG),
        (lambda f: f[:1] + bytes(16) + f[17:], DropReason.BAD_TAG),
    ],
    ids=["truncated", "future-version", "flipped-body-bit", "zeroed-tag"],
)
def test_mangled_datagram_is_dropped_naming_why(mangle, reason: DropReason) -> None:
    frame = seal_datagram(KEY, encode_messages([Ping(1, "b", "a")]))
    with pytest.raises(BadFrame) as caught:
        open_datagram(KEY, mangle(frame))
    assert caught.value.reason is reason


def test_datagram_sealed_with_another_secret_is_dropped() -> None:
    frame = seal_datagram(b"other", encode_messages([Ping(1, "b", "a")]))
    with pytest.raises(BadFrame) as caught:
        open_datagram(KEY, frame)
    assert caught.value.reason is DropReason.BAD_TAG


def test_well_tagged_garbage_is_undecodable() -> None:
    with pytest.raises(BadFrame) as caught:
        open_datagram(KEY, seal_datagram(KEY, b"\x92\x63\x01"))  # [99, 1]: no message has tag 99
    assert caught.value.reason is DropReason.UNDECODABLE


def test_push_pull_round_trips_and_its_tag_does_not_pass_as_a_datagram() -> None:
    state = PushPull("a", True, (MemberRecord("a", "a:1", 2, MemberState.ALIVE, NodePayload()),))
    body, tag = encode_push_pull(KEY, state)
    assert decode_push_pull(KEY, body, tag) == state
    with pytest.raises(BadFrame):
        decode_push_pull(KEY, body, "00" * 16)
    with pytest.raises(BadFrame):
        open_datagram(KEY, bytes((1,)) + bytes.fromhex(tag) + body)  # same bytes, datagram label
