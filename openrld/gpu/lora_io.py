"""LoRA adapter files: the on-disk form of one adapter's weights.

A directory holds `adapter_model.safetensors` (the tensors, keyed as
`peft.get_peft_model_state_dict(model, adapter_name=..., save_embedding_layers=False)`
keys them: no adapter name in the key) and `adapter.json` (the `LoraSpec`). Sampler
weight versions ("sampler_weights") are exactly this; trainer state checkpoints add their
optimizer files beside it (`checkpoint.write_beside`), so a sampler can load either.

Guarantees: every file is written and fsynced before the call returns, and the directory
entry is fsynced after (`checkpoint`'s writes). Reading never unpickles anything
(safetensors and JSON only). Writing to a temporary directory and renaming it into place is
the caller's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec
import torch

from openrld.batches import LoraSpec
from openrld.gpu import checkpoint

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
    return checkpoint.save_weights(directory, ADAPTER_WEIGHTS, tensors, ADAPTER_META, adapter_meta(spec))


def adapter_meta(spec: LoraSpec) -> AdapterMeta:
    """adapter.json's content for an adapter of `spec`."""
    return AdapterMeta(format_version=FORMAT_VERSION, lora=spec)


def load_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """Read an adapter written by `save_adapter` (or by a trainer's `save_state`).

    Returns:
        (tensors on the CPU, the LoraSpec they were trained with).
    Raises:
        BadRequest: a file is missing or malformed.
    """
    spec = read_spec(directory)
    return checkpoint.read_tensors(directory / ADAPTER_WEIGHTS), spec


def read_spec(directory: Path) -> LoraSpec:
    """The LoraSpec of the adapter in `directory`, without its tensors. Raises BadRequest."""
    return checkpoint.read_meta(
        directory, ADAPTER_META, AdapterMeta, FORMAT_VERSION, kind="adapter", is_not="a LoRA adapter"
    ).lora
