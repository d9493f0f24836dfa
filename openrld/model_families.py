"""Which model families each engine holds, and the 400 that refuses the rest when a job is made.

A base model's family is read from its config's `architectures` (a GGUF's from its header),
which the catalog gives as `ModelEntry.arch`. `FAMILIES` lists the families openrld is
tested on (each has a tiny random build in `gpu/tiny_models.py`, run through every engine by
tests/e2e/test_family_matrix.py), with what only some engines need to know: how vLLM names
and packs their LoRA modules, and whether the family has mixture-of-experts layers.

`refusal(name, arch, engine)` says why `engine` cannot hold a model (None: it can):
- every engine holds decoder-only causal LMs (`...ForCausalLM`), and none holds a multimodal
  checkpoint (`...ForConditionalGeneration`: Gemma 3 4B and up, Gemma 4, Qwen3.5 as
  released) or an encoder-decoder one; their text-only model classes are served;
- the torch trainers and samplers hold any causal LM transformers loads, listed or not;
- the vLLM sampler holds the families whose vLLM LoRA layout is known here (`VllmLora`);
- the NeMo Automodel trainer (0.7.0, transformers 5.18) holds the listed families, measured
  in its own environment (tests/gpu/test_automodel_families.py); its LoRA (module patterns)
  cannot reach the 3-D expert tensors of a MoE layer, so a MoE LoRA job that trains the MLP
  is refused there (train_mlp=False freezes the experts on every trainer alike).

The job table and the sampling sessions call `check_engines` before a group is built, so a
create answers 400 naming the family and the engine instead of failing in the engine.

Never imports torch (the actors use it); pure data and functions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

from openrld.errors import BadRequest


class Engine(enum.Enum):
    """An engine a job's group may run; the value is how a refusal names it."""

    LORA_TRAINER = "the LoRA trainer (openrl.trainer_backend=pytorch)"
    FULL_TRAINER = "the full fine-tuning trainer (openrl.trainer_backend=pytorch)"
    AUTOMODEL_TRAINER = "the NeMo Automodel trainer (openrl.trainer_backend=automodel)"
    TORCH_SAMPLER = "the torch sampler"
    VLLM_SAMPLER = "the vLLM sampler (this node's sampler_backend)"


class VllmLora(msgspec.Struct, frozen=True):
    """How vLLM's model class for a family takes a peft adapter (read from vLLM's
    `packed_modules_mapping` and `embedding_modules`; vLLM is not installable here)."""

    # vLLM's fused module -> the peft modules whose LoRA it loads, in order.
    packed: dict[str, tuple[str, ...]]
    # The modules it takes a LoRA on under their own names (besides lm_head).
    plain: tuple[str, ...]
    # Whether its class lists lm_head among its embedding modules; without it vLLM refuses
    # an adapter that trains lm_head ("expected target modules in [...]").
    takes_lm_head: bool


