"""The ids a request's body names, read only as far as the relay needs them to find the request's home.

A JSON body is decoded into `Ids` alone (msgspec skips every other field
without building it), and a forward_backward protobuf body is read only as far
as its model_id and seq_id (`proto.forward_backward_model_id`), so the body is decoded
whole once, by the route of the node that serves it. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from openrld.api import media
from openrld.api.proto import forward_backward_model_id, forward_backward_seq_id
from openrld.errors import BadRequest


class Ids(msgspec.Struct):
    """The ids a body may name; everything else in it is the home node's to decode."""

    model_id: str | None = None
    seq_id: int | None = None  # a training request's place in its job's order
    request_id: str | None = None
    session_id: str | None = None
    sampling_session_id: str | None = None
    sampling_session_seq_id: int | None = None
    model_seq_id: int | None = None
    model_path: str | None = None
    path: str | None = None
    tinker_path: str | None = None
    base_model: str | None = None


@dataclass(frozen=True)
class Call:
    """One request as the relay passes it on."""

    scope: dict  # the ASGI scope
    headers: dict[bytes, bytes]  # the request's headers, by lower-case name
    body: bytes
    params: dict[str, str]  # the route's path parameters (`<run_id>` and the like)
    session_id: str | None = None  # a creating request's session: sent along, signed, when it is relayed


def body_ids(call: Call, max_body_bytes: int) -> Ids | None:
    """The ids `call`'s body names; None if it does not decode (the home app explains why).

    A protobuf forward_backward body is read only as far as its model_id: the node that serves it decodes it
    whole. A JSON body is decompressed first if its Content-Encoding says so; a body in another type is left
    to the route that reads it.
    """
    form = media.form_of_or_none(header(call.headers, b"content-type"))
    encoding = header(call.headers, b"content-encoding")
    if call.scope["path"] == "/api/v1/forward_backward" and form is media.Form.PROTOBUF:
        model_id = forward_backward_model_id(call.body, encoding, max_body_bytes=max_body_bytes)
        seq_id = forward_backward_seq_id(call.body, encoding, max_body_bytes=max_body_bytes)
        return Ids(model_id=model_id, seq_id=seq_id) if model_id is not None else None
    if form is not media.Form.JSON:
        return None
    try:
        raw = media.decompress(call.body, encoding, max_body_bytes=max_body_bytes, where="body")
        return msgspec.json.decode(raw, type=Ids)
    except (BadRequest, msgspec.DecodeError, msgspec.ValidationError):
        return None


def header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")
