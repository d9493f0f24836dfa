"""A trainer's LoRA linear: the term added onto the base layer's output in one `addmm_`, and on
the CPU the frozen base and the term's gradients through oneDNN.

peft's `lora.Linear` computes `result + lora_B(lora_A(dropout(x))) * scaling`: B's product
lands in a new (tokens, out) tensor, is scaled into a second and added into a third, and
backward scales the (tokens, out) gradient once more. At a training step's size those
passes over (tokens, out) cost as much as the small matmuls themselves: SmolLM2's 211 LoRA
terms (rank 8, lm_head's out is the 49,152-token vocabulary) in an SFT step of 8 x 128
tokens on two CPU threads, 5.98 s a step with peft's forward against 5.35 s with one
`addmm_` (the daemon's trainer engine alone, alternating, medians of five). The sum is the
same one: `result += scaling * (lora_A(x) @ B.T)`, float32 rounding apart.

On a CPU that is not Intel's (below), in float32, a layer whose base weight is frozen runs as
one autograd node (`_OneDnnLora`) whose matmuls are oneDNN's (`torch.ops.mkldnn._linear_pointwise`,
the inner product torch's inductor uses for CPU linears) on the weights as they lie, unpacked:
`F.linear` and autograd's `mm` run MKL's sgemm, which on an AMD EPYC (Zen 4, two threads) reaches
115-195 GFLOP/s at a trainer's micro-batch of 256-384 rows against oneDNN's 160-220, and
autograd takes the gradient of B, whose transpose is the `addmm_`'s operand, as a product
whose output is (out, rank): lm_head's, (49,152 x 384) x (384 x 8), took 47 ms in MKL against
4.9 ms as oneDNN's (rank x tokens) x (tokens x out). The backward is written out: the input's
gradient through the frozen weight's transpose plus the term's, and A's and B's; W and the
bias get none, which is what makes the node apply (a full fine-tune's weights train and keep
autograd's). The results are the same products summed in another order (float32 rounding).
SmolLM2's SFT step of 8 x 128 in the trainer engine alone: 4.04-4.70 s against 4.83-5.26
before (two runs each way, alternating; CPU user time 7.5-8.9 s a step against 8.9-9.9).

On an Intel CPU the node is not taken (`ONEDNN_TRAINS`): there MKL's sgemm runs its AVX-512
kernels and was the faster of the two. SmolLM2's SFT step of 8 x 128 in the trainer engine alone
on a Xeon (Sapphire Rapids, two threads), three pairs alternating: 3.26-3.67 s with autograd's
matmuls against 3.59-3.83 s with the node; with the node for lm_head alone, 3.46-3.58 s against
3.26-3.51. Which of the two wins is the CPU's, not the model's, so it is read once, from the
CPU's vendor (/proc/cpuinfo).

A layer whose work is small (`MIN_ONEDNN_WORK`: most of the tiny models' linears, a few rows
of SmolLM2's) keeps autograd's matmuls: there oneDNN's fixed cost a call (12-15 microseconds,
`packed_linear`) is more than it saves.

`fuse(model)` gives each of peft's `lora.Linear` modules in the model that forward, on the
instance (torch and peft keep their classes). It takes the plain case only: one active
adapter, no dropout, no LoRA variant (DoRA) or bias, not merged, no per-row `adapter_names`
(the sampler's mixed batches), and a base layer that is a plain `nn.Linear`, whose output
is a fresh tensor that may be written in place. Anything else runs peft's own forward.
peft has no such option, and torch none that routes a float32 matmul to oneDNN; this module
is small and replaces nothing else of peft's.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

from openrld.gpu import packed_linear

# Multiply-adds of a layer's base product (rows x weight elements) from which it runs on oneDNN.
# A layer's forward and backward at rank 8, oneDNN's node against autograd's matmuls, 1 and 2
# threads: 7.9 Mi (1,016 rows of 128 x 64) 0.87 / 0.65 ms against 1.01 / 0.60; 10 Mi (32 rows of
# 576 x 576) 0.86 / 0.66 against 0.73 / 0.53; 24 Mi (the tiny Llama's head, 384 x 64, at 8 x 128)
# 1.7 / 1.1 against 2.7 / 1.4; 27 Mi (256 rows of SmolLM2's 192 x 576) 1.7 / 1.1 against 1.8 / 1.2.
MIN_ONEDNN_WORK = 2**24


def cpu_vendor(cpuinfo: str) -> str | None:
    """The CPU's vendor in a /proc/cpuinfo text ("GenuineIntel", "AuthenticAMD"), or None."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def _this_cpu_vendor() -> str | None:
    try:
        return cpu_vendor(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no way to tell, and the node stays on
        return None


# Whether a frozen float32 layer on this machine's CPU trains through oneDNN (the docstring).
ONEDNN_TRAINS = _this_cpu_vendor() != "GenuineIntel"


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
    base = layer.base_layer
    if _on_onednn(rows, base):
        result = _OneDnnLora.apply(rows, base.weight, base.bias, lora_a, lora_b, layer.scaling[adapter])
    else:
        result = base(rows)  # (tokens, out)
        result.addmm_(F.linear(rows, lora_a), lora_b.t(), alpha=layer.scaling[adapter])
    return result.view(*x.shape[:-1], result.shape[-1])


def _on_onednn(rows: torch.Tensor, base: torch.nn.Linear) -> bool:
    """Whether the layer runs as `_OneDnnLora`: float32 on a CPU where oneDNN trains faster than
    MKL, a frozen base, and work enough to repay oneDNN's fixed cost."""
    weight, bias = base.weight, base.bias
    return (
        ONEDNN_TRAINS and rows.device.type == "cpu" and rows.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and not weight.requires_grad and (bias is None or not bias.requires_grad)
        and rows.shape[0] * weight.numel() >= MIN_ONEDNN_WORK
    )


class _OneDnnLora(torch.autograd.Function):
    """`x @ W.T + bias + scaling * (x @ A.T) @ B.T` on 2-D x, W and bias frozen; oneDNN's matmuls
    (`packed_linear.linear`, on weights as they lie: (n, k) of any strides)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        x = x.contiguous()
        down = packed_linear.linear(x, lora_a, None)  # (tokens, rank)
        result = packed_linear.linear(x, weight, bias)  # (tokens, out)
        result.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, down, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, down, weight, lora_a, lora_b = ctx.saved_tensors
        grad = grad.contiguous()  # (tokens, out)
        wants_x, wants_a, wants_b = (ctx.needs_input_grad[i] for i in (0, 3, 4))
        grad_x = grad_a = grad_b = None
        if wants_x or wants_a:
            grad_down = packed_linear.linear(grad, lora_b.t(), None).mul_(ctx.scaling)  # (tokens, rank)
        if wants_x:
            grad_x = packed_linear.linear(grad, weight.t(), None)  # (tokens, in): through the frozen weight
            grad_x.addmm_(grad_down, lora_a)
        if wants_a:
            grad_a = packed_linear.linear(grad_down.t().contiguous(), x.t(), None)  # (rank, in)
        if wants_b:
            # (rank, tokens) x (tokens, out), read along grad's rows; its transpose is B's (out, rank).
            grad_b = packed_linear.linear(down.t().mul(ctx.scaling).contiguous(), grad.t(), None).t()
        return grad_x, None, None, grad_a, grad_b, None


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
