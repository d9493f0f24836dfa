"""A researcher's RL loop through openrld's default config, as ratios to the loop they would write themselves.

Three figures, on SmolLM2-135M-Instruct (float32, the one real model that installs offline) and
on the tiny Llama:

- SFT step: forward_backward (cross_entropy) and optim_step on 8 sequences x 128 tokens, the two
  submitted together and both results read (lock-step);
- sample: one `sample` of 8 samples x 32 new tokens from a 32-token prompt, temperature 1,
  stop=[] so that every sample runs its 32 tokens, by the LoRA's weights;
- RL iteration: save_weights_and_get_sampling_client, sample 8 x 32, then an importance-sampling
  forward_backward on the 8 sequences with their sampling logprobs and optim_step. The API side
  first runs as many iterations as its sampler holds versions, so that the figure is a long
  run's (each new version then takes the oldest one's adapter), not its first few iterations'.

openrld: `openrld serve` with its default config (no config but its data dir, device and
models), driven by the real SDK in a process of its own (bench/_sdk_loop.py). Baseline: the same
work as a researcher writes it, bench/_bare_loop.py, in a process of its own that never imports
openrld, with transformers' and torch's defaults (its own thread count and wait policy): one peft
LoRA model (rank 8, the same targets) that trains and samples with HF `generate` (do_sample,
top_k=0, with its scores for the sampling logprobs), the loss in fp32 and torch.optim.AdamW.
Rounds alternate, openrld then the baseline, per figure; each round's ratio is printed, then
the medians. Printed:

    <model> SFT step 8x128  ratio = bare seconds / API seconds    (target >= 0.95)
    <model> sample 8x32     ratio = bare seconds / API seconds    (target >= 1.5)
    <model> RL iteration    ratio = bare seconds / API seconds    (target >= 1.2)

Run: `.venv/bin/python bench/rl_throughput.py` (about 6 minutes on 2 CPU cores; `--models
tiny-llama` skips SmolLM2, `--rounds N` sets the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, daemon, vocab_size

from openrld.actors.sampler import MAX_LOADED_VERSIONS

SFT_ROWS, SFT_TOKENS = 8, 128
SAMPLES, NEW_TOKENS = 8, 32  # _bare_loop.py's and _sdk_loop.py's sample
SFT = dict(op="sft_steps", rows=SFT_ROWS, tokens=SFT_TOKENS, count=1)
WORK = (  # (title, target ratio, the API's request, the baseline's request); each answers seconds
    (f"SFT step {SFT_ROWS}x{SFT_TOKENS}", 0.95, dict(SFT, pipelined=False), SFT),
    (f"sample {SAMPLES}x{NEW_TOKENS}", 1.5, dict(op="sample", batch=SAMPLES, new_tokens=NEW_TOKENS, lora=True),
     dict(op="sample")),
    ("RL iteration", 1.2, dict(op="rl_iteration"), dict(op="rl_iteration")),
)


def seconds(answer: float | list[float]) -> float:
    """A request's seconds: sft_steps answers a list of one."""
    return answer[0] if isinstance(answer, list) else answer


def measure(name: str, model_dir: Path, rounds: int) -> None:
    with daemon({name: model_dir}) as url, child("_sdk_loop.py", url, name, vocab_size(model_dir)) as api, \
            child("_bare_loop.py", model_dir) as bare:
        for _, _, ours, theirs in WORK:  # warm-up: first connections, lazy allocations
            api.call(**ours)
            bare.call(**theirs)
        # A long RL run's steady state: past the versions an engine holds (actors/sampler.py), each
        # new version takes the adapter of the oldest instead of a new one.
        api.call("rl_iterations", count=MAX_LOADED_VERSIONS)
        times: dict[tuple[str, str], list[float]] = {}
        for index in range(rounds):
            for title, _, ours, theirs in WORK:
                a, b = seconds(api.call(**ours)), seconds(bare.call(**theirs))
                times.setdefault(("api", title), []).append(a)
                times.setdefault(("bare", title), []).append(b)
                print(f"{name:10s} {title:16s} round {index + 1}: API {a:7.3f} s  bare {b:7.3f} s  ratio {b / a:.2f}",
                      flush=True)
    for title, target, _, _ in WORK:
        b, a = statistics.median(times["bare", title]), statistics.median(times["api", title])
        print(f"{name:10s} {title:16s} medians: API {a:7.3f} s  bare {b:7.3f} s  ratio {b / a:.2f} "
              f"(target >= {target})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2"], choices=["tiny-llama", "smollm2"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.rounds} alternating rounds a figure, openrld then the bare loop", flush=True)
    with bench_models(args.models) as models:
        for name, model_dir in models:
            measure(name, model_dir, args.rounds)


if __name__ == "__main__":
    main()
