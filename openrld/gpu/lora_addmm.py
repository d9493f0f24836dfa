"""A trainer's LoRA terms added onto the base layer's output in one `addmm_`.

peft's `lora.Linear` computes `result + lora_B(lora_A(dropout(x))) * scaling`: B's product
lands in a new (tokens, out) tensor, is scaled into a second and added into a third, and
backward scales the (tokens, out) gradient once more. At a training step's size those
passes over (tokens, out) cost as much as the small matmuls themselves: SmolLM2's 211 LoRA
terms (rank 8, lm_head's out is the 49,152-token vocabulary) in an SFT step of 8 x 128
tokens on two CPU threads, 5.98 s a step with peft's forward against 5.35 s with one
`addmm_` (the daemon's trainer engine alone, alternating, medians of five). The sum is the
same one: `result += scaling * (lora_A(x) @ B.T)`, float32 rounding apart; autograd's
`addmm` backward gives the same gradients to A, B and x.

`fuse(model)` gives each of peft's `lora.Linear` modules in the model that forward, on the
instance (torch and peft keep their classes). It takes the plain case only: one active
adapter, no dropout, no LoRA variant (DoRA) or bias, not merged, no per-row `adapter_names`
(the sampler's mixed batches), and a base layer that is a plain `nn.Linear`, whose output
is a fresh tensor that may be written in place. Anything else runs peft's own forward.
peft has no such option; this module is small and replaces nothing else of peft's.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear


def fuse(model: torch.nn.Module) -> int:
    """Give each of `model`'s peft LoRA linears not yet fused the one-`addmm_` forward; how many were."""
    fused = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and getattr(module.forward, "__func__", None) is not _forward:
            module.forward = types.MethodType(_forward, module)
            fused += 1
    return fused


def _forward(layer: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    adapter = _plain_adapter(layer, x) if not args and not kwargs else None
    if adapter is None:
        return LoraLinear.forward(layer, x, *args, **kwargs)
    lora_a, lora_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    rows = x.reshape(-1, x.shape[-1])  # (tokens, in)
    # A plain nn.Linear's output is a fresh tensor, so it can take the term in place. It is the
    # 2-D tensor itself, not a view of it: autograd would wrap an in-place op on a view in
    # CopySlices, which copies the (tokens, out) gradient back and forth (0.6 s of SmolLM2's step).
    result = layer.base_layer(rows)  # (tokens, out)
    result.addmm_(F.linear(rows, lora_a), lora_b.t(), alpha=layer.scaling[adapter])
    return result.view(*x.shape[:-1], result.shape[-1])


def _plain_adapter(layer: LoraLinear, x: torch.Tensor) -> str | None:
    """The one active adapter's name, when the layer's forward of `x` is plain LoRA over a plain
    linear of x's dtype; else None."""
    if layer.disable_adapters or layer.merged or type(layer.base_layer) is not torch.nn.Linear:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    adapter = active[0]
    if (
        adapter not in layer.lora_A
        or adapter in layer.lora_variant
        or not isinstance(layer.lora_dropout[adapter], torch.nn.Identity)
        or layer.lora_B[adapter].bias is not None
        or layer.lora_A[adapter].weight.dtype != x.dtype
        or layer.base_layer.weight.dtype != x.dtype
    ):
        return None
    return adapter
