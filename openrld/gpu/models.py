"""Loading base models and shaping LoRA adapters: shared by the trainer and the sampler.

A base model is a local directory in Hugging Face layout (resolving a Hub id or
converting a GGUF file into such a directory happens before this module is
called). The dtype is chosen per device: CPUs here have no native bf16, so they
compute in float32; CUDA devices use bf16 where supported. Nothing here knows
about requests, futures or trio.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

from openrld.batches import LoraSpec

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def pick_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU (bf16 matmuls are ~300x slower here), bf16 on CUDA when supported."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_causal_lm(model_dir: str | Path, device: torch.device, dtype: torch.dtype | None = None):
    """Load the base model in eval mode with every base parameter frozen."""
    dtype = dtype or pick_dtype(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def lora_target_modules(spec: LoraSpec) -> list[str]:
    targets: list[str] = []
    if spec.train_attn:
        targets += ATTN_MODULES
    if spec.train_mlp:
        targets += MLP_MODULES
    if spec.train_unembed:
        targets += UNEMBED_MODULES
    assert targets, "LoraSpec must train at least one of attn, mlp, unembed"
    return targets


def lora_config(spec: LoraSpec) -> peft.LoraConfig:
    """alpha = 32 whatever the rank, as Tinker does, with no dropout so that forward is deterministic."""
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=lora_target_modules(spec),
        bias="none",
        task_type="CAUSAL_LM",
    )


def vocab_size(model) -> int:
    """The width of the output layer: the range a token id must fall in."""
    return int(model.get_output_embeddings().weight.shape[0])


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))
