#!/usr/bin/env bash
# bench/gpu_check.py on the GPU test machine: one H100 or H200, Python 3.12, torch 2.11.0,
# transformers 5.17.0, peft, no vLLM and no package index (so every vllm.* check SKIPs).
# One line per check with its measured figure: PASS, MEASURE (a figure with no requirement),
# FAIL or SKIP; exit status 1 when a check failed (124 when the time limit cut it short).
#
# What that machine lacks travels with the tree as wheels in .whl/ (about 20 MiB of the
# 64 MiB a call may carry): msgspec, trio and its outcome and sniffio, zstandard, and
# transformers 5.24.0, the version openrld pins (5.17's cache handling fails in
# gpu/kv_batch.py). Its own huggingface_hub 1.33, tokenizers 0.23.2 and safetensors 0.8.0
# satisfy transformers 5.24.0.
#
#   here, once:   bench/gpu_check.sh prepare          (downloads the wheels into .whl/, ignored by git)
#   there:        bench/gpu_check.sh                  (carry [".whl"]; timeout_s 540 leaves a rerun's worth)
#
# The checks take about five minutes there; the run stops itself at GPU_CHECK_TIMEOUT_S
# (450 s by default) so that its output comes back inside the 8 minutes a task is given.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(msgspec==0.23.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 zstandard==0.25.0 transformers==5.24.0)

if [ "${1:-}" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    du -sh .whl
    exit 0
fi

SITE=/tmp/openrld-site
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
# The workers the checks start inherit this environment, so they import the same packages.
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
exec timeout "${GPU_CHECK_TIMEOUT_S:-450}" python3 bench/gpu_check.py "$@"
