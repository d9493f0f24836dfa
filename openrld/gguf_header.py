"""The few facts openrld needs from a GGUF file's header, read without loading the file.

The catalog must name a GGUF model's architecture and context length before
the model is converted (`get_server_capabilities` lists it while it converts),
and it runs on the event loop, so this reads only the key/value section at the
start of the file and stops as soon as it has what it needs. For the models
seen here the two keys come within the first few hundred bytes, before the
tokenizer's arrays; the `gguf` package's reader parses every array element
and took ~5 s on SmolLM2 here, which is why this exists.

Format (GGUF v2/v3, little-endian): magic "GGUF", uint32 version, uint64
tensor count, uint64 key/value count, then per key: a string (uint64 length,
UTF-8 bytes), a uint32 value type, the value. An array value is a uint32
element type, a uint64 count, the elements. This module never imports torch
and never reads tensor data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import msgspec

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# value type -> struct format of one scalar; 8 (string) and 9 (array) are read by hand
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING = 8
_ARRAY = 9
_MAX_KEY_BYTES = 1 << 16  # a longer key means a corrupt file, not a model

# GGUF architecture name -> the transformers class a converted model gets
# (what config.json's "architectures" will say); the ones transformers can load from GGUF.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


class GgufFormatError(ValueError):
    """The file is not a GGUF file openrld can read; the message says what was found."""


class GgufHeader(msgspec.Struct, frozen=True):
    architecture: str  # GGUF's name: "llama", "qwen3"
    transformers_arch: str  # "LlamaForCausalLM"
    context_length: int


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufFormatError(f"truncated: wanted {n} bytes at offset {f.tell() - len(data)}, got {len(data)}")
    return data


def _scalar(f: BinaryIO, value_type: int) -> object:
    fmt = _SCALAR_FORMATS.get(value_type)
    if fmt is None:
        raise GgufFormatError(f"unknown value type {value_type} at offset {f.tell()}")
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO, limit: int | None = None) -> str:
    (length,) = struct.unpack("<Q", _read(f, 8))
    if limit is not None and length > limit:
        raise GgufFormatError(f"a key of {length} bytes at offset {f.tell() - 8}; the file is corrupt")
    return _read(f, length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, value_type: int) -> object:
    if value_type == _STRING:
        return _string(f)
    if value_type == _ARRAY:
        element_type, count = struct.unpack("<IQ", _read(f, 12))
        if element_type in _SCALAR_FORMATS:
            # Skipped, not decoded: no key this module wants is an array.
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[element_type]), 1)
            return None
        for _ in range(count):
            _value(f, element_type)
        return None
    return _scalar(f, value_type)


def read_gguf_header(path: Path) -> GgufHeader:
    """The architecture and context length of the GGUF file at `path`.

    Raises:
        GgufFormatError: not a GGUF file, an unsupported version, a truncated
            or corrupt header, or an architecture transformers cannot load.
        OSError: the file cannot be read.
    """
    with path.open("rb") as f:
        magic = _read(f, 4)
        if magic != GGUF_MAGIC:
            raise GgufFormatError(f"not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
        version, _tensor_count, kv_count = struct.unpack("<IQQ", _read(f, 20))
        if version not in SUPPORTED_VERSIONS:
            raise GgufFormatError(f"GGUF version {version}; openrld reads versions {SUPPORTED_VERSIONS}")
        architecture: str | None = None
        context_length: int | None = None
        for _ in range(kv_count):
            key = _string(f, limit=_MAX_KEY_BYTES)
            (value_type,) = struct.unpack("<I", _read(f, 4))
            value = _value(f, value_type)
            if key == "general.architecture":
                architecture = str(value)
            elif key.endswith(".context_length") and isinstance(value, int):
                context_length = value
            if architecture is not None and context_length is not None:
                break
    if architecture is None:
        raise GgufFormatError("no general.architecture key in the header")
    if architecture not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise GgufFormatError(f"architecture {architecture!r} is not one openrld converts (it converts {known})")
    if context_length is None:
        raise GgufFormatError(f"no {architecture}.context_length key in the header")
    return GgufHeader(
        architecture=architecture, transformers_arch=ARCHITECTURES[architecture], context_length=context_length
    )
