"""A trainer's gated MLP, `down(act(gate(x)) * up(x))`, with `act(gate) * up` as one autograd
node that keeps only `gate` and `up` for backward.

Autograd keeps four (tokens, intermediate) tensors a layer for that product: the activation's
input (gate) and output, `up`, and the product itself, which the down projection's LoRA keeps
again as its input. The activation's output needs no keeping: backward recomputes it from
`gate` in one elementwise pass, and takes both gradients with torch's own kernels (the
activation's `silu_backward` or `gelu_backward`, the same formulas autograd runs), so the
gradients are autograd's, float32 rounding apart. It drops one of those four tensors. SmolLM2's
activations kept for backward (`scoring`'s bytes a token, measured): 1.02 MB a token against
1.21 MB. A CPU trainer's micro-batch holds what its budget keeps (`scoring`'s 512 MiB), so
SmolLM2's 8 x 128 SFT step runs in two micro-batches of 4 datums instead of three of at most 3,
and MKL's matmuls run faster on the larger ones: in the trainer engine alone on a Xeon, two
alternating pairs of four steps, 3.43-3.57 s and 3.29-3.36 s a step against 3.50-3.79 s and
3.50-3.58 s (CPU user time 6.1-6.7 s a step against 6.6-7.1).

`fuse(model)` gives the node to each MLP module whose forward is transformers' plain gated MLP
(Llama's bytecode: Qwen2, Qwen3, Qwen3.5, Qwen3-MoE's dense layers, Mistral, Gemma 3 and 4
share it) and whose activation is SiLU or GELU's tanh approximation, on the instance (the
class keeps its forward, the sampler's model is untouched). The projections stay the modules
they are (peft's LoRA linears, `lora_addmm`'s forward). Anything else (another activation, a
forward of its own such as Phi-3's fused gate_up, MoE experts) keeps its forward. torch has no
fused gated activation; this module is that one node.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import GELUTanh, SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP


def fuse(model: torch.nn.Module) -> int:
    """Give every plain gated MLP of `model` the node's forward; returns how many were given it."""
    fused = 0
    for module in model.modules():
        activation = _activation(module)
        if activation is not None and "forward" not in module.__dict__:
            module.forward = types.MethodType(functools.partial(_forward, activation=activation), module)
            fused += 1
    return fused


def _activation(module: torch.nn.Module) -> str | None:
    """`module`'s activation ("silu" or "gelu_tanh") where its forward is Llama's gated MLP; else None.
    Activation classes are matched exactly: a subclass may compute something else."""
    if not _same_code(type(module).forward, LlamaMLP.forward):
        return None
    act = getattr(module, "act_fn", None)
    if type(act) in (torch.nn.SiLU, SiLUActivation):
        return "silu"
    # GELUTanh's forward is `self.act`: F.gelu's tanh approximation, unless built for its Python formula.
    inner = getattr(act, "act", None) if type(act) is GELUTanh else None
    if isinstance(inner, functools.partial) and inner.func is F.gelu and inner.keywords == {"approximate": "tanh"}:
        return "gelu_tanh"
    if type(act) is torch.nn.GELU and getattr(act, "approximate", None) == "tanh":
        return "gelu_tanh"
    return None


def _same_code(function: Any, reference: Any) -> bool:
    code, expected = getattr(function, "__code__", None), reference.__code__
    same = (expected.co_code, expected.co_names, expected.co_consts)
    return code is not None and (code.co_code, code.co_names, code.co_consts) == same


def _forward(self: torch.nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor:
    return self.down_proj(GatedActivation.apply(self.gate_proj(x), self.up_proj(x), activation))


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


class GatedActivation(torch.autograd.Function):
    """act(gate) * up, keeping gate and up; backward recomputes act(gate)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return _activate(gate, activation).mul_(up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = _activate(gate, ctx.activation).mul_(grad)
        if ctx.needs_input_grad[0]:
            grad_act = grad * up
            if ctx.activation == "silu":
                grad_gate = torch.ops.aten.silu_backward(grad_act, gate)
            else:
                grad_gate = torch.ops.aten.gelu_backward(grad_act, gate, approximate="tanh")
        return grad_gate, grad_up, None
