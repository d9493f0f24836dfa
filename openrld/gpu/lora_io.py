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

import msgspec
import safetensors
import safetensors.torch
import torch

from openrld.batches import LoraSpec
from openrld.errors import BadRequest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_META = "adapter.json"
FORMAT_VERSION = 1


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
    _require_empty(directory)
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
    meta_path = directory / ADAPTER_META
    if not meta_path.is_file():
        raise BadRequest(f"checkpoint {directory.name!r} has no {ADAPTER_META}; it is not a LoRA adapter")
    try:
        meta = msgspec.json.decode(meta_path.read_bytes(), type=AdapterMeta)
    except msgspec.ValidationError as error:
        raise BadRequest(f"checkpoint {directory.name!r}: {ADAPTER_META} is malformed: {error}") from error
    if meta.format_version != FORMAT_VERSION:
        raise BadRequest(
            f"checkpoint {directory.name!r}: adapter format_version {meta.format_version}; expected {FORMAT_VERSION}"
        )
    return read_tensors(directory / ADAPTER_WEIGHTS), meta.lora


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


def _require_empty(directory: Path) -> None:
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; saves go into a fresh directory")
