"""The relay's partial read of a forward_backward body: its model_id, and nothing else decoded.

Bodies are built with the SDK's own protobuf classes, as the SDK sends them.
"""

from __future__ import annotations

import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as sdk_pb

from openrld.api.proto import forward_backward_model_id, forward_backward_seq_id

LIMIT = 1 << 20
MODEL_ID = "sess-1:train:0"


def sdk_body(model_id: str = MODEL_ID, datum_bytes: int = 64) -> bytes:
    datum = sdk_pb.Datum(loss_fn_inputs={"weights": sdk_pb.Tensor(dense=b"\0" * datum_bytes)})
    return sdk_pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=7, data=[datum], loss_fn="cross_entropy"
    ).SerializeToString()


@pytest.mark.parametrize("encoding", [None, "identity", "zstd", " ZSTD "], ids=["none", "identity", "zstd", "zstd-spaced"])
def test_the_model_id_is_read_from_a_plain_or_zstd_body(encoding):
    body = sdk_body()
    if encoding is not None and encoding.strip().lower() == "zstd":
        body = zstandard.ZstdCompressor().compress(body)
    assert forward_backward_model_id(body, encoding, max_body_bytes=LIMIT) == MODEL_ID


def test_fields_before_the_model_id_are_skipped_by_their_length():
    # seq_id (varint), loss_fn and a datum (length-delimited) come first here; the SDK writes model_id first.
    head = sdk_pb.ForwardBackwardRequest(seq_id=7, loss_fn="cross_entropy", data=[sdk_pb.Datum()]).SerializeToString()
    tail = sdk_pb.ForwardBackwardRequest(model_id=MODEL_ID).SerializeToString()
    assert forward_backward_model_id(head + tail, None, max_body_bytes=LIMIT) == MODEL_ID


def test_a_large_zstd_body_is_decompressed_only_as_far_as_its_model_id():
    # 64 MB of datum once decompressed, under a 1 MB limit: a full decompression would be refused.
    body = zstandard.ZstdCompressor().compress(sdk_body(datum_bytes=64 << 20))
    assert len(body) < LIMIT
    assert forward_backward_model_id(body, "zstd", max_body_bytes=LIMIT) == MODEL_ID


@pytest.mark.parametrize(
    ("body", "encoding"),
    [
        (b"\xff\xff\xff", None),  # a key varint that never ends
        (sdk_pb.ForwardBackwardRequest(seq_id=7, loss_fn="x").SerializeToString(), None),  # no model_id
        (sdk_body(model_id=""), None),  # proto3 writes no empty string: no model_id either
        (sdk_body()[:5], None),  # cut inside the model_id
        (b"not zstd", "zstd"),
        (sdk_body(), "gzip"),
        (b"\x0b", None),  # field 1 as a group: not a ForwardBackwardRequest
    ],
    ids=["endless-varint", "no-model-id", "empty-model-id", "truncated", "bad-zstd", "gzip", "group"],
)
def test_a_body_without_a_readable_model_id_is_none(body, encoding):
    assert forward_backward_model_id(body, encoding, max_body_bytes=LIMIT) is None


def test_a_skipped_field_past_the_limit_is_none_before_it_is_read():
    assert forward_backward_model_id(sdk_body(), None, max_body_bytes=50) is None  # the body itself is over the limit
    # A 5,000-byte loss_fn before the model_id: it compresses under the 1,000-byte limit, and is not skipped past it.
    head = sdk_pb.ForwardBackwardRequest(loss_fn="x" * 5000).SerializeToString()
    tail = sdk_pb.ForwardBackwardRequest(model_id=MODEL_ID).SerializeToString()
    big = zstandard.ZstdCompressor().compress(head + tail)
    assert len(big) < 1000
    assert forward_backward_model_id(big, "zstd", max_body_bytes=1000) is None
    assert forward_backward_model_id(big, "zstd", max_body_bytes=6000) == MODEL_ID


def test_the_seq_id_is_read_as_far_as_it_and_zero_when_the_sdk_writes_none():
    assert forward_backward_seq_id(sdk_body(), None, max_body_bytes=LIMIT) == 7
    large = zstandard.ZstdCompressor().compress(sdk_body(datum_bytes=64 << 20))
    assert forward_backward_seq_id(large, "zstd", max_body_bytes=LIMIT) == 7
    no_seq = sdk_pb.ForwardBackwardRequest(model_id=MODEL_ID, loss_fn="x").SerializeToString()
    assert forward_backward_seq_id(no_seq, None, max_body_bytes=LIMIT) == 0
    assert forward_backward_seq_id(b"\xff\xff\xff", None, max_body_bytes=LIMIT) is None
