"""LoRA adapter files: the on-disk form of one adapter's weights.

A directory holds `adapter_model.safetensors` (the tensors, keyed as
`peft.get_peft_model_state_dict(model, adapter_name=..., save_embedding_layers=False)`
keys them: no adapter name in the key) and `adapter.json` (the `LoraSpec`). Sampler
weight versions ("sampler_weights") are exactly this; trainer state checkpoints add their
optimizer files beside it, so a sampler can load either.

Guarantees: every file is written and fsynced before the call returns, and the directory
entry is fsynced after. Reading never unpickles anything (safetensors and JSON only).
Writing to a temporary directory and renaming it into place is the caller's job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec
import safetensors
import safetensors.torch
import torch

from openrld.batches import LoraSpec
from openrld.errors import BadRequest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_META = "adapter.json"
FORMAT_VERSION = 1


class _Versioned(Protocol):
    format_version: int


_Meta = TypeVar("_Meta", bound=_Versioned)


class AdapterMeta(msgspec.Struct, frozen=True):
    """adapter.json: what shape of adapter the tensors belong to."""

    format_version: int
    lora: LoraSpec


def save_adapter(directory: Path, tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> int:
    """Write `tensors` and `spec` into the existing, empty `directory`.

    Returns:
        The number of bytes written.
    Raises:
        FileExistsError: `directory` is not empty (a caller bug: saves go to fresh staging dirs).
    """
    require_empty(directory)
    size = write_synced(directory / ADAPTER_WEIGHTS, encode_tensors(tensors))
    meta = AdapterMeta(format_version=FORMAT_VERSION, lora=spec)
    size += write_synced(directory / ADAPTER_META, msgspec.json.encode(meta))
    fsync_directory(directory)
    return size


def load_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """Read an adapter written by `save_adapter` (or by a trainer's `save_state`).

    Returns:
        (tensors on the CPU, the LoraSpec they were trained with).
    Raises:
        BadRequest: a file is missing or malformed.
    """
    meta = read_meta(directory, ADAPTER_META, AdapterMeta, FORMAT_VERSION, kind="adapter", is_not="a LoRA adapter")
    return read_tensors(directory / ADAPTER_WEIGHTS), meta.lora


def read_meta(
    directory: Path, filename: str, meta_type: type[_Meta], format_version: int, *, kind: str, is_not: str
) -> _Meta:
    """A checkpoint's JSON metadata file, decoded and its format_version checked.

    Raises:
        BadRequest: the file is missing ("... it is not <is_not>"), malformed, or of
            another format version ("<kind> format_version ...").
    """
    meta_path = directory / filename
    if not meta_path.is_file():
        raise BadRequest(f"checkpoint {directory.name!r} has no {filename}; it is not {is_not}")
    try:
        meta = msgspec.json.decode(meta_path.read_bytes(), type=meta_type)
    except msgspec.ValidationError as error:
        raise BadRequest(f"checkpoint {directory.name!r}: {filename} is malformed: {error}") from error
    if meta.format_version != format_version:
        raise BadRequest(
            f"checkpoint {directory.name!r}: {kind} format_version {meta.format_version}; expected {format_version}"
        )
    return meta


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of CPU, contiguous copies (safetensors refuses views and devices)."""
    return safetensors.torch.save({key: t.detach().to("cpu").contiguous() for key, t in tensors.items()})


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Raises BadRequest when the file is missing or is not safetensors."""
    if not path.is_file():
        raise BadRequest(f"checkpoint {path.parent.name!r} has no {path.name}")
    try:
        return safetensors.torch.load(path.read_bytes())
    except safetensors.SafetensorError as error:
        raise BadRequest(f"checkpoint {path.parent.name!r}: {path.name} is not valid safetensors: {error}") from error


def write_synced(path: Path, data: bytes) -> int:
    """Write `data` to a new file at `path` and fsync it; return its size."""
    with open(path, "xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return len(data)


def fsync_directory(directory: Path) -> None:
    """Make the directory's new entries durable, not only the files' contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_empty(directory: Path) -> None:
    """Raise FileExistsError unless `directory` is empty (saves go to fresh staging dirs)."""
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; saves go into a fresh directory")
