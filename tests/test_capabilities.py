"""The torch-free capability facts agree with the registries they mirror."""

from __future__ import annotations

from openrld.api import capabilities
from openrld.gpu import losses


def test_supported_losses_are_the_trainer_loss_registry_in_order():
    assert tuple(losses.LOSSES) == capabilities.SUPPORTED_LOSSES


def test_refused_losses_are_the_trainer_refusals():
    assert tuple(losses.NOT_SUPPORTED) == capabilities.REFUSED_LOSSES


def test_automodel_is_built_only_where_the_node_has_its_environment():
    assert [(b.name, b.built) for b in capabilities.trainer_backends()] == [
        ("pytorch", True), ("automodel", False), ("image", True),
    ]
    assert [(b.name, b.built) for b in capabilities.trainer_backends(has_automodel=True)] == [
        ("pytorch", True), ("automodel", True), ("image", True),
    ]
    assert [(b.name, b.built) for b in capabilities.sampler_backends()] == [("torch", True), ("vllm", True)]


def test_capabilities_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, openrld.api.capabilities, openrld.api.openrl, openrld.api.metrics; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
