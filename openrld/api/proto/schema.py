"""The `tinker_public` protobuf schema, built in code, and its message classes.

Owns: the proto3 file descriptor `tinker_public.proto` (package `tinker_public`)
that the tinker SDK 0.38.0 speaks on the forward_backward and retrieve_future
paths (the SDK's `tinker/proto/` messages), registered in a
private `DescriptorPool`, and one message class per message type.

Guarantees: field numbers, scalar types, labels, real oneofs, proto3 `optional`
fields (each with its synthetic `_name` oneof, placed after the real oneofs as
protoc does) and map entry types are exactly those of the SDK's descriptor, so
bytes written by either side parse on the other. The pool is private, so the
SDK's own registration of the same file name (in tests) never clashes.

Never: imports the tinker SDK or a generated `_pb2` module, converts payloads
(that is `codec.py`), or does I/O. The pool and classes are built once at import
and never mutated afterwards; they are a schema, like a generated module.
"""

from __future__ import annotations

import enum
from typing import Any, TypeAlias

import msgspec
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

FILE_NAME = "tinker_public.proto"
PACKAGE = "tinker_public"


class StopReason(enum.IntEnum):
    """Wire enum `StopReason`; the SDK maps 0/1 to "stop"/"length" and rejects others."""

    STOP = 0
    LENGTH = 1


