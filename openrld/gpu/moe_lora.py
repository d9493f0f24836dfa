"""Mixture-of-experts blocks whose experts carry LoRA adapters, in batches that mix adapters.

transformers 5 keeps a MoE layer's experts as two 3-D parameters, `gate_up_proj`
(experts, 2 x intermediate, hidden) and `down_proj` (experts, hidden,
intermediate), and peft trains them through `lora.ParamWrapper`: one wrapper per
parameter, nested around the experts module, each holding rank x experts LoRA
rows. A wrapper applies its adapter by folding it into the whole parameter for
the length of a forward, so it refuses `adapter_names` (a batch whose rows use
different adapters): one fold serves one adapter.

`enable_mixed_batches` gives each such experts block a forward that serves a
mixed batch in one call: per expert, the tokens routed to it run through the base
weights together, and each adapter's rows among them add that adapter's
low-rank term, scaling * (x A_e^T) B_e^T, to the projection before the
activation and to the one after it; a row on "__base__" adds none. It is the
expert loop of the model's own eager forward with those terms added, so a
batch equals each of its rows run alone within float rounding, and nothing the
size of an expert stack is built per adapter. Outside mixed batches (the
trainer, a plain forward) the wrappers behave as peft wrote them.

Why it is written here: peft does not support mixed adapter batches on
`ParamWrapper` (0.21: "does not support mixed batch inference"), and no other
library runs transformers' fused expert parameters with per-row adapters.
Plain synchronous torch; no trio.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper

from openrld.gpu.fused_forward import BASE_ADAPTER

_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def enable_mixed_batches(model: torch.nn.Module) -> int:
    """Give every experts block that peft wrapped a forward that takes `adapter_names`.

    Idempotent: a block already given one keeps it; call it again after adapters come, as
    peft wraps a block when the first adapter arrives. Returns the number of blocks it
    serves. Raises ValueError for an experts block of another layout than
    `gate_up_proj` / `down_proj` used as `F.linear` weights.
    """
    served = 0
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper) or _is_inner(model, name):
            continue
        chain = _chain(module)
        _check_layout(name, module, chain)
        if not getattr(module, "_openrld_mixed", False):
            module.forward = functools.partial(_forward, module, module.forward, chain)
            module._openrld_mixed = True
        served += 1
    return served


def _is_inner(model: torch.nn.Module, name: str) -> bool:
    """Whether the wrapper at `name` is the base layer of another wrapper."""
    parent = name.rpartition(".")[0]
    return name.endswith(".base_layer") and isinstance(model.get_submodule(parent), ParamWrapper)


def _chain(outer: ParamWrapper) -> dict[str, ParamWrapper]:
    """The nested wrappers of one experts block, by the parameter each adapts."""
    chain: dict[str, ParamWrapper] = {}
    module: torch.nn.Module = outer
    while isinstance(module, ParamWrapper):
        chain[module.parameter_name] = module
        module = module.base_layer
    return chain


def _check_layout(name: str, outer: ParamWrapper, chain: dict[str, ParamWrapper]) -> None:
    experts = outer.get_base_layer()
    unknown = set(chain) - set(_EXPERT_PARAMETERS)
    if unknown or any(not chain[p]._did_swap_in_out_features for p in chain):
        raise ValueError(f"{name}: mixed adapter batches need experts adapted on {_EXPERT_PARAMETERS}, got {sorted(chain)}")
    for attribute in ("gate_up_proj", "down_proj", "act_fn"):
        if not hasattr(experts, attribute):
            raise ValueError(f"{name}: {type(experts).__name__} has no {attribute}; its layout is not served")
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        raise ValueError(f"{name}: {type(experts).__name__}'s transposed or biased experts are not served")


def _forward(
    outer: ParamWrapper,
    peft_forward,
    chain: dict[str, ParamWrapper],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *args,
    adapter_names: list[str] | None = None,
    **kwargs,
) -> torch.Tensor:
    if adapter_names is None or outer.disable_adapters or outer.merged:
        return peft_forward(hidden, top_k_index, top_k_weights, *args, **kwargs)
    experts = outer.get_base_layer()
    per_row = hidden.shape[0] // len(adapter_names)  # the block sees (rows x positions, hidden)
    adapter_of_token = [name for name in adapter_names for _ in range(per_row)]
    used = sorted(set(adapter_of_token) - {BASE_ADAPTER})
    # Each adapter's tokens, as a mask over all of them.
    token_masks = {
        name: torch.tensor([a == name for a in adapter_of_token], device=hidden.device) for name in used
    }
    factors = {p: {a: wrapper.get_delta_factors(a) for a in used if a in wrapper.lora_A} for p, wrapper in chain.items()}
    gate_up, down = experts.gate_up_proj, experts.down_proj
    out = torch.zeros_like(hidden)
    with torch.no_grad():
        hit = torch.zeros(experts.num_experts + 1, dtype=torch.bool, device=hidden.device)
        hit[top_k_index.flatten()] = True
    for expert in hit[: experts.num_experts].nonzero()[:, 0].tolist():
        token, slot = torch.where(top_k_index == expert)
        x = hidden[token]
        masks = {name: mask[token] for name, mask in token_masks.items()}
        projected = _plus_lora(F.linear(x, gate_up[expert]), x, expert, factors.get("gate_up_proj", {}), masks)
        gate, up = projected.chunk(2, dim=-1)
        inner = experts.act_fn(gate) * up
        y = _plus_lora(F.linear(inner, down[expert]), inner, expert, factors.get("down_proj", {}), masks)
        y = y * top_k_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _plus_lora(
    base: torch.Tensor,
    x: torch.Tensor,
    expert: int,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    masks: dict[str, torch.Tensor],
) -> torch.Tensor:
    """`base` plus, on each adapter's rows of `x`, its low-rank term for `expert`.

    peft's factors give the delta as scaling * lhs @ rhs, (experts, out, in), with lhs = B
    (experts, out, rank) and rhs = A (experts, rank, in); so a row's term is
    scaling * (x A_e^T) B_e^T."""
    for name, (lhs, rhs, scaling) in factors.items():
        rows = masks[name]
        if not bool(rows.any()):
            continue
        term = F.linear(F.linear(x[rows], rhs[expert]), lhs[expert]) * scaling
        base = base.index_put((rows.nonzero()[:, 0],), term, accumulate=True)
    return base
