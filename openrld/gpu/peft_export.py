"""External weights: a LoRA adapter written in the PEFT / Hugging Face format.

`save_weights_external` checkpoints are for use outside openrld, so they hold
exactly what `peft.PeftModel.from_pretrained(base, directory)` reads:
`adapter_model.safetensors` (the tensors keyed as peft's own state dict keys
them, which is how the trainer hands them over) and `adapter_config.json`
(the peft `LoraConfig` the trainer trained with, naming the base model).

Guarantees: every file is fsynced before the call returns; nothing is
pickled. Staging and renaming into place are the caller's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from openrld.batches import LoraSpec
from openrld.gpu.checkpoint import encode_tensors, fsync_directory, write_synced
from openrld.gpu.models import lora_config

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def _jsonable(value: object) -> object:
    # peft's config holds sets (target_modules) and enums; JSON wants lists and strings.
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)  # type: ignore[type-var]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):
        return _jsonable(value.value)
    return value


def peft_config_json(spec: LoraSpec, base_model: str) -> dict[str, object]:
    """The adapter_config.json peft writes for this adapter."""
    config = lora_config(spec)
    config.base_model_name_or_path = base_model
    body = _jsonable(config.to_dict())
    assert isinstance(body, dict)
    return body


def save_peft_adapter(
    directory: Path, tensors: Mapping[str, torch.Tensor], spec: LoraSpec, base_model: str
) -> int:
    """Write a peft-loadable adapter into the existing, empty `directory`; returns bytes written."""
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; saves go into a fresh directory")
    size = write_synced(directory / PEFT_WEIGHTS, encode_tensors(tensors))
    config = json.dumps(peft_config_json(spec, base_model), indent=2, sort_keys=True).encode()
    size += write_synced(directory / PEFT_CONFIG, config)
    fsync_directory(directory)
    return size
