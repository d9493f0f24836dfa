"""bench/gpu_check.py, the device check: it runs where there is no GPU (every check SKIPs), and
its lines say PASS only for a requirement met, MEASURE for a figure with none.

The checks themselves need CUDA (and vLLM for vllm.*); the README's "Device check" says how
a device run goes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
CHECKS = [
    "offload.trainer_round_trip", "offload.training_across_park", "offload.sampler_round_trip", "offload.throughput",
    "sampler.torch_logprobs", "worker.cuda_trainer", "full.trainer_bf16", "worker.cuda_full_trainer", "delta.sync_10",
    "timeslicer.two_jobs", "worker.launcher_measurement", "vllm.base_logprobs", "vllm.temperature_logprobs",
    "vllm.refusal_is_a_400", "vllm.lora_version", "vllm.sleep_wake", "vllm.full_sync",
]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_every_check_skips_on_a_line_of_its_own_and_the_run_passes() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "MEASURE", "FAIL", "SKIP")]
    assert lines == [f"SKIP {name}: no CUDA device here" for name in CHECKS]
    assert (done.stdout.splitlines()[-1], done.returncode) == ("OK: 0 check(s) failed", 0)


def test_a_measurement_prints_measure_and_a_checked_requirement_pass(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    report = gpu_check.Report()
    report.run("a.figure", lambda: "3.0 steps/s", measure=True)
    report.run("a.requirement", lambda: "within 1e-5")
    out = [line.rsplit(" (", 1)[0] for line in capsys.readouterr().out.splitlines()]
    assert out == ["MEASURE a.figure: 3.0 steps/s", "PASS a.requirement: within 1e-5"]
    assert report.failed == 0


def test_a_requirement_that_does_not_hold_is_a_fail_and_counts(gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    report = gpu_check.Report()

    def check() -> str:
        gpu_check.require(0.4 >= 0.5, "park 0.4 GB/s < 0.5 x a bare pinned copy's 1.0")
        return "unreachable"

    report.run("offload.throughput", check)
    assert capsys.readouterr().out.splitlines()[0] == (
        "FAIL offload.throughput: AssertionError: park 0.4 GB/s < 0.5 x a bare pinned copy's 1.0"
    )
    assert report.failed == 1



def test_a_prefix_selects_the_checks_that_run_and_the_others_skip_as_not_selected(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A GPU is the edge: claim one, and select nothing that would touch it.
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda: "a claimed GPU")
    assert gpu_check.main(["no.such.check"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SKIP ")]
    vllm = "vllm is not installed here" if importlib.util.find_spec("vllm") is None else "not selected"
    assert lines == [f"SKIP {name}: {'not selected' if not name.startswith('vllm.') else vllm}" for name in CHECKS]
