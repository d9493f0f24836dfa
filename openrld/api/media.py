"""What a request body is, by its headers, and which form a reply takes, by `Accept`.

Owns the reading of `Content-Type`, `Content-Encoding` and `Accept` for every
route: a body is decompressed by what its `Content-Encoding` names (identity,
zstd, gzip, deflate) and decoded by what its `Content-Type` names, never by a
guess from the route. A body whose declared type does not parse is a 400 that
names the type; a type the route does not take is a 415 that names what it
takes. A reply that exists in two forms (a forward_backward or sample result:
protobuf since SDK 0.18, JSON before) is sent in the form `Accept` prefers.

Guarantees: decompression is bounded by `max_body_bytes` before any
allocation past it; a missing `Content-Type` is read as JSON, the form every
route but forward_backward has always taken and what a hand-written `curl -d`
means. Never does I/O, and knows no route's fields.
"""

from __future__ import annotations

import enum
import zlib
from typing import TypeVar

import msgspec
import zstandard
from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

from openrld.errors import BadRequest, UnsupportedMediaType

T = TypeVar("T")

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_GZIP_WINDOW = 16 + zlib.MAX_WBITS  # zlib's wbits for a gzip header and trailer
_DEFLATE_WINDOW = zlib.MAX_WBITS  # HTTP's "deflate" is the zlib format (RFC 9110 §8.4.1.2)


class Form(enum.Enum):
    """The two encodings the Tinker API has for one message."""

    JSON = JSON
    PROTOBUF = PROTOBUF


def form_of(content_type: str | None, *, where: str) -> Form:
    """The form a body declares in its `Content-Type` (parameters such as charset ignored).

    Raises:
        UnsupportedMediaType: a type other than JSON (or `+json`) and protobuf.
    """
    if content_type is None or not content_type.strip():
        return Form.JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media == JSON or media.endswith("+json"):
        return Form.JSON
    if media in (PROTOBUF, "application/protobuf"):
        return Form.PROTOBUF
    raise UnsupportedMediaType(f"{where}: Content-Type {content_type!r} is not application/json or {PROTOBUF}")


def form_of_or_none(content_type: str | None) -> Form | None:
    """As `form_of`, or None for a type that is neither (for a layer that only routes)."""
    try:
        return form_of(content_type, where="body")
    except UnsupportedMediaType:
        return None


def reply_form(accept: str | None) -> Form:
    """Which form of a two-form result `Accept` prefers; protobuf where it names neither.

    SDKs before 0.18 send `Accept: application/json` and read results as JSON;
    0.18 to 0.24 send `application/x-protobuf, application/json` for the results
    they read as protobuf (samples; forward_backward too from 0.21), 0.25 and later
    `application/x-protobuf` alone. q-values are honoured.
    """
    best = parse_accept_header(accept, MIMEAccept).best_match([PROTOBUF, JSON])
    return Form.JSON if best == JSON else Form.PROTOBUF


def decompress(body: bytes, content_encoding: str | None, *, max_body_bytes: int, where: str) -> bytes:
    """`body` as sent before its `Content-Encoding` was applied.

    Raises:
        BadRequest: the body or its decompressed form is over `max_body_bytes`, the
            encoding is unknown, or the bytes are not in the encoding named.
    """
    if len(body) > max_body_bytes:
        raise BadRequest(f"{where}: body is {len(body)} bytes; the limit is {max_body_bytes}")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding == "zstd":
        return _unzstd(body, max_body_bytes=max_body_bytes, where=where)
    if encoding in ("gzip", "x-gzip", "deflate"):
        return _unzlib(body, _DEFLATE_WINDOW if encoding == "deflate" else _GZIP_WINDOW, encoding,
                       max_body_bytes=max_body_bytes, where=where)
    raise BadRequest(f"Content-Encoding: expected zstd, gzip, deflate or none, got {content_encoding!r}")


def read_json(
    body: bytes, type_: type[T], *, content_type: str | None, content_encoding: str | None, max_body_bytes: int
) -> T:
    """A JSON route's body as `type_`, read by its headers.

    Raises:
        UnsupportedMediaType: the body declares a type other than JSON.
        BadRequest: bad compression, or JSON that does not fit `type_` (the
            detail names `type_` and the JSON path).
    """
    name = getattr(type_, "__name__", str(type_))
    if form_of(content_type, where=name) is not Form.JSON:
        raise UnsupportedMediaType(f"{name}: this route takes {JSON}, got Content-Type {content_type!r}")
    return decode_json(decompress(body, content_encoding, max_body_bytes=max_body_bytes, where=name), type_)


def decode_json(raw: bytes, type_: type[T]) -> T:
    """`raw` (already decompressed) as `type_`.

    Raises:
        BadRequest: the bytes are not JSON, or do not fit `type_`; the detail
            names the body type and carries msgspec's message, which names the
            JSON path (`... - at $.sampling_params.top_p`).
    """
    name = getattr(type_, "__name__", str(type_))
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {name} body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid {name} body: not {JSON}: {exc}") from exc


def _unzstd(body: bytes, *, max_body_bytes: int, where: str) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"{where}: body is not a zstd frame: {exc}") from exc
    # A frame that declares its size is decompressed into exactly that many bytes,
    # so refuse an oversize declaration before allocating; an undeclared size is
    # bounded by max_output_size instead.
    if declared > max_body_bytes:
        raise BadRequest(f"{where}: zstd body declares {declared} bytes; the limit is {max_body_bytes}")
    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=max_body_bytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise BadRequest(
            f"{where}: zstd body is truncated, corrupt or over {max_body_bytes} bytes once decompressed: {exc}"
        ) from exc


def _unzlib(body: bytes, wbits: int, encoding: str, *, max_body_bytes: int, where: str) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        # max_length stops a small bomb at the limit; one byte past it tells "over" from "exactly".
        raw = inflater.decompress(body, max_body_bytes + 1)
    except zlib.error as exc:
        raise BadRequest(f"{where}: body is not valid {encoding}: {exc}") from exc
    if len(raw) > max_body_bytes:
        raise BadRequest(f"{where}: {encoding} body is over {max_body_bytes} bytes once decompressed")
    if not inflater.eof or inflater.unused_data:
        raise BadRequest(f"{where}: {encoding} body is truncated or has bytes after its end")
    return raw
