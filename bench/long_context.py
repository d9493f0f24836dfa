"""Long context on one device: one datum's SFT step time and peak memory, 1k to 32k tokens.

For each model and length, one LoRA (rank 8) SFT step on one datum of that many tokens,
two ways, in processes of their own:
- openrld: a daemon with its default config (activation checkpointing chosen by the
  work's size, chunked log-softmax) and the real tinker SDK as its client
  (bench/_sdk_long_steps.py); the daemon's peak RSS is reset before each length, so each
  figure is that length's alone (it holds the trainer's and the sampler's weights);
- bare: the loop a researcher writes with transformers and peft, torch's defaults, one
  fresh process a length (bench/_bare_long_step.py): full logits, no checkpointing. It
  runs only up to --bare-max-tokens, past which it does not fit this machine.
Each is the second of two steps (openrld's first with `--steps 1`, for a length too slow
for two). Printed: seconds a step and per 1k tokens, peak RSS, and the openrld step's time
per token relative to its own at 4k (target: at most 2x at the longest length), and
bare / openrld step time where both ran.

Models: the tiny Llama rebuilt with 32,768 positions (1k to 32k), SmolLM2-135M-Instruct
(1k to its 8,192; target: within 4 GB of daemon RSS at 8,192), and with --gemma3 the
Gemma 3 270M checkpoint (to 32,768; target: within 10 GB), when installed.

Run: `.venv/bin/python bench/long_context.py` (`--models smollm2 --lengths 1024 8192` for
part of it; SmolLM2's lengths take about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import daemon, gemma3_dir, smollm2_dir, tiny_llama_32k

HERE = Path(__file__).resolve().parent
LENGTHS = (1024, 4096, 8192, 16384, 32768)


def daemon_pid() -> int:
    """The `openrld serve` child of this process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"serve" in cmdline:
            return int(entry.name)
    raise RuntimeError("no daemon child found")


def run_openrld(name: str, directory: Path, vocab: int, lengths: list[int], steps: int) -> dict[int, dict]:
    results = {}
    with daemon({name: directory}) as url:
        client = [sys.executable, str(HERE / "_sdk_long_steps.py"), url, name, str(daemon_pid()), str(vocab), str(steps)]
        process = subprocess.run(client + [str(n) for n in lengths], capture_output=True, text=True, check=False)
        for line in process.stdout.splitlines():
            row = json.loads(line)
            results[row["tokens"]] = row
        if process.returncode != 0:
            print(f"  the client stopped: {process.stderr.strip().splitlines()[-1:]}")
    return results


def run_bare(directory: Path, tokens: int) -> dict | None:
    process = subprocess.run(
        [sys.executable, str(HERE / "_bare_long_step.py"), str(directory), str(tokens)],
        capture_output=True, text=True, check=False,
    )
    if process.returncode != 0:
        return None
    return json.loads(process.stdout.strip().splitlines()[-1])


def report(name: str, directory: Path, lengths: list[int], bare_max: int, steps: int) -> None:
    config = json.loads((directory / "config.json").read_text())
    context = config.get("max_position_embeddings", 2048)
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    lengths = [n for n in lengths if n <= context]
    print(f"\n{name} (context {context}, vocab {vocab})")
    ours = run_openrld(name, directory, vocab, lengths, steps)
    print(f"{'tokens':>7} {'openrld s':>10} {'s/1k tok':>9} {'vs 4k':>6} {'peak GB':>8} {'bare s':>8} {'bare GB':>8} {'bare/ours':>9}")
    at_4k = ours.get(4096, {}).get("step_s")
    for tokens in lengths:
        row = ours.get(tokens)
        bare = run_bare(directory, tokens) if tokens <= bare_max else None
        step = f"{row['step_s']:10.2f}" if row else f"{'-':>10}"
        per_k = f"{row['step_s'] / tokens * 1024:9.2f}" if row else f"{'-':>9}"
        versus = f"{row['step_s'] / tokens / (at_4k / 4096):6.2f}" if row and at_4k else f"{'-':>6}"
        peak = f"{row['peak_bytes'] / 1e9:8.2f}" if row else f"{'-':>8}"
        bare_s = f"{bare['step_s']:8.2f}" if bare else f"{'-':>8}"
        bare_gb = f"{bare['peak_bytes'] / 1e9:8.2f}" if bare else f"{'-':>8}"
        ratio = f"{bare['step_s'] / row['step_s']:9.2f}" if bare and row else f"{'-':>9}"
        print(f"{tokens:>7} {step} {per_k} {versus} {peak} {bare_s} {bare_gb} {ratio}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2", "gemma3"])
    parser.add_argument("--gemma3", action="store_true", help="also the Gemma 3 270M checkpoint")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--bare-max-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="openrld steps a length; the last is timed")
    args = parser.parse_args()
    models = list(args.models) + (["gemma3"] if args.gemma3 and "gemma3" not in args.models else [])
    with tempfile.TemporaryDirectory(prefix="openrld-long-") as tmp:
        for model in models:
            if model == "tiny":
                directory = tiny_llama_32k(Path(tmp))
            else:
                directory = smollm2_dir() if model == "smollm2" else gemma3_dir()
                if directory is None:
                    print(f"\n{model}: not installed; skipped")
                    continue
            report(model, directory, args.lengths, args.bare_max_tokens, args.steps)


if __name__ == "__main__":
    main()
