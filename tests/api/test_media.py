"""Bodies read by their Content-Type and Content-Encoding; two-form results picked by Accept."""

from __future__ import annotations

import gzip
import zlib

import pytest
import zstandard

from openrld.api import media, wire
from openrld.errors import BadRequest, UnsupportedMediaType

LIMIT = 1 << 16
BODY = b'{"model_id": "m-1"}'


def read(body: bytes, content_type: str | None = media.JSON, content_encoding: str | None = None) -> wire.GetInfoRequest:
    return media.read_json(
        body, wire.GetInfoRequest, content_type=content_type, content_encoding=content_encoding, max_body_bytes=LIMIT
    )


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        (None, BODY),
        ("identity", BODY),
        ("gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("zstd", zstandard.ZstdCompressor().compress(BODY)),
    ],
    ids=["none", "identity", "gzip", "deflate", "zstd"],
)
def test_json_body_is_decompressed_by_its_content_encoding(encoding: str | None, body: bytes) -> None:
    assert read(body, content_encoding=encoding).model_id == "m-1"


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"],
    ids=["absent", "plain", "charset", "case", "suffix"],
)
def test_json_route_takes_any_json_content_type(content_type: str | None) -> None:
    assert read(BODY, content_type=content_type).model_id == "m-1"


def test_protobuf_body_on_a_json_route_is_415_naming_both_types() -> None:
    with pytest.raises(UnsupportedMediaType) as refused:
        read(b"\x0a\x03m-1", content_type="application/x-protobuf")
    assert (refused.value.status, refused.value.detail) == (
        415, "GetInfoRequest: this route takes application/json, got Content-Type 'application/x-protobuf'"
    )


def test_other_content_type_is_415_naming_it() -> None:
    with pytest.raises(UnsupportedMediaType, match=r"Content-Type 'text/plain' is not application/json or application/x-protobuf"):
        read(BODY, content_type="text/plain")


def test_declared_json_that_does_not_parse_is_400_naming_the_type() -> None:
    with pytest.raises(BadRequest, match=r"^invalid GetInfoRequest body: not application/json: "):
        read(b"\x0a\x03m-1")


def test_gzip_bomb_is_refused_at_the_limit() -> None:
    with pytest.raises(BadRequest, match=r"gzip body is over 65536 bytes once decompressed"):
        read(gzip.compress(b" " * (LIMIT + 1)), content_encoding="gzip")


def test_truncated_gzip_is_bad_request() -> None:
    with pytest.raises(BadRequest, match=r"gzip body is truncated or has bytes after its end"):
        read(gzip.compress(BODY)[:-4], content_encoding="gzip")


def test_unknown_content_encoding_is_bad_request_naming_it() -> None:
    with pytest.raises(BadRequest, match=r"Content-Encoding: expected zstd, gzip, deflate or none, got 'br'"):
        read(BODY, content_encoding="br")


@pytest.mark.parametrize(
    ("accept", "form"),
    [
        ("application/json", media.Form.JSON),  # SDK 0.16, and 0.18 to 0.20 for forward_backward results
        ("application/x-protobuf, application/json", media.Form.PROTOBUF),  # 0.18 to 0.24 for samples
        ("application/x-protobuf", media.Form.PROTOBUF),  # 0.25 and later
        ("application/json;q=0.9, application/x-protobuf;q=0.1", media.Form.JSON),
        ("*/*", media.Form.PROTOBUF),
        (None, media.Form.PROTOBUF),
    ],
    ids=["json", "both", "protobuf", "q-values", "any", "absent"],
)
def test_reply_form_is_what_accept_prefers(accept: str | None, form: media.Form) -> None:
    assert media.reply_form(accept) is form
