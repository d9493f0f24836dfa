"""lora_addmm: a LoRA term added onto the base output in one addmm_, by autograd's matmuls or as
the oneDNN node, gives peft's own output and gradients, and anything but the plain case runs
peft's own forward.

Both sides are float32 and compute the same products; only where the scaling is applied differs
(on the (tokens, rank) x (rank, out) product inside addmm, against on its result), and outputs
and gradients reach ~10, where one float32 ulp is ~1e-6: atol 1e-5. The oneDNN node sums the
products in another order, and A's gradient reaches ~300: atol 1e-5 plus 1e-6 of the largest.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from openrld.gpu import lora_addmm

ATOL = 1e-5


class TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 48, bias=False)
        self.down = torch.nn.Linear(48, 16, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def lora_model(targets: list[str], dropout: float = 0.0, adapter: str = "one") -> peft.PeftModel:
    """A peft model over TwoLinears whose B is random, so that the LoRA term is not zero."""
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets)
    model = peft.get_peft_model(TwoLinears(), config, adapter_name=adapter)
    randomize_b(model)
    return model


def randomize_b(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()


def unfused(model: torch.nn.Module) -> None:
    """Give every LoRA linear its class's forward (peft's) back."""
    for module in model.modules():
        module.__dict__.pop("forward", None)


def output_and_gradients(model: torch.nn.Module, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    out = model(x, **kwargs)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads | {"x": x.grad.clone()}


def assert_same(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=ATOL)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=ATOL, msg=name)


def assert_close_in_scale(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=ATOL)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=ATOL + 1e-6 * scale, msg=name)


def compare(model: peft.PeftModel, x: torch.Tensor, **kwargs) -> None:
    lora_addmm.fuse(model)
    fused = output_and_gradients(model, x, **kwargs)
    unfused(model)
    assert_same(fused, output_and_gradients(model, x, **kwargs))


@pytest.fixture
def onednn_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer, however small its work and whoever made the CPU, runs as the oneDNN node."""
    monkeypatch.setattr(lora_addmm, "MIN_ONEDNN_WORK", 1)
    monkeypatch.setattr(lora_addmm, "ONEDNN_TRAINS", True)


def grad_fns(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The autograd node that made each LoRA linear's output for `x` (under the view back to x's
    shape), by its class's name."""
    names = []
    hooks = [m.register_forward_hook(lambda _, __, out: names.append(type(out.grad_fn.next_functions[0][0]).__name__))
             for m in model.modules() if isinstance(m, LoraLinear)]
    model(x)
    for hook in hooks:
        hook.remove()
    return names


def test_fuse_gives_each_lora_linear_the_addmm_forward_once():
    model = lora_model(["up", "down"])
    assert (lora_addmm.fuse(model), lora_addmm.fuse(model)) == (2, 0)


def test_an_adapter_that_wraps_a_new_linear_has_only_that_one_fused():
    model = lora_model(["up"])
    lora_addmm.fuse(model)
    model.add_adapter("two", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    assert lora_addmm.fuse(model) == 1


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 16)])
def test_the_fused_term_gives_pefts_output_and_gradients(shape):
    model = lora_model(["up", "down"])
    compare(model, torch.randn(shape))


def test_the_fused_term_is_taken_in_the_plain_case():
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    x = torch.randn(3, 16)
    assert [lora_addmm._plain_adapter(m, x) for m in model.modules() if isinstance(m, LoraLinear)] == ["one", "one"]


