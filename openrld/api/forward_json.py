"""forward_backward and forward bodies in JSON, the form SDKs before 0.25 send.

SDK 0.16 to 0.20 know only JSON here, and 0.21 to 0.24 send JSON unless the
client config says `proto_write_fwdbwd`: `{"forward_backward_input": {"data":
[Datum], "loss_fn", "loss_fn_config"}, "model_id", "seq_id"}`, or
`"forward_input"` on `/api/v1/forward`, each Datum's tensors as TensorData
JSON (flat `data`, `dtype`, `shape`, optional CSR indices).

Owns: these Structs, and their translation into the protobuf
`ForwardBackwardRequest` that `proto.codec` checks and turns into a batch, so
both forms pass the very same checks (dtypes, shapes, CSR bounds, the cell
budget) and answer the same errors. Never does I/O or decides anything that
needs server state.
"""

from __future__ import annotations

import numpy as np

from openrld.api import media
from openrld.api.proto import schema
from openrld.api.proto.codec import forward_backward_from_message
from openrld.api.proto.schema import DType
from openrld.api.wire import ModelInput, RequestBody, TensorDataJson
from openrld.batches import ForwardBackwardBatch
from openrld.errors import BadRequest, NotSupportedYet

_DTYPES: dict[str, tuple[np.dtype, DType]] = {"int64": (np.dtype("<i8"), DType.INT64), "float32": (np.dtype("<f4"), DType.FLOAT32)}
_TOKEN_DTYPE = np.dtype("<i4")  # EncodedTextChunk.tokens on the protobuf side
_INDEX_DTYPE = np.dtype("<i8")  # CSR indices on the protobuf side


class DatumJson(RequestBody, frozen=True):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorDataJson] = {}  # noqa: RUF012  (msgspec copies a mutable default per instance)


class ForwardBackwardInputJson(RequestBody, frozen=True):
    data: list[DatumJson]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None  # numbers only before the protobuf form's v2 map


class ForwardBackwardJsonRequest(RequestBody, frozen=True):
    forward_backward_input: ForwardBackwardInputJson
    model_id: str
    seq_id: int | None = None


class ForwardJsonRequest(RequestBody, frozen=True):
    """`POST /api/v1/forward`: a forward_backward without the backward pass (SDKs before 0.25)."""

    forward_input: ForwardBackwardInputJson
    model_id: str
    seq_id: int | None = None


def decode(
    body: bytes, content_encoding: str | None, *, forward_only: bool, max_body_bytes: int
) -> tuple[str, int, ForwardBackwardBatch]:
    """(model_id, seq_id, batch) of a JSON forward_backward (or, `forward_only`, forward) body.

    Raises:
        BadRequest: bad compression, JSON that does not fit the request, or any
            defect `proto.codec` finds in the datums (named by their index).
        NotSupportedYet: a datum holds an image or dmel chunk.
    """
    request = _read(body, content_encoding, forward_only=forward_only, max_body_bytes=max_body_bytes)
    try:
        message = _message(request, forward_only)
    except ValueError as exc:  # protobuf's own range check: seq_id is int32, shapes int64
        raise BadRequest(f"{'forward' if forward_only else 'forward_backward'}: a value is out of range: {exc}") from exc
    return forward_backward_from_message(message, max_body_bytes=max_body_bytes)


