"""A checkpoint's files, as every trainer writes and checks them, and every sampler reads them.

A sampler checkpoint is a directory of weights and a JSON file that says what they are: a
LoRA adapter (`lora_io`) or full-model weights (`full_io`), each written here (`save_weights`) and its
JSON file read and checked here (`read_meta`). A trainer's state checkpoint is one of those with two files
beside it: `optimizer.safetensors` (the optimizer's state tensors, when saved with them) and
`state.json` (`TrainerState` for an adapter, `FullTrainerState` for full fine-tuning: the
optimizer family and its steps). The LoRA trainer (`torch_trainer`), the full one
(`full_trainer`) and the Automodel trainer (`automodel_trainer`) write those and check a load
against them here alike, so each loads what the others save.

Guarantees: every file is written and fsynced before a call returns, and the directory entry
after it; reading never unpickles anything (safetensors and JSON only); every check raises
`BadRequest` naming the checkpoint (and the setting at fault), before a load changes anything.

What it does not do: stage a directory and rename it into place (`store/checkpoint_files.py`),
stream a large file a tensor at a time (`safetensors_stream`), or hold an optimizer's state
(`optim`, `automodel_optim`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import msgspec
import safetensors
import safetensors.torch
import torch

from openrld.batches import LoraSpec
from openrld.errors import BadRequest

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
STATE_FORMAT_VERSION = 1
# What a LoRA checkpoint's spec must match of the one that loads it (`check_lora_spec`).
LORA_FIELDS = ("rank", "train_attn", "train_mlp", "train_unembed")


class _Versioned(Protocol):
    @property
    def format_version(self) -> int: ...


_Meta = TypeVar("_Meta", bound=_Versioned)


# ---------------------------------------------------------------- a sampler checkpoint's weights


def save_weights(
    directory: Path, weights_file: str, tensors: Mapping[str, torch.Tensor], meta_file: str, meta: msgspec.Struct
) -> int:
    """Write `tensors` and their `meta` into the existing, empty `directory`; bytes written.

    Raises:
        FileExistsError: `directory` is not empty (a caller bug: saves go to fresh staging dirs).
    """
    require_empty(directory)
    size = write_synced(directory / weights_file, encode_tensors(tensors))
    size += write_synced(directory / meta_file, msgspec.json.encode(meta))
    fsync_directory(directory)
    return size


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


# ---------------------------------------------------------------- a trainer's state beside them


class TrainerState(msgspec.Struct, frozen=True):
    """state.json of a LoRA adapter's state checkpoint."""

    format_version: int
    lora: LoraSpec
    optimizer: str  # "adamw" or "dimuon"
    optimizer_steps: int
    has_optimizer_state: bool


class FullTrainerState(msgspec.Struct, frozen=True):
    """state.json of a full fine-tuning state checkpoint."""

    format_version: int
    optimizer: str  # "adamw"
    optimizer_steps: int
    has_optimizer_state: bool
    fine_tuning_type: str = "full"


class _StoredOptimizer(msgspec.Struct, frozen=True):
    optimizer: str = "adamw"  # a checkpoint older than Dimuon names none


def lora_state(spec: LoraSpec, optimizer: str, steps: int, with_optimizer: bool) -> TrainerState:
    return TrainerState(STATE_FORMAT_VERSION, spec, optimizer, steps, with_optimizer)


def full_state(steps: int, with_optimizer: bool) -> FullTrainerState:
    return FullTrainerState(STATE_FORMAT_VERSION, "adamw", steps, with_optimizer)


def write_beside(
    directory: Path, state: TrainerState | FullTrainerState, optimizer_state: Mapping[str, torch.Tensor] | None
) -> int:
    """Write `optimizer.safetensors` (unless `optimizer_state` is None) and `state.json` into
    `directory`, beside the weights already there; fsync it. Bytes written."""
    size = 0
    if optimizer_state is not None:
        size += write_synced(directory / OPTIMIZER_FILE, encode_tensors(optimizer_state))
    size += write_synced(directory / STATE_FILE, msgspec.json.encode(state))
    fsync_directory(directory)
    return size


def check_lora_spec(checkpoint: str, stored: LoraSpec, spec: LoraSpec) -> None:
    """Raise BadRequest unless the checkpoint's adapter has the shape `spec` asks for."""
    for field in LORA_FIELDS:
        if getattr(stored, field) != getattr(spec, field):
            raise BadRequest(
                f"checkpoint {checkpoint!r} has LoRA {field}={getattr(stored, field)!r}; "
                f"the model wants {field}={getattr(spec, field)!r}",
                key=field,
            )


def check_family(name: str, family: str, optimizer: str) -> None:
    """Raise BadRequest unless a load asks for the optimizer family the open model has."""
    if family != optimizer:
        raise BadRequest(f"model {name} uses optimizer {family!r}; cannot load it as {optimizer!r}", key="optimizer")


def optimizer_file(directory: Path, optimizer: str, *, weights: str = "weights") -> Path:
    """The checkpoint's optimizer state file, checked: it is there, and of family `optimizer`.

    Raises:
        BadRequest: no optimizer state ("... holds <weights> only"); state of another family.
    """
    path = directory / OPTIMIZER_FILE
    if not path.is_file():
        raise BadRequest(f"checkpoint has no optimizer state ({directory.name!r} holds {weights} only)", key="optimizer")
    stored = stored_optimizer(directory)
    if stored != optimizer:
        raise BadRequest(
            f"checkpoint {directory.name!r} holds {stored!r} optimizer state; the model uses "
            f"{optimizer!r}: cannot override restored optimizer state",
            key="optimizer",
        )
    return path


def stored_optimizer(directory: Path) -> str:
    """The optimizer family a state checkpoint's state.json names ("adamw" when it has none)."""
    path = directory / STATE_FILE
    if not path.is_file():
        return "adamw"
    return msgspec.json.decode(path.read_bytes(), type=_StoredOptimizer).optimizer


def check_same_tensors(
    checkpoint: str, params: Mapping[str, torch.nn.Parameter], found: Mapping[str, torch.Tensor | Sequence[int]],
    *, fits: str = "model",
) -> None:
    """Raise BadRequest unless the checkpoint holds exactly `params`' names, each of its shape;
    `found` maps each name to its tensor or to its (whole) shape."""
    missing = sorted(set(params) - set(found))
    unknown = sorted(set(found) - set(params))
    if missing or unknown:
        raise BadRequest(
            f"checkpoint {checkpoint!r} does not fit this {fits}: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    for key, param in params.items():
        value = found[key]
        shape = list(value.shape if isinstance(value, torch.Tensor) else value)
        if shape != list(param.shape):
            raise BadRequest(f"checkpoint {checkpoint!r}: {key} has shape {shape}; expected {list(param.shape)}")


# ---------------------------------------------------------------- files


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
