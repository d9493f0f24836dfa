"""The sampler's matmuls on the CPU: weights packed for oneDNN against F.linear, and the wait policies.

A decode step of SmolLM2-135M multiplies its rows by 211 weights (30 layers of q, k, v, o, gate,
up and down projections, and the 49,152 x 576 head); with a LoRA, each of them adds B(A x) times
its scaling. This bench runs those shapes (random float32 weights of SmolLM2's sizes, rank 8) in
processes of its own that never import openrld, each with its own environment, and prints ms a
step (the best of 3 repeats of 10 steps):

    linears, torch defaults: rows R  F.linear <ms>  packed <ms>  ratio
        (F.linear: MKL's sgemm, what torch runs; packed: the weights packed once with
        torch.ops.mkldnn._reorder_linear_weight and multiplied by mkldnn._linear_pointwise,
        as openrld/gpu/packed_linear.py does), at 1, 8, 32, 256 and 1,024 rows;
    wait policy <env>: packed linears <ms>, LoRA terms as four calls <ms>, as one addmm <ms>
        at 8 rows, under OMP_WAIT_POLICY=PASSIVE (openrld's setting before) and under
        ACTIVE with GOMP_SPINCOUNT=10000 (openrld's until a Xeon wanted more) and 100000
        (openrld/__init__.py's now).

Run: `.venv/bin/python bench/packed_linear.py` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV, RANK = 576, 1536, 30, 49152, 192, 8  # SmolLM2-135M
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
          (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in) of a layer
POLICIES = ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"},
            {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "100000"})
SCRUBBED = ("OMP_", "GOMP_", "KMP_", "MKL_")


def measure(what: str, rows: int) -> dict[str, float]:
    """In this process: ms a step of each way of doing `what` ("linears" or "policy") at `rows` rows."""
    import time

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    weights = [torch.randn(out, inp) * 0.02 for _ in range(LAYERS) for out, inp in SHAPES] + [torch.randn(VOCAB, HIDDEN) * 0.02]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    loras = [(torch.randn(RANK, w.shape[1]) * 0.02, torch.randn(w.shape[0], RANK) * 0.02) for w in weights]
    inputs = {width: torch.randn(rows, width) for width in (HIDDEN, INTERMEDIATE)}
    outputs = {w.shape[0]: torch.zeros(rows, w.shape[0]) for w in weights}

    def f_linear() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def packed_linear() -> None:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

    def lora_four_calls() -> None:
        for a, b in loras:
            out = outputs[b.shape[0]]
            out += F.linear(F.linear(inputs[a.shape[1]], a), b).mul_(2.0)

    def lora_addmm() -> None:
        for a, b in loras:
            outputs[b.shape[0]].addmm_(F.linear(inputs[a.shape[1]], a), b.t(), alpha=2.0)

    ways = {"F.linear": f_linear, "packed": packed_linear} if what == "linears" else {
        "packed": packed_linear, "lora four calls": lora_four_calls, "lora addmm": lora_addmm}
    best = {}
    for name, step in ways.items():
        step()  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(10):
                step()
            times.append((time.perf_counter() - start) / 10 * 1000)
        best[name] = min(times)
    return best


def in_process_of_its_own(what: str, rows: int, env: dict[str, str]) -> dict[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED)}
    done = subprocess.run([sys.executable, __file__, "--child", what, str(rows)], env={**clean, **env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    for rows in (1, 8, 32, 256, 1024):
        ms = in_process_of_its_own("linears", rows, {})
        print(f"linears, torch defaults: rows {rows:5d}  F.linear {ms['F.linear']:8.2f} ms  packed {ms['packed']:8.2f} ms  "
              f"ratio {ms['F.linear'] / ms['packed']:.2f}", flush=True)
    for env in POLICIES:
        ms = in_process_of_its_own("policy", 8, env)
        label = " ".join(f"{k}={v}" for k, v in env.items())
        print(f"wait policy {label}: packed linears {ms['packed']:.2f} ms, LoRA terms as four calls "
              f"{ms['lora four calls']:.2f} ms, as one addmm {ms['lora addmm']:.2f} ms", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
