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

# LoRA targets, as module-name suffixes peft matches in any family (a name a family lacks
# matches nothing there). Attention: separate q/k/v/o (Llama, Qwen, Mistral, OLMo 2, Gemma 3
# and 4: Gemma 4's KV-shared layers have no k/v of their own, so only q/o there), Phi-3's fused
# qkv_proj, and Qwen3.5's Gated DeltaNet layers (in_proj_qkv, in_proj_z, out_proj; their
# in_proj_a/in_proj_b make one decay and one gate scalar per head and stay frozen).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "in_proj_qkv", "in_proj_z", "out_proj")
# MLP: gate/up/down (a MoE's shared expert too, Qwen3.5-MoE's `shared_expert`) and Phi-3's fused
# gate_up_proj. Routers (`mlp.gate`, `shared_expert_gate`) and Gemma 4's per-layer-input
# projections stay frozen.
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
# A mixture-of-experts layer holds its experts as two 3-D parameters, (experts, out, in), not
# as modules (transformers 5: Qwen3-MoE, Qwen3.5-MoE); peft trains them through these
# `target_parameters` (lora.ParamWrapper: one LoRA per expert, rank x experts in all).
# train_mlp trains them with the rest of the MLP; a LoraConfig without them (train_mlp=False)
# freezes every expert.
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
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


def lora_target_parameters(spec: LoraSpec) -> list[str]:
    """The experts' 3-D parameters when the MLP trains (`EXPERT_PARAMETERS`); none otherwise."""
    return list(EXPERT_PARAMETERS) if spec.train_mlp else []


def lora_config(spec: LoraSpec) -> peft.LoraConfig:
    """alpha = 32 whatever the rank, as Tinker does, with no dropout so that forward is deterministic.

    The experts are named as `target_parameters` explicitly: peft would otherwise wrap them
    only for families whose checkpoints transformers converts from per-expert modules
    (Qwen3-MoE), and never for those born fused (Qwen3.5-MoE). A dense model matches none
    of them, which peft notes once per process with a RuntimeWarning and otherwise ignores.
    """
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=lora_target_modules(spec),
        target_parameters=lora_target_parameters(spec) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def vocab_size(model) -> int:
    """The width of the output layer: the range a token id must fall in."""
    return int(model.get_output_embeddings().weight.shape[0])


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))