# The packing every Llama-style vLLM class declares, and the projections it leaves alone.
_QKV_GATE_UP = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_DENSE = ("o_proj", "down_proj")
# Qwen3.5's Gated DeltaNet layers also fuse their input projections.
_GATED_DELTANET = _QKV_GATE_UP | {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
# A MoE layer's experts are one FusedMoE module, which loads peft's two ParamWrappers
# ("experts" for down_proj, "experts.base_layer" for gate_up_proj).
_EXPERTS = ("experts",)


class Family(msgspec.Struct, frozen=True):
    name: str  # as the README's table names it
    tiny: str  # its build in gpu/tiny_models.py (`FAMILIES`)
    architectures: tuple[str, ...]  # config.json `architectures` values of its text-only checkpoints
    vllm: VllmLora | None  # None: no vLLM LoRA layout known for it
    has_experts: bool = False  # mixture-of-experts layers (3-D expert tensors)


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", ("LlamaForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=True)),
    # vLLM's Qwen2 class declares no embedding modules (measured on vLLM 0.33, GPU).
    Family("Qwen2", "qwen2", ("Qwen2ForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=False)),
    # vLLM added lm_head LoRA to Qwen3 and Qwen3-MoE in 2026 (its PR 29816).
    Family("Qwen3", "qwen3", ("Qwen3ForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=True)),
    # vLLM's Mistral class is its Llama class with embedding_modules emptied: no LoRA on lm_head.
    Family("Mistral", "mistral", ("MistralForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=False)),
    Family("OLMo 2", "olmo2", ("Olmo2ForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=False)),
    # Phi-3's checkpoints hold qkv_proj and gate_up_proj fused already; vLLM's class is its Llama's.
    Family(
        "Phi-3", "phi3", ("Phi3ForCausalLM",), VllmLora({}, ("qkv_proj", "gate_up_proj", *_DENSE), takes_lm_head=True)
    ),
    Family("Gemma 3", "gemma3", ("Gemma3ForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=False)),
    Family("Gemma 4", "gemma4", ("Gemma4ForCausalLM",), VllmLora(_QKV_GATE_UP, _DENSE, takes_lm_head=False)),
    Family(
        "Qwen3.5", "qwen3_5", ("Qwen3_5ForCausalLM",),
        VllmLora(_GATED_DELTANET, (*_DENSE, "out_proj"), takes_lm_head=True),
    ),
    Family(
        "Qwen3-MoE", "qwen3_moe", ("Qwen3MoeForCausalLM",), VllmLora(_QKV_GATE_UP, (*_DENSE, *_EXPERTS), takes_lm_head=True),
        has_experts=True,
    ),
    Family(
        "Qwen3.5-MoE", "qwen3_5_moe", ("Qwen3_5MoeForCausalLM",),
        VllmLora(_GATED_DELTANET, (*_DENSE, "out_proj", *_EXPERTS), takes_lm_head=True),
        has_experts=True,
    ),
)

_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
_TORCH_ENGINES = frozenset({Engine.LORA_TRAINER, Engine.FULL_TRAINER, Engine.TORCH_SAMPLER})
CAUSAL_LM_SUFFIX = "ForCausalLM"


def family_of(arch: str) -> Family | None:
    """The listed family of a config's architecture, or None."""
    return _BY_ARCHITECTURE.get(arch)


def refusal(name: str, arch: str, engine: Engine, *, trains_mlp: bool = False) -> str | None:
    """Why `engine` cannot hold base model `name` of architecture `arch`; None when it can.

    Args:
        trains_mlp: a LoRA job's train_mlp (only the Automodel trainer asks: experts).
    """
    family = family_of(arch)
    label = f"base_model {name!r} ({family.name if family else arch}, {arch})"
    # A config without `architectures` names its model_type instead ("llama"): transformers'
    # AutoModelForCausalLM decides that one, so only a class for another head is refused here.
    if "For" in arch and not arch.endswith(CAUSAL_LM_SUFFIX):
        return (
            f"{label}: {engine.value} holds decoder-only causal language models (architectures "
            f"'...{CAUSAL_LM_SUFFIX}'); a multimodal or encoder-decoder checkpoint is not served: use the "
            "family's text-only checkpoint"
        )
    if engine in _TORCH_ENGINES:
        return None
    if family is None:
        known = ", ".join(f.name for f in FAMILIES)
        return f"{label}: {engine.value} is tested on {known} only; train this model with the pytorch engines"
    if engine is Engine.VLLM_SAMPLER and family.vllm is None:
        return f"{label}: {engine.value} has no LoRA layout for {family.name}; use a node whose sampler_backend is torch"
    if engine is Engine.AUTOMODEL_TRAINER and family.has_experts and trains_mlp:
        return (
            f"{label}: {engine.value} cannot train {family.name}'s experts with LoRA (NeMo Automodel 0.7.0 "
            "adapts modules, and the experts are 3-D tensors); create the LoRA model with train_mlp=False "
            "(experts frozen), or use openrl.trainer_backend=pytorch, which trains them"
        )
    return None


def check_engines(name: str, arch: str, engines: Iterable[Engine], *, trains_mlp: bool = False) -> None:
    """Raise BadRequest (400) with the first engine's refusal, if any engine refuses."""
    for engine in engines:
        why = refusal(name, arch, engine, trains_mlp=trains_mlp)
        if why is not None:
            raise BadRequest(why, key="base_model")


def job_engines(
    *, is_full: bool, is_automodel: bool, trainer_image: bool, sampler_image: bool, lora_sampler: Engine
) -> list[Engine]:
    """The built-in engines a job's group runs (a job's own image is its owner's business).

    Args:
        lora_sampler: the node's sampler for LoRA groups (TORCH_SAMPLER or VLLM_SAMPLER); a
            full fine-tuning job always samples with the torch sampler (its FullSampler).
    """
    engines = []
    if not trainer_image:
        engines.append(
            Engine.AUTOMODEL_TRAINER if is_automodel else Engine.FULL_TRAINER if is_full else Engine.LORA_TRAINER
        )
    if not sampler_image:
        engines.append(Engine.TORCH_SAMPLER if is_full else lora_sampler)
    return engines
