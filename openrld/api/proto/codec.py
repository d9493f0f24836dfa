"""Protobuf bodies of the Tinker API to and from the engine's batch types.

Owns: decoding a `POST /api/v1/forward_backward` body (protobuf
`ForwardBackwardRequest`, possibly `Content-Encoding: zstd`) into a
`ForwardBackwardBatch`, and encoding a `ForwardBackwardResult` or a
`SampleResult` as the protobuf payload that `retrieve_future` serves
(dtypes, CSR, a missing shape).

Guarantees: every array handed on is a fresh, owned, native-endian numpy array
of the dtype `batches.py` promises (tokens and `target_tokens` int64, every
other loss input float32); every defect of a body is a `BadRequest` (or a
`NotSupportedYet` for chunk kinds we have not built) whose detail says where it
is (`data[2].loss_fn_inputs['weights']`) and what was received; decompression
and CSR expansion are bounded by `max_body_bytes`, so a small body cannot
demand a large allocation. A malformed *result* (a bad stop reason, a metric key
the SDK would crash on) is our bug and raises `ServerError`.

Never: imports torch or the tinker SDK, knows which inputs a loss needs or what
shapes it wants (the loss layer checks that, naming the loss), or does I/O.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import zstandard
from google.protobuf import message as pb_message

from openrld.api import media
from openrld.api.proto import schema
from openrld.api.proto.schema import DType, StopReason
from openrld.batches import (
    ForwardBackwardBatch,
    ForwardBackwardResult,
    ProvenanceSpan,
    SampleResult,
    TopK,
    TrainDatum,
)
from openrld.errors import BadRequest, NotSupportedYet, ServerError

T = TypeVar("T")

# Wire element types. The SDK writes raw `numpy.tobytes()` on little-endian hosts,
# so every dtype is spelled little-endian explicitly.
_WIRE_DTYPES: dict[int, np.dtype] = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.INT64: np.dtype("<i8"),
    DType.INT32: np.dtype("<i4"),
    DType.BFLOAT16: np.dtype("<u2"),  # the upper 16 bits of a float32
}
_TOKEN_DTYPE = np.dtype("<i4")  # EncodedTextChunk.tokens and SampledSequence.tokens
_INDEX_DTYPE = np.dtype("<i8")  # CSR crow/col indices and BatchedTensor byte offsets
_FLOAT_DTYPE = np.dtype("<f4")

PROTOBUF_MEDIA_TYPE = media.PROTOBUF
TARGET_TOKENS = "target_tokens"
# The SDK keeps the part after the last ":" and expects "ArrayRecord".
OUTPUT_TYPE = "ArrayRecord"
LOGPROBS_FIELD = "logprobs"
_STOP_REASONS: dict[str, StopReason] = {"stop": StopReason.STOP, "length": StopReason.LENGTH}


# ---------------------------------------------------------------- request side


def decode_forward_backward(
    body: bytes, content_encoding: str | None, *, max_body_bytes: int
) -> tuple[str, int, ForwardBackwardBatch]:
    """Decode a forward_backward request body into (model_id, seq_id, batch).

    Args:
        body: the HTTP body as received.
        content_encoding: the `Content-Encoding` header, or None; "zstd" and
            "identity" are understood.
        max_body_bytes: the most bytes the body may hold before and after
            decompression; it also caps how many cells CSR tensors may expand to.

    Returns:
        The model id, the client's seq_id and the batch for the engine.

    Raises:
        BadRequest: an oversize body, an unknown encoding, bad zstd, malformed
            protobuf, or any datum whose bytes do not match its dtype and shape.
        NotSupportedYet: a datum holds an image or dmel chunk.
    """
    raw = _decompress(body, content_encoding, max_body_bytes=max_body_bytes)
    request = schema.ForwardBackwardRequest()
    try:
        request.ParseFromString(raw)
    except pb_message.DecodeError as exc:
        raise BadRequest(
            f"forward_backward: body is not a ForwardBackwardRequest protobuf ({PROTOBUF_MEDIA_TYPE}): {exc}"
        ) from exc
    return forward_backward_from_message(request, max_body_bytes=max_body_bytes)


def forward_backward_from_message(
    request: schema.ProtoMessage, *, max_body_bytes: int
) -> tuple[str, int, ForwardBackwardBatch]:
    """(model_id, seq_id, batch) of a parsed ForwardBackwardRequest, whichever form it came in.

    Raises:
        BadRequest, NotSupportedYet: as `decode_forward_backward`, for the message's contents.
    """
    if not request.model_id:
        raise BadRequest("forward_backward: model_id is required")
    if request.seq_id < 0:
        raise BadRequest(f"forward_backward: seq_id must be >= 0, got {request.seq_id}")
    if not request.loss_fn:
        raise BadRequest("forward_backward: loss_fn is required")
    if not request.data:
        raise BadRequest("forward_backward: data must hold at least one datum, got 0")

    csr_budget = _CellBudget(max_body_bytes)
    data = [_decode_datum(f"data[{i}]", datum, csr_budget) for i, datum in enumerate(request.data)]
    batch = ForwardBackwardBatch(
        data=data,
        loss_fn=request.loss_fn,
        loss_config=_decode_loss_config(request),
        forward_only=request.forward_only,
    )
    return request.model_id, request.seq_id, batch


def forward_backward_ids(
    body: bytes, content_encoding: str | None, *, max_body_bytes: int
) -> tuple[str, int] | None:
    """(model_id, seq_id) of a forward_backward body whose datums may be bad, or None.

    For the route's failure path: when `decode_forward_backward` refuses a body,
    the seq_id it carried must still count as done, or every later request of
    that training client waits behind the gap. Returns None when
    the envelope itself is unreadable.
    """
    try:
        raw = _decompress(body, content_encoding, max_body_bytes=max_body_bytes)
        request = schema.ForwardBackwardRequest.FromString(raw)
    except (BadRequest, pb_message.DecodeError):
        return None
    if not request.model_id or request.seq_id < 0:
        return None
    return request.model_id, request.seq_id


def forward_backward_model_id(body: bytes, content_encoding: str | None, *, max_body_bytes: int) -> str | None:
    """The model_id of a forward_backward body, read without decoding the body, or None.

    For the relay, which only needs to know where to send the body: it walks the
    top-level protobuf fields and stops at model_id (field 1), skipping any other
    field by its length without parsing it. The SDK writes fields in number order,
    so model_id is the first field and a zstd body is decompressed only as far as
    its first few dozen bytes. If a body names model_id twice, the first is taken
    (a full parse takes the last); the home node then refuses the body, as it
    refuses any body naming a model its caller does not own. None: no model_id,
    or the body is not readable that far (the route that decodes it says why).
    """
    return _read_head(body, content_encoding, max_body_bytes, _first_string_field, _MODEL_ID_FIELD)


_MODEL_ID_FIELD = 1  # ForwardBackwardRequest.model_id
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_SKIP_CHUNK = 1 << 16


class _Truncated(Exception):
    """The body ended, or passed its limit, inside a field."""


def forward_backward_seq_id(body: bytes, content_encoding: str | None, *, max_body_bytes: int) -> int | None:
    """The seq_id of a forward_backward body, read as `forward_backward_model_id` reads its model_id (the SDK
    writes it second, right after model_id); 0 when the body has none (protobuf's default), None when
    the body is not readable that far. For the relay, which keeps a request in seq_id order for replay."""
    return _read_head(body, content_encoding, max_body_bytes, _first_varint_field, _SEQ_ID_FIELD)


def _read_head(
    body: bytes, content_encoding: str | None, max_body_bytes: int, read_field: Callable[[Any, int, int], T], number: int,
) -> T | None:
    """`read_field(reader, number, max_body_bytes)` over `body`, decompressed only as far as it reads;
    None when the body is over its limit, in an encoding other than identity or zstd, or not
    readable that far."""
    encoding = (content_encoding or "identity").strip().lower()
    if len(body) > max_body_bytes or encoding not in ("identity", "zstd"):
        return None
    try:
        if encoding == "identity":
            return read_field(io.BytesIO(body), number, max_body_bytes)
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            return read_field(reader, number, max_body_bytes)
    except (zstandard.ZstdError, UnicodeDecodeError, _Truncated):
        return None


_SEQ_ID_FIELD = 2  # ForwardBackwardRequest.seq_id


def _first_varint_field(reader: Any, number: int, limit: int) -> int:
    """The first top-level varint field `number` in the protobuf that `reader` yields; 0 if it has none."""
    found = _first_field(reader, number, limit, wire_type=_WIRE_VARINT)
    assert not isinstance(found, bytes)
    return found or 0


def _first_string_field(reader: Any, number: int, limit: int) -> str | None:
    """The first top-level string field `number` in the protobuf that `reader` yields; None if it has none."""
    found = _first_field(reader, number, limit, wire_type=_WIRE_LEN)
    assert not isinstance(found, int)
    return found.decode("utf-8") or None if found is not None else None


def _first_field(reader: Any, number: int, limit: int, *, wire_type: int) -> bytes | int | None:
    """The first top-level field `number` of `wire_type` (a string's bytes, or a varint) in the protobuf
    that `reader` yields, skipping every other field by its length; None if it has none."""
    budget = [limit]  # bytes that may still be read, decompressed

    def read(n: int) -> bytes:
        if n > budget[0]:
            raise _Truncated
        data = reader.read(n)
        if len(data) != n:
            raise _Truncated
        budget[0] -= n
        return data

    def varint(first: bytes = b"") -> int:
        value, shift = 0, 0
        while True:
            byte = (first or read(1))[0]
            first = b""
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise _Truncated

    while True:
        first = reader.read(1)
        if not first:
            return None  # the end of the body, between fields
        budget[0] -= 1
        key = varint(first)
        field, kind = key >> 3, key & 7
        if kind == _WIRE_LEN:
            length = varint()
            if field == number and kind == wire_type:
                return read(length)
            while length:  # skipped in chunks: a large datum is never held whole
                length -= len(read(min(length, _SKIP_CHUNK)))
        elif kind == _WIRE_VARINT:
            value = varint()
            if field == number and kind == wire_type:
                return value
        elif kind in (_WIRE_I64, _WIRE_I32):
            read(8 if kind == _WIRE_I64 else 4)
        else:
            raise _Truncated  # groups, or not protobuf at all


def _decompress(body: bytes, content_encoding: str | None, *, max_body_bytes: int) -> bytes:
    return media.decompress(body, content_encoding, max_body_bytes=max_body_bytes, where="forward_backward")


class _CellBudget:
    """How many more cells CSR tensors of one request may expand to."""

    def __init__(self, cells: int) -> None:
        self.cells = cells

    def take(self, where: str, cells: int) -> None:
        if cells > self.cells:
            raise BadRequest(
                f"{where}: sparse tensor expands to {cells} cells; only {self.cells} are left "
                "of this request's limit"
            )
        self.cells -= cells


def _decode_datum(where: str, datum: schema.ProtoMessage, csr_budget: _CellBudget) -> TrainDatum:
    # Provenance spans are decoded for every loss but only stable_reinforce reads them;
    # the other losses accept and ignore them.
    tokens = _decode_model_input(where, datum.model_input)
    inputs = {
        name: _decode_loss_input(f"{where}.loss_fn_inputs[{name!r}]", name, tensor, csr_budget)
        for name, tensor in sorted(datum.loss_fn_inputs.items())
    }
    return TrainDatum(
        tokens=tokens,
        inputs=inputs,
        model_input_spans=_decode_spans(f"{where}.model_input_spans", datum.model_input_spans),
        loss_fn_input_spans=_decode_spans(f"{where}.loss_fn_input_spans", datum.loss_fn_input_spans),
    )


def _decode_spans(where: str, spans: list[schema.ProtoMessage]) -> tuple[ProvenanceSpan, ...] | None:
    """A span list, or None when the datum carries none (proto3 cannot tell [] from absent)."""
    if not spans:
        return None
    decoded = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise BadRequest(f"{where}[{j}]: span is neither prompt_tokens nor sampled_tokens")
        run = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        if not run.sequence_id:
            raise BadRequest(f"{where}[{j}]: sequence_id must be non-empty")
        if run.offset < 0 or run.length < 0:
            raise BadRequest(f"{where}[{j}]: offset and length must be >= 0, got {run.offset} and {run.length}")
        decoded.append(
            ProvenanceSpan(
                sequence_id=run.sequence_id, offset=int(run.offset), length=int(run.length),
                is_sampled=kind == "sampled_tokens",
            )
        )
    return tuple(decoded)


def _decode_model_input(where: str, chunks: list[schema.ProtoMessage]) -> np.ndarray:
    parts: list[np.ndarray] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            parts.append(_from_buffer(f"{where}.model_input[{j}].encoded_text.tokens",
                                      chunk.encoded_text.tokens, _TOKEN_DTYPE))
        elif kind is None:
            raise BadRequest(f"{where}.model_input[{j}]: chunk has no content")
        else:
            raise NotSupportedYet(
                f"{where}.model_input[{j}]: {kind} chunks are not supported yet; "
                "only encoded_text chunks are"
            )
    tokens = np.concatenate(parts, dtype=np.int64) if parts else np.empty(0, dtype=np.int64)
    if tokens.size == 0:
        raise BadRequest(f"{where}.model_input: holds no tokens")
    if tokens.min() < 0:
        raise BadRequest(f"{where}.model_input: token ids must be >= 0, got {int(tokens.min())}")
    return tokens


def _decode_loss_input(
    where: str, name: str, tensor: schema.ProtoMessage, csr_budget: _CellBudget
) -> np.ndarray:
    values = _decode_tensor(where, tensor, csr_budget)
    if name != TARGET_TOKENS:
        # Every other input is a float; integer arrays are converted.
        return values.astype(np.float32)
    if values.dtype.kind == "f":
        whole = np.isfinite(values) & (values == np.trunc(values))
        if not whole.all():
            bad = values[~whole].flat[0]
            raise BadRequest(f"{where}: float target_tokens must hold whole numbers, got {bad!r}")
    tokens = values.astype(np.int64)
    if tokens.size and tokens.min() < 0:
        raise BadRequest(f"{where}: token ids must be >= 0, got {int(tokens.min())}")
    return tokens


def _decode_tensor(where: str, tensor: schema.ProtoMessage, csr_budget: _CellBudget) -> np.ndarray:
    """A wire Tensor as a numpy array, BF16 widened to float32 and INT32 to int64."""
    wire = _WIRE_DTYPES.get(tensor.dtype)
    if wire is None:
        raise BadRequest(
            f"{where}: dtype must be FLOAT32, INT64, INT32 or BFLOAT16, got {_dtype_name(tensor.dtype)}"
        )
    shape = [int(d) for d in tensor.shape]
    if any(d < 0 for d in shape):
        raise BadRequest(f"{where}: shape {shape} has a negative dimension")
    if len(shape) > 2:
        raise BadRequest(f"{where}: shape {shape} has rank {len(shape)}; expected rank 1 or 2")

    if tensor.WhichOneof("encoding") == "sparse_csr":
        values = _decode_csr(where, tensor.sparse_csr, wire, shape, csr_budget)
    else:
        # An unset encoding reads as empty dense bytes, which the shape check then judges.
        values = _from_buffer(f"{where}.dense", tensor.dense, wire)
        if not shape:
            shape = [values.size]  # no shape means 1-D
        if math.prod(shape) != values.size:
            raise BadRequest(
                f"{where}: dense data holds {values.size} elements but shape {shape} "
                f"needs {math.prod(shape)}"
            )
        values = values.reshape(shape)

    if tensor.dtype == DType.BFLOAT16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    if tensor.dtype == DType.INT32:
        return values.astype(np.int64)
    return values.astype(values.dtype.newbyteorder("="))


def _decode_csr(
    where: str, csr: schema.ProtoMessage, wire: np.dtype, shape: list[int], csr_budget: _CellBudget
) -> np.ndarray:
    """Expand CSR to dense; unlisted cells are 0 (the SDK's pad value)."""
    if len(shape) != 2:
        raise BadRequest(f"{where}: sparse_csr needs a rank-2 shape, got {shape}")
    rows, cols = shape
    values = _from_buffer(f"{where}.sparse_csr.values", csr.values, wire)
    crow = _from_buffer(f"{where}.sparse_csr.crow_indices", csr.crow_indices, _INDEX_DTYPE)
    col = _from_buffer(f"{where}.sparse_csr.col_indices", csr.col_indices, _INDEX_DTYPE)
    nnz = values.size
    if crow.size != rows + 1:
        raise BadRequest(
            f"{where}: sparse_csr.crow_indices has {crow.size} entries; shape {shape} needs {rows + 1}"
        )
    if col.size != nnz:
        raise BadRequest(
            f"{where}: sparse_csr.col_indices has {col.size} entries but values has {nnz}"
        )
    if crow[0] != 0 or crow[-1] != nnz or bool((np.diff(crow) < 0).any()):
        raise BadRequest(
            f"{where}: sparse_csr.crow_indices must start at 0, never decrease and end at "
            f"{nnz} (the number of values), got {crow.tolist()[:8]}"
        )
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise BadRequest(f"{where}: sparse_csr.col_indices must lie in [0, {cols})")
    csr_budget.take(where, rows * cols)
    dense = np.zeros((rows, cols), dtype=wire)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def _from_buffer(where: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise BadRequest(
            f"{where}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte elements"
        )
    return np.frombuffer(raw, dtype=dtype)


def _dtype_name(value: int) -> str:
    try:
        return DType(value).name
    except ValueError:
        return str(value)


def _decode_loss_config(request: schema.ProtoMessage) -> dict[str, float | str]:
    # The SDK writes numbers to both maps and strings only to v2, so v2 wins when present.
    if not request.loss_fn_config_v2:
        return {key: float(value) for key, value in sorted(request.loss_fn_config.items())}
    config: dict[str, float | str] = {}
    for key, value in sorted(request.loss_fn_config_v2.items()):
        kind = value.WhichOneof("value")
        if kind == "number":
            config[key] = float(value.number)
        elif kind == "text":
            config[key] = value.text
        else:
            raise BadRequest(f"loss_fn_config_v2[{key!r}]: value has neither number nor text")
    return config


# ---------------------------------------------------------------- result side


def encode_forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """The protobuf ForwardBackwardOutput for one forward_backward request.

    Per-datum `logprobs` go into one ArrayRecord as a float32 BatchedTensor
    (data concatenated, int64 byte offsets, trailing_shape [] or [K]). Datums
    whose trailing shapes differ start a new ArrayRecord, which the SDK
    concatenates in order, so ragged K still decodes.

    Raises:
        ServerError: a metric key is not `name:reduction` (the SDK would crash on
            it), or a logprobs array is 0-d.
    """
    out = schema.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE)
    arrays = [np.asarray(a, dtype=_FLOAT_DTYPE) for a in result.logprobs]
    for start, stop in _runs_of_equal_trailing_shape(arrays):
        record = out.loss_fn_outputs.add(type_tag=OUTPUT_TYPE, num_datums=stop - start)
        _fill_batched_tensor(record.fields[LOGPROBS_FIELD], arrays[start:stop])
    for key, value in result.metrics.items():
        if key.count(":") != 1:
            raise ServerError(f"metric key {key!r} must be 'name:reduction' with exactly one colon")
        out.metrics[key] = float(value)
    return out.SerializeToString()


def _runs_of_equal_trailing_shape(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, array in enumerate(arrays):
        if array.ndim == 0:
            raise ServerError(f"logprobs of datum {i} is 0-d; expected shape (N,) or (N, K)")
        if runs and arrays[runs[-1][0]].shape[1:] == array.shape[1:]:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _fill_batched_tensor(target: schema.ProtoMessage, arrays: list[np.ndarray]) -> None:
    sizes = [a.nbytes for a in arrays]
    target.data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    target.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(_INDEX_DTYPE).tobytes()
    target.dtype = DType.FLOAT32
    target.trailing_shape.extend(arrays[0].shape[1:])


def encode_sample_response(result: SampleResult) -> bytes:
    """The protobuf SampleResponse for one asample request.

    Raises:
        ServerError: a stop reason other than "stop"/"length", or tokens and
            logprobs of different lengths.
    """
    out = schema.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
    for i, sequence in enumerate(result.sequences):
        stop_reason = _STOP_REASONS.get(sequence.stop_reason)
        if stop_reason is None:
            raise ServerError(
                f"sequence {i}: stop_reason must be 'stop' or 'length', got {sequence.stop_reason!r}"
            )
        if len(sequence.tokens) != len(sequence.logprobs):
            raise ServerError(
                f"sequence {i}: {len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs"
            )
        message = out.sequences.add(stop_reason=stop_reason)
        message.tokens = _le_bytes(sequence.tokens, _TOKEN_DTYPE)
        message.logprobs = _le_bytes(sequence.logprobs, _FLOAT_DTYPE)
        if sequence.topk is not None:
            _fill_topk(message.topk_sampled_logprobs, sequence.topk)
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = _le_bytes(result.prompt_logprobs, _FLOAT_DTYPE)
    if result.topk_prompt is not None:
        _fill_topk(out.topk_prompt_logprobs, result.topk_prompt)
    return out.SerializeToString()


def _fill_topk(target: schema.ProtoMessage, topk: TopK) -> None:
    if topk.token_ids.shape != topk.logprobs.shape or topk.token_ids.ndim != 2:
        raise ServerError(
            f"top-k token_ids {topk.token_ids.shape} and logprobs {topk.logprobs.shape} "
            "must share one (L, K) shape"
        )
    length, k = topk.token_ids.shape
    target.SetInParent()  # present even when L or K is 0, which the SDK reads as absent
    target.token_ids = _le_bytes(topk.token_ids, _TOKEN_DTYPE)
    target.logprobs = _le_bytes(topk.logprobs, _FLOAT_DTYPE)
    target.k = k
    target.length = length


def _le_bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()
