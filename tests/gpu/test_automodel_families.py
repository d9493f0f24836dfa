"""Which model families NeMo Automodel 0.7.0 (its own environment, transformers 5.18) trains.

Every tiny family goes through the Automodel trainer on one gloo rank, LoRA and full
fine-tuning, 3 SFT steps each, in one process of the Automodel environment
(automodel_families_worker.py; its imports are paid once, ~45 s in all on 2 cores). What is
pinned: every family loads and its loss falls at every step, and Automodel's LoRA adapts the
modules the pytorch trainer does except a MoE layer's experts, which is why
`model_families` refuses an Automodel MoE LoRA that trains the MLP.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from openrld.gpu.tiny_models import FAMILIES, build_tiny_model
from openrld.model_families import FAMILIES as LISTED

REPO = Path(__file__).resolve().parents[2]
AUTOMODEL_PYTHON = REPO / ".venv-automodel" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(), reason=".venv-automodel is not built (make automodel-env)"
)

DENSE = ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]
GATED_DELTANET = ["in_proj_qkv", "in_proj_z", "out_proj"]
# What Automodel's LoRA adapts per family: the pytorch trainer's modules (models.py), but no
# 3-D expert tensors (the MoE families keep attention, lm_head and Qwen3.5-MoE's shared expert).
LORA_MODULES = {
    "llama": DENSE, "qwen2": DENSE, "qwen3": DENSE, "mistral": DENSE, "olmo2": DENSE,
    "phi3": ["down_proj", "gate_up_proj", "lm_head", "o_proj", "qkv_proj"],
    "gemma3": DENSE, "gemma4": DENSE,
    "qwen3_5": sorted(DENSE + GATED_DELTANET),
    "qwen3_moe": ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"],
    "qwen3_5_moe": sorted(DENSE + GATED_DELTANET),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        build_tiny_model(root / family, family)
    worker = Path(__file__).with_name("automodel_families_worker.py")
    done = subprocess.run(
        [str(AUTOMODEL_PYTHON), str(worker), str(root), *FAMILIES], capture_output=True, text=True, cwd=REPO,
        timeout=600, check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(line["family"], line["fine_tuning"]): line for line in lines}


@pytest.mark.parametrize("fine_tuning", ["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_automodel_trains_every_family_with_a_falling_loss(results, family: str, fine_tuning: str) -> None:
    result = results[(family, fine_tuning)]
    assert "error" not in result, result.get("error")
    losses = result["losses"]
    assert losses[2] < losses[1] < losses[0], losses


@pytest.mark.parametrize("family", FAMILIES)
def test_automodel_lora_adapts_the_trainers_modules_but_no_experts(results, family: str) -> None:
    assert results[(family, "lora")]["lora_modules"] == LORA_MODULES[family]


def test_the_families_whose_experts_automodel_lora_misses_are_exactly_the_moe_ones() -> None:
    # model_families refuses an Automodel LoRA that trains the MLP for these; the test above
    # shows their experts are what Automodel's LoRA leaves out.
    assert [f.tiny for f in LISTED if f.has_experts] == ["qwen3_moe", "qwen3_5_moe"]
