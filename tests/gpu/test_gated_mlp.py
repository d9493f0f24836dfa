"""gated_mlp: a plain gated MLP's act(gate) * up as one node that keeps gate and up, with the
output and gradients of the model's own forward, in every family whose MLP is the plain one.

Both sides compute the same float32 values; backward sums the same products in another order:
outputs, losses and gradients atol 1e-5 plus rtol 1e-5 (the tiny models' gradients reach ~1).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from openrld.gpu import gated_mlp
from openrld.gpu.tiny_models import FAMILIES

TOL = dict(rtol=1e-5, atol=1e-5)
TOKENS, HIDDEN, INTERMEDIATE = 5, 16, 48
# Plain gated MLPs in each family's tiny build: one a layer, and a MoE layer's shared expert.
# Phi-3 fuses gate and up into one projection; Qwen3-MoE's layers are all routed experts.
FUSED = {
    "llama": 2, "qwen2": 2, "qwen3": 2, "mistral": 2, "olmo2": 2, "phi3": 0,
    "gemma3": 4, "gemma4": 4, "qwen3_5": 4, "qwen3_moe": 0, "qwen3_5_moe": 4,
}  # fmt: skip


def llama_mlp() -> LlamaMLP:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=2, num_key_value_heads=1)
    return LlamaMLP(config)


def gemma3_mlp() -> Gemma3MLP:
    torch.manual_seed(0)
    config = Gemma3TextConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=2, num_key_value_heads=1)
    return Gemma3MLP(config)


def output_and_gradients(module: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    module.zero_grad()
    out = module(x)
    out.pow(2).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("make", [llama_mlp, gemma3_mlp], ids=["silu", "gelu_tanh"])
def test_the_node_gives_the_mlps_own_output_and_gradients(make):
    expected_out, expected_grads = output_and_gradients(make())
    module = make()
    assert gated_mlp.fuse(module) == 1
    out, grads = output_and_gradients(module)
    torch.testing.assert_close(out, expected_out, **TOL)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, **TOL)


def test_the_node_keeps_only_gate_and_up_for_backward():
    module = llama_mlp().requires_grad_(False)
    gated_mlp.fuse(module)
    kept: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape == (TOKENS, INTERMEDIATE):
            kept.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(torch.randn(TOKENS, HIDDEN, requires_grad=True))
    assert len(kept) == 2


def test_another_activation_keeps_the_mlps_forward():
    module = llama_mlp()
    module.act_fn = torch.nn.ReLU()
    assert gated_mlp.fuse(module) == 0
    assert "forward" not in module.__dict__


def test_a_module_is_fused_once():
    module = llama_mlp()
    assert (gated_mlp.fuse(module), gated_mlp.fuse(module)) == (1, 0)


def loss_and_gradients(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ids = torch.arange(3, 19)[None]
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad if p.grad is not None else torch.zeros(()) for p in model.parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_alike_with_its_plain_mlps_fused(family_dirs, family):
    expected_loss, expected_grads = loss_and_gradients(transformers.AutoModelForCausalLM.from_pretrained(family_dirs[family]))
    model = transformers.AutoModelForCausalLM.from_pretrained(family_dirs[family])
    assert gated_mlp.fuse(model) == FUSED[family]
    loss, grads = loss_and_gradients(model)
    torch.testing.assert_close(loss, expected_loss, **TOL)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, **TOL)
