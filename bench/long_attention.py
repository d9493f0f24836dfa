"""Sliding-window attention in training: openrld's windowed attention against transformers' sdpa.

A Gemma 3 model's sliding-window layers get, from transformers' sdpa path, a dense
(tokens x tokens) mask and full tokens^2 attention once a datum reaches the window; openrld's
trainers switch such models to `openrld/gpu/long_attention.py`, which attends over each window
in query blocks. For each length, one forward+backward of the same 4-layer Gemma 3 (width 256,
window 512, `bench/_window_model.py`), each side in a fresh process of its own:
- baseline: `bench/_hf_window_step.py`, transformers' defaults, never imports openrld;
- openrld: this file as `--child`, the model switched with `use_long_attention`, as the trainers do.
Printed: seconds and the peak RSS the step added (MiB), each side, and their ratios; `--padded`
adds a right-padded batch of two rows (the second half padding) at each length.

Run: `.venv/bin/python bench/long_attention.py` (4,096 and 16,384 tokens: about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _daemon import clean_env  # noqa: E402


def run(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=clean_env(os.environ), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(tokens: int, padded: bool) -> None:
    from _window_model import step_report, window_model

    from openrld.gpu.long_attention import use_long_attention

    model = window_model()
    if not use_long_attention(model):
        raise RuntimeError("the bench's model was not switched to windowed attention")
    print(step_report(model, tokens, padded), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--padded", action="store_true", help="also a right-padded batch of two rows")
    parser.add_argument("--child", nargs=2, metavar=("TOKENS", "PADDED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1] == "padded")
        return
    print(f"{'tokens':>7} {'rows':>4}  {'sdpa s':>8} {'sdpa MiB':>9}  {'openrld s':>9} {'openrld MiB':>11}  {'time x':>6} {'memory x':>8}")
    for tokens in args.lengths:
        for padded in (False, True) if args.padded else (False,):
            flag = ["padded"] if padded else []
            base = run([str(HERE / "_hf_window_step.py"), str(tokens), *flag])
            ours = run([str(HERE / "long_attention.py"), "--child", str(tokens), "padded" if padded else "whole"])
            print(
                f"{tokens:>7} {base['rows']:>4}  {base['seconds']:>8.2f} {base['added_mb']:>9}  "
                f"{ours['seconds']:>9.2f} {ours['added_mb']:>11}  {base['seconds'] / ours['seconds']:>6.2f} "
                f"{base['added_mb'] / max(1, ours['added_mb']):>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