def ids(body: bytes, content_encoding: str | None, *, forward_only: bool, max_body_bytes: int) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body whose datums may be bad, or None if its envelope is unreadable.

    As `proto.forward_backward_ids`: a refused request's seq_id must still count as done.
    """
    try:
        request = _read(body, content_encoding, forward_only=forward_only, max_body_bytes=max_body_bytes)
    except BadRequest:
        return None
    if not request.model_id or request.seq_id is None or request.seq_id < 0:
        return None
    return request.model_id, request.seq_id


def _read(
    body: bytes, content_encoding: str | None, *, forward_only: bool, max_body_bytes: int
) -> ForwardBackwardJsonRequest | ForwardJsonRequest:
    type_: type[ForwardBackwardJsonRequest | ForwardJsonRequest] = ForwardJsonRequest if forward_only else ForwardBackwardJsonRequest
    return media.read_json(
        body, type_, content_type=media.JSON, content_encoding=content_encoding, max_body_bytes=max_body_bytes
    )


def _message(request: ForwardBackwardJsonRequest | ForwardJsonRequest, forward_only: bool) -> schema.ProtoMessage:
    inputs = request.forward_input if isinstance(request, ForwardJsonRequest) else request.forward_backward_input
    if request.seq_id is None:
        # Every SDK sends one; without it the request could not take its turn among the model's.
        raise BadRequest(f"{'forward' if forward_only else 'forward_backward'}: seq_id is required")
    message = schema.ForwardBackwardRequest(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=inputs.loss_fn,
        forward_only=forward_only,
    )
    for key, value in (inputs.loss_fn_config or {}).items():
        message.loss_fn_config[key] = value
    for i, datum in enumerate(inputs.data):
        _fill_datum(f"data[{i}]", message.data.add(), datum)
    return message


def _fill_datum(where: str, target: schema.ProtoMessage, datum: DatumJson) -> None:
    for j, chunk in enumerate(datum.model_input.chunks):
        if chunk.type != "encoded_text":
            raise NotSupportedYet(
                f"{where}.model_input[{j}]: {chunk.type} chunks are not supported yet; only encoded_text chunks are"
            )
        tokens = _array(f"{where}.model_input[{j}].tokens", chunk.tokens, _TOKEN_DTYPE)
        target.model_input.add().encoded_text.tokens = tokens.tobytes()
    for name, tensor in datum.loss_fn_inputs.items():
        _fill_tensor(f"{where}.loss_fn_inputs[{name!r}]", target.loss_fn_inputs[name], tensor)


def _fill_tensor(where: str, target: schema.ProtoMessage, tensor: TensorDataJson) -> None:
    dtype, wire_dtype = _DTYPES[tensor.dtype]
    values = _array(f"{where}.data", tensor.data, dtype)
    target.dtype = wire_dtype
    # TensorData's shape is optional; without it the data is one flat vector.
    target.shape.extend(tensor.shape if tensor.shape is not None else [values.size])
    if tensor.sparse_crow_indices is None and tensor.sparse_col_indices is None:
        target.dense = values.tobytes()
        return
    if tensor.sparse_crow_indices is None or tensor.sparse_col_indices is None:
        raise BadRequest(f"{where}: sparse_crow_indices and sparse_col_indices come together, got one of them")
    target.sparse_csr.values = values.tobytes()
    target.sparse_csr.crow_indices = _array(f"{where}.sparse_crow_indices", tensor.sparse_crow_indices, _INDEX_DTYPE).tobytes()
    target.sparse_csr.col_indices = _array(f"{where}.sparse_col_indices", tensor.sparse_col_indices, _INDEX_DTYPE).tobytes()


def _array(where: str, values: list[int] | list[int | float], dtype: np.dtype) -> np.ndarray:
    raw = np.asarray(values)  # int64 or float64, as the JSON numbers came
    if raw.dtype.kind not in "iuf" or raw.ndim != 1:
        raise BadRequest(f"{where}: expected a flat list of numbers that fit int64 or float64")
    if dtype.kind == "i" and raw.dtype.kind == "f" and not (np.isfinite(raw) & (raw == np.trunc(raw))).all():
        raise BadRequest(f"{where}: {dtype.name} data must hold whole numbers")
    if dtype.kind == "i" and raw.size:
        bounds = np.iinfo(dtype)
        if raw.min() < bounds.min or raw.max() > bounds.max:
            raise BadRequest(f"{where}: values must lie in [{bounds.min}, {bounds.max}] for {dtype.name}")
    return raw.astype(dtype)