class DType(enum.IntEnum):
    """Wire enum `DType`: element type of Tensor and BatchedTensor bytes (little-endian)."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    INT64 = 2
    INT32 = 3
    BFLOAT16 = 4


# Each wire enum with the prefix its value names carry (`STOP_REASON_STOP`, `DTYPE_INT64`).
_ENUMS: dict[str, tuple[type[enum.IntEnum], str]] = {
    "StopReason": (StopReason, "STOP_REASON_"),
    "DType": (DType, "DTYPE_"),
}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS: dict[str, int] = {
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "int64": _F.TYPE_INT64,
    "uint64": _F.TYPE_UINT64,
    "int32": _F.TYPE_INT32,
    "uint32": _F.TYPE_UINT32,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}


class Field(msgspec.Struct, frozen=True):
    """One field as the .proto text writes it.

    `kind` is a scalar name, an enum name or a message name of this package.
    `optional` is proto3 `optional` (presence tracked); `oneof` names a real oneof;
    `map_key` makes this `map<map_key, kind>`.
    """

    number: int
    name: str
    kind: str
    repeated: bool = False
    optional: bool = False
    oneof: str | None = None
    map_key: str | None = None


class Message(msgspec.Struct, frozen=True):
    name: str
    fields: tuple[Field, ...]


# The schema, in the order of tinker_public.proto.txt (which is the SDK descriptor's order).
MESSAGES: tuple[Message, ...] = (
    Message("SampleResponse", (
        Field(1, "sequences", "SampledSequence", repeated=True),
        Field(2, "prompt_logprobs", "bytes", optional=True),
        Field(3, "topk_prompt_logprobs", "TopkLogprobs", optional=True),
        Field(4, "prompt_cache_hit_tokens", "int32"),
        Field(5, "target_prompt_logprobs", "Tensor", optional=True),
        Field(6, "prompt_alt_tokens", "PromptAltTokens", optional=True),
    )),
    Message("PromptAltTokens", (
        Field(1, "tokens", "Tensor"),
        Field(2, "logprobs", "Tensor"),
    )),
    Message("SampledSequence", (
        Field(1, "stop_reason", "StopReason"),
        Field(2, "tokens", "bytes"),
        Field(3, "logprobs", "bytes", optional=True),
        Field(4, "topk_sampled_logprobs", "TopkLogprobs", optional=True),
    )),
    Message("TopkLogprobs", (
        Field(1, "token_ids", "bytes"),
        Field(2, "logprobs", "bytes"),
        Field(3, "k", "uint32"),
        Field(4, "length", "uint32"),
    )),
    Message("SparseCsr", (
        Field(1, "values", "bytes"),
        Field(2, "crow_indices", "bytes"),
        Field(3, "col_indices", "bytes"),
    )),
    Message("Tensor", (
        Field(1, "dense", "bytes", oneof="encoding"),
        Field(2, "sparse_csr", "SparseCsr", oneof="encoding"),
        Field(3, "dtype", "DType"),
        Field(4, "shape", "int64", repeated=True),
    )),
    Message("BatchedTensor", (
        Field(1, "data", "bytes"),
        Field(2, "offsets", "bytes"),
        Field(3, "dtype", "DType"),
        Field(4, "trailing_shape", "int64", repeated=True),
    )),
    Message("ArrayRecord", (
        Field(1, "type_tag", "string"),
        Field(2, "fields", "BatchedTensor", map_key="string"),
        Field(3, "num_datums", "int64"),
    )),
    Message("ForwardBackwardOutput", (
        Field(1, "loss_fn_output_type", "string"),
        Field(2, "loss_fn_outputs", "ArrayRecord", repeated=True),
        Field(3, "metrics", "double", map_key="string"),
    )),
    Message("ForwardBackwardRequest", (
        Field(1, "model_id", "string"),
        Field(2, "seq_id", "int32"),
        Field(3, "data", "Datum", repeated=True),
        Field(4, "loss_fn", "string"),
        Field(5, "loss_fn_config", "double", map_key="string"),
        Field(6, "forward_only", "bool"),
        Field(7, "loss_fn_config_v2", "LossConfigValue", map_key="string"),
    )),
    Message("LossConfigValue", (
        Field(1, "number", "double", oneof="value"),
        Field(2, "text", "string", oneof="value"),
    )),
    Message("Datum", (
        Field(1, "model_input", "Chunk", repeated=True),
        Field(2, "loss_fn_inputs", "Tensor", map_key="string"),
        Field(3, "model_input_spans", "ProvenanceSpan", repeated=True),
        Field(4, "loss_fn_input_spans", "ProvenanceSpan", repeated=True),
    )),
    Message("ProvenanceSpan", (
        Field(1, "prompt_tokens", "PromptProvenanceSpan", oneof="span"),
        Field(2, "sampled_tokens", "SampledProvenanceSpan", oneof="span"),
    )),
    Message("PromptProvenanceSpan", (
        Field(1, "sequence_id", "string"),
        Field(2, "offset", "int64"),
        Field(3, "length", "int64"),
    )),
    Message("SampledProvenanceSpan", (
        Field(1, "sequence_id", "string"),
        Field(2, "offset", "int64"),
        Field(3, "length", "int64"),
    )),
    Message("Chunk", (
        Field(1, "encoded_text", "EncodedTextChunk", oneof="chunk"),
        Field(2, "image", "ImageChunk", oneof="chunk"),
        Field(3, "dmel", "DmelChunk", oneof="chunk"),
    )),
    Message("EncodedTextChunk", (
        Field(1, "tokens", "bytes"),
    )),
    Message("ImageChunk", (
        Field(1, "data", "bytes"),
        Field(2, "format", "string"),
        Field(3, "expected_tokens", "int32", optional=True),
        Field(4, "override_dimensions", "ImageDimensions", optional=True),
    )),
    Message("ImageDimensions", (
        Field(1, "width", "uint32"),
        Field(2, "height", "uint32"),
    )),
    Message("DmelChunk", (
        Field(1, "dmel", "bytes"),
    )),
    Message("SamplingParams", (
        Field(1, "max_tokens", "int32", optional=True),
        Field(2, "seed", "uint64", optional=True),
        Field(3, "temperature", "float", optional=True),
        Field(4, "top_k", "int32", optional=True),
        Field(5, "top_p", "float", optional=True),
        Field(6, "stop_strs", "StopStrings", oneof="stop"),
        Field(7, "stop_tokens", "StopTokens", oneof="stop"),
    )),
    Message("StopStrings", (
        Field(1, "values", "string", repeated=True),
    )),
    Message("StopTokens", (
        Field(1, "values", "int32", repeated=True),
    )),
)


def _map_entry_name(field_name: str) -> str:
    """protoc's name for a map field's entry type: `loss_fn_config_v2` -> `LossFnConfigV2Entry`."""
    return "".join(part[:1].upper() + part[1:] for part in field_name.split("_")) + "Entry"


def _set_kind(proto: descriptor_pb2.FieldDescriptorProto, kind: str) -> None:
    if kind in _SCALARS:
        proto.type = _SCALARS[kind]
    elif kind in _ENUMS:
        proto.type = _F.TYPE_ENUM
        proto.type_name = f".{PACKAGE}.{kind}"
    else:
        proto.type = _F.TYPE_MESSAGE
        proto.type_name = f".{PACKAGE}.{kind}"


def _build_message(spec: Message) -> descriptor_pb2.DescriptorProto:
    out = descriptor_pb2.DescriptorProto(name=spec.name)
    # protoc numbers real oneofs first (in order of first use), then one synthetic
    # oneof per proto3 `optional` field; the descriptor checker requires that order.
    real_oneofs = list(dict.fromkeys(f.oneof for f in spec.fields if f.oneof is not None))
    synthetic = [f.name for f in spec.fields if f.optional]
    for name in real_oneofs:
        out.oneof_decl.add(name=name)
    for name in synthetic:
        out.oneof_decl.add(name=f"_{name}")

    for f in spec.fields:
        proto = out.field.add(name=f.name, number=f.number)
        proto.label = _F.LABEL_REPEATED if (f.repeated or f.map_key) else _F.LABEL_OPTIONAL
        if f.map_key is not None:
            entry = out.nested_type.add(name=_map_entry_name(f.name))
            entry.options.map_entry = True
            key = entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL)
            _set_kind(key, f.map_key)
            value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
            _set_kind(value, f.kind)
            proto.type = _F.TYPE_MESSAGE
            proto.type_name = f".{PACKAGE}.{spec.name}.{entry.name}"
        else:
            _set_kind(proto, f.kind)
        if f.oneof is not None:
            proto.oneof_index = real_oneofs.index(f.oneof)
        if f.optional:
            proto.oneof_index = len(real_oneofs) + synthetic.index(f.name)
            proto.proto3_optional = True
    return out


def build_file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """The `tinker_public.proto` FileDescriptorProto, equal to the one inside the SDK."""
    fd = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for spec in MESSAGES:
        fd.message_type.append(_build_message(spec))
    for enum_name, (enum_type, prefix) in _ENUMS.items():
        enum_proto = fd.enum_type.add(name=enum_name)
        for member in enum_type:
            enum_proto.value.add(name=prefix + member.name, number=int(member))
    return fd


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(build_file_descriptor_proto())
    return pool


POOL = _build_pool()


# An instance of one of the classes below. protobuf makes them at import, from the schema above,
# so their fields exist only at run time: to mypy a message is Any (an annotation's parameter
# and function names say which message it is).
ProtoMessage: TypeAlias = Any


def message_class(name: str) -> type[message.Message]:
    """The generated class for message `name` of this file, from the private pool."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


SampleResponse = message_class("SampleResponse")
PromptAltTokens = message_class("PromptAltTokens")
SampledSequence = message_class("SampledSequence")
TopkLogprobs = message_class("TopkLogprobs")
SparseCsr = message_class("SparseCsr")
Tensor = message_class("Tensor")
BatchedTensor = message_class("BatchedTensor")
ArrayRecord = message_class("ArrayRecord")
ForwardBackwardOutput = message_class("ForwardBackwardOutput")
ForwardBackwardRequest = message_class("ForwardBackwardRequest")
LossConfigValue = message_class("LossConfigValue")
Datum = message_class("Datum")
ProvenanceSpan = message_class("ProvenanceSpan")
PromptProvenanceSpan = message_class("PromptProvenanceSpan")
SampledProvenanceSpan = message_class("SampledProvenanceSpan")
Chunk = message_class("Chunk")
EncodedTextChunk = message_class("EncodedTextChunk")
ImageChunk = message_class("ImageChunk")
ImageDimensions = message_class("ImageDimensions")
DmelChunk = message_class("DmelChunk")
SamplingParams = message_class("SamplingParams")
StopStrings = message_class("StopStrings")
StopTokens = message_class("StopTokens")
