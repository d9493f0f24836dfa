"""The torch sampler at long context: one long prompt's peak RSS and prefill time, 1k to 32k tokens.

For each prompt length, a fresh process (so each peak is that length's alone) loads the
tiny Llama rebuilt with 32,768 positions into `TorchSampler` on the CPU, samples one
request (8 new tokens, temperature 1, seed 0) and prints:
- load_mb: VmHWM after the sampler is built (the weights, torch itself);
- peak_mb: VmHWM after the request, and peak - load, what the request itself added;
- prefill_s: the first `step()` (the prefill and the first decode step);
- decode_ms: the mean of the remaining 7 decode steps.
Each length runs with the sampler's default prefill chunk and with `--whole` once
more with the chunk as long as the prompt (one forward over it, as before chunking);
`--prompt-logprobs` asks for every prompt position's logprob as well. `--hf` adds
Hugging Face `generate` of one token over the same prompt (its prefill, one forward;
bench/_hf_long_prefill.py, a process of its own that never imports openrld).
`--model-dir` runs another model (Gemma 3 270M from bench/_daemon.py's cache, say),
and `--windowed-prefill-tokens` sets the sampler's bound for windowed prefills.

Run: `.venv/bin/python bench/long_prompt_sampling.py` (`--lengths 8192 32760 --whole --hf`
for the comparison; 2 cores take a few minutes at 32k).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import tiny_llama_32k

HERE = Path(__file__).resolve().parent
LENGTHS = (1024, 8192, 16384, 32760)  # 32,760: the longest prompt that leaves 8 new tokens in 32,768
NEW_TOKENS = 8


def vm_hwm_mb() -> float:
    """This process's peak resident set (VmHWM), MiB: torch's allocations never reach tracemalloc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def prompt_of(length: int) -> list[int]:
    return [(7 * i + 1) % 300 + 3 for i in range(length)]


def child(model_dir: str, length: int, options: dict[str, int], prompt_logprobs: bool) -> None:
    """One length in this process; prints one JSON line."""
    import numpy as np
    import torch

    from openrld.batches import SampleJob, SamplingSpec
    from openrld.gpu.torch_sampler import TorchSampler

    torch.set_num_threads(2)
    sampler = TorchSampler(model_dir, torch.device("cpu"), **options)
    load_mb = vm_hwm_mb()
    params = SamplingSpec(max_tokens=NEW_TOKENS, seed=0, stop_at_eos=False)
    job = SampleJob(
        prompt=np.asarray(prompt_of(length), dtype=np.int64), num_samples=1, params=params,
        prompt_logprobs=prompt_logprobs,
    )
    sampler.add("long", None, job)
    start = time.perf_counter()
    done = sampler.step()
    prefill_s = time.perf_counter() - start
    steps = 0
    start = time.perf_counter()
    while not done:
        done = sampler.step()
        steps += 1
    decode_ms = 1000 * (time.perf_counter() - start) / max(steps, 1)
    peak_mb = vm_hwm_mb()
    print(json.dumps({
        "length": length, "load_mb": round(load_mb), "peak_mb": round(peak_mb),
        "request_mb": round(peak_mb - load_mb), "prefill_s": round(prefill_s, 2), "decode_ms": round(decode_ms, 1),
        "tokens": len(done[0].result.sequences[0].tokens),
    }), flush=True)


def run_child(args: list[str]) -> dict:
    out = subprocess.run(args, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--whole", action="store_true", help="also prefill each prompt as one chunk")
    parser.add_argument("--prompt-logprobs", action="store_true", help="score every prompt position too")
    parser.add_argument("--hf", action="store_true", help="also Hugging Face generate, in its own process")
    parser.add_argument("--model-dir", help="a model directory instead of the tiny 32k Llama")
    parser.add_argument(
        "--windowed-prefill-tokens", type=int, help="the sampler's bound for windowed prefills (sliding-window models)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model_dir = args.model_dir or str(tiny_llama_32k(Path(root)))
        flags = ["--prompt-logprobs"] if args.prompt_logprobs else []
        if args.windowed_prefill_tokens is not None:
            flags += ["--windowed_prefill_tokens", str(args.windowed_prefill_tokens)]
        print(f"model {model_dir}, {NEW_TOKENS} new tokens, prompt_logprobs={args.prompt_logprobs}")
        header = f"{'length':>7} {'way':>13} {'load MiB':>9} {'peak MiB':>9} {'request MiB':>12} {'prefill s':>10} {'decode ms':>10}"
        print(header)
        for length in args.lengths:
            ways = [("chunked", [])] + ([("whole", ["--prefill_chunk_tokens", str(length)])] if args.whole else [])
            for way, extra in ways:
                row = run_child([sys.executable, __file__, "--child", model_dir, str(length), *extra, *flags])
                print_row(length, way, row)
            if args.hf:
                hf = [sys.executable, str(HERE / "_hf_long_prefill.py"), model_dir, str(length)]
                print_row(length, "hf generate", run_child(hf))


def print_row(length: int, way: str, row: dict) -> None:
    if "error" in row:
        print(f"{length:>7} {way:>13}  failed: {row['error']}", flush=True)
        return
    decode = row.get("decode_ms", float("nan"))  # the HF baseline times its prefill only
    print(
        f"{length:>7} {way:>13} {row['load_mb']:>9} {row['peak_mb']:>9} {row['request_mb']:>12}"
        f" {row['prefill_s']:>10.2f} {decode:>10.1f}",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        rest = sys.argv[2:]
        # Sampler options travel as --name value pairs, named as TorchSampler's arguments.
        names = ("prefill_chunk_tokens", "windowed_prefill_tokens")
        options = {name: int(rest[rest.index(f"--{name}") + 1]) for name in names if f"--{name}" in rest}
        child(rest[0], int(rest[1]), options, "--prompt-logprobs" in rest)
    else:
        main()
