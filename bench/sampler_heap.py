"""The daemon's heap under a sampler's load: resident memory with glibc's defaults against openrld's settings.

A TorchSampler on an engine thread (as in the daemon) serves `--rounds` rounds of
16 requests x 4 samples of ~300-token prompts and 48 new tokens, on SmolLM2 (which
`make install` installs). Each setting runs in a process of its own (glibc's
settings are per process): `default` with no MALLOC_* variable and no mallopt, and
`openrld` with `openrld.heap.bound_heap` applied first, as `openrld serve` does. It
prints the resident set after each round and the ratio of the last rounds.

    .venv/bin/python bench/sampler_heap.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def _serve_rounds(bounded: bool, rounds: int) -> None:
    """The child: print one resident size (MB) per round."""
    if bounded:
        from openrld.heap import bound_heap

        bound_heap({})
    import numpy as np
    import torch

    from bench._daemon import smollm2_dir
    from openrld.batches import SampleJob, SamplingSpec
    from openrld.gpu.torch_sampler import TorchSampler

    model = smollm2_dir()
    if model is None:
        raise SystemExit("SmolLM2 is not installed (make install)")

    def run() -> None:
        sampler = TorchSampler(str(model), torch.device("cpu"))
        rng = np.random.default_rng(0)
        for round_ in range(rounds):
            for i in range(16):
                prompt = rng.integers(100, 40000, size=300 + int(rng.integers(0, 60))).astype(np.int64)
                spec = SamplingSpec(max_tokens=48, temperature=0.7, stop_at_eos=False)
                sampler.add(f"r{round_}-{i}", None, SampleJob(prompt, 4, spec))
            while sampler.has_work():
                sampler.step()
            print(_rss_mb(), flush=True)

    thread = threading.Thread(target=run)  # an engine thread, as in the daemon: not glibc's main arena
    thread.start()
    thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--child", choices=("default", "openrld"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _serve_rounds(args.child == "openrld", args.rounds)
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    results = {}
    for setting in ("default", "openrld"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", setting, "--rounds", str(args.rounds)],
            cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, check=True,
        ).stdout
        results[setting] = [int(line) for line in out.split()]
        print(f"{setting:8s} resident MB after each round: {results[setting]}", flush=True)
    print(f"last round, openrld / default: {results['openrld'][-1] / results['default'][-1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