def test_two_active_adapters_run_pefts_forward_with_both_terms():
    model = lora_model(["up", "down"])
    model.add_adapter("two", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    randomize_b(model)
    model.base_model.set_adapter(["one", "two"])
    lora_addmm.fuse(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        both = model(x)
        model.base_model.set_adapter("one")
        one = model(x)
    assert not torch.allclose(both, one)
    unfused(model)
    model.base_model.set_adapter(["one", "two"])
    with torch.no_grad():
        torch.testing.assert_close(both, model(x), rtol=0, atol=ATOL)


def test_a_layer_with_dropout_runs_pefts_forward():
    model = lora_model(["up", "down"], dropout=0.5)
    lora_addmm.fuse(model)
    x = torch.randn(3, 16)
    assert [lora_addmm._plain_adapter(m, x) for m in model.modules() if isinstance(m, LoraLinear)] == [None, None]


def test_a_disabled_adapter_adds_no_term():
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    x = torch.randn(3, 16)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(x), model.base_model.model.down(torch.relu(x @ model.base_model.model.up.base_layer.weight.t())))


def test_a_mixed_batch_runs_pefts_forward_per_row():
    model = lora_model(["up", "down"])
    model.add_adapter("two", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"]))
    randomize_b(model)
    model.eval()  # peft refuses adapter_names in training mode
    lora_addmm.fuse(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        mixed = model(x, adapter_names=["one", "two"])
        model.base_model.set_adapter("two")
        torch.testing.assert_close(mixed[1], model(x)[1], rtol=0, atol=ATOL)
        model.base_model.set_adapter("one")
        torch.testing.assert_close(mixed[0], model(x)[0], rtol=0, atol=ATOL)


def test_a_float64_input_to_float32_weights_runs_pefts_forward():
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    x = torch.randn(3, 16, dtype=torch.float64)
    assert [lora_addmm._plain_adapter(m, x) for m in model.modules() if isinstance(m, LoraLinear)] == [None, None]


@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 16)])
def test_the_onednn_node_gives_pefts_output_and_gradients(onednn_for_all, shape):
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    x = torch.randn(shape)
    fused = output_and_gradients(model, x)
    unfused(model)
    assert_close_in_scale(fused, output_and_gradients(model, x))


def test_an_input_without_a_gradient_still_trains_a_and_b_on_the_onednn_node(onednn_for_all):
    model = lora_model(["up"])
    lora_addmm.fuse(model)
    x = torch.randn(6, 16)  # the first layer's input: no gradient wanted
    model(x).sum().backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    unfused(model)
    model(x).sum().backward()
    assert_close_in_scale((torch.zeros(1), fused), (torch.zeros(1), {
        name: p.grad for name, p in model.named_parameters() if p.grad is not None}))


def test_a_frozen_float32_layer_on_the_cpu_runs_as_the_onednn_node(onednn_for_all):
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    assert grad_fns(model, torch.randn(3, 16)) == ["_OneDnnLoraBackward", "_OneDnnLoraBackward"]


def test_a_layer_with_little_work_keeps_autograds_matmuls():
    model = lora_model(["up", "down"])  # 3 rows x 768 weights: far below MIN_ONEDNN_WORK
    lora_addmm.fuse(model)
    assert grad_fns(model, torch.randn(3, 16)) == ["AddmmBackward0", "AddmmBackward0"]


def test_a_layer_on_an_intel_cpu_keeps_autograds_matmuls(onednn_for_all, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lora_addmm, "ONEDNN_TRAINS", False)
    model = lora_model(["up", "down"])
    lora_addmm.fuse(model)
    assert grad_fns(model, torch.randn(3, 16)) == ["AddmmBackward0", "AddmmBackward0"]


@pytest.mark.parametrize("cpuinfo, vendor", [
    ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n", "GenuineIntel"),
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\n", "AuthenticAMD"),
    ("processor\t: 0\nCPU implementer\t: 0x41\n", None),  # an Arm machine names none
])
def test_the_cpu_vendor_is_read_from_cpuinfo(cpuinfo: str, vendor: str | None):
    assert lora_addmm.cpu_vendor(cpuinfo) == vendor


def test_only_an_intel_cpu_trains_on_autograds_matmuls():
    vendor = lora_addmm.cpu_vendor(Path("/proc/cpuinfo").read_text())
    assert lora_addmm.ONEDNN_TRAINS is (vendor != "GenuineIntel")


def test_a_base_weight_that_trains_keeps_autograds_matmuls_and_gets_its_gradient(onednn_for_all):
    model = lora_model(["up", "down"])
    up = model.base_model.model.up.base_layer.weight
    up.requires_grad_(True)
    lora_addmm.fuse(model)
    x = torch.randn(3, 16)
    assert grad_fns(model, x) == ["AddmmBackward0", "_OneDnnLoraBackward"]
    fused = output_and_gradients(model, x)
    unfused(model)
    expected = output_and_gradients(model, x)
    assert "base_model.model.up.base_layer.weight" in expected[1]
    assert_close_in_scale(fused, expected)
