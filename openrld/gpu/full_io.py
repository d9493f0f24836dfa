"""Full-model weight files: the on-disk form of a full fine-tuning job's weights.

A directory holds `model.safetensors` (every trainable parameter, keyed by its
`named_parameters()` name: tied weights appear once, as transformers saves them)
and `full_model.json` (`FullMeta`). Sampler weight versions ("sampler_weights") are
exactly this; state checkpoints ("weights") add the trainer's optimizer files beside
it, so a sampler can load either. `load_sampler_weights` reads a sampler version of
either kind, LoRA adapter or full model, telling them apart by their meta file.

Guarantees: every file is written and fsynced before the call returns, and the
directory entry is fsynced after. Reading never unpickles anything (safetensors and
JSON only). Writing to a temporary directory and renaming it into place is the
caller's job (`actors/checkpoints.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
import torch

from openrld.batches import LoraSpec
from openrld.gpu import checkpoint, lora_io

FULL_WEIGHTS = "model.safetensors"
FULL_META = "full_model.json"
FORMAT_VERSION = 1


class FullMeta(msgspec.Struct, frozen=True):
    """full_model.json: marks a directory as full-model weights."""

    format_version: int
    fine_tuning_type: str = "full"
    dtype: str = ""  # the trainer's parameter dtype, e.g. "torch.float32"; informative


def is_full_checkpoint(directory: Path) -> bool:
    return (directory / FULL_META).is_file()


def save_full(directory: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write `tensors` (every parameter of the model) into the existing, empty `directory`.

    Returns:
        The number of bytes written.
    Raises:
        FileExistsError: `directory` is not empty (a caller bug: saves go to fresh staging dirs).
    """
    return checkpoint.save_weights(directory, FULL_WEIGHTS, tensors, FULL_META, _meta(t.dtype for t in tensors.values()))


def write_meta(directory: Path, dtypes: Iterable[torch.dtype]) -> int:
    """Write full_model.json for weights of `dtypes` (fsynced; the directory is the caller's); its size.

    The Automodel trainer streams its weights file (`safetensors_stream`) and writes this beside it.
    """
    return checkpoint.write_synced(directory / FULL_META, msgspec.json.encode(_meta(dtypes)))


def _meta(dtypes: Iterable[torch.dtype]) -> FullMeta:
    return FullMeta(format_version=FORMAT_VERSION, dtype=",".join(sorted({str(dtype) for dtype in dtypes})))


def check_meta(directory: Path) -> FullMeta:
    """full_model.json of `directory`, checked. Raises BadRequest: not full-model weights."""
    return checkpoint.read_meta(
        directory, FULL_META, FullMeta, FORMAT_VERSION, kind="full-model", is_not="full-model weights"
    )


def load_full(directory: Path) -> dict[str, torch.Tensor]:
    """Read the tensors written by `save_full` (or by a full trainer's `save_state`).

    Raises:
        BadRequest: the directory is not full-model weights, or a file is malformed.
    """
    check_meta(directory)
    return checkpoint.read_tensors(directory / FULL_WEIGHTS)


def load_sampler_weights(directory: Path) -> tuple[dict[str, torch.Tensor], LoraSpec | None]:
    """A sampler version from disk: (full-model tensors, None) or (adapter tensors, its LoraSpec).

    Raises:
        BadRequest: neither kind of weights, or malformed files.
    """
    if is_full_checkpoint(directory):
        return load_full(directory), None
    return lora_io.load_adapter(directory)
