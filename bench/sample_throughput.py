"""Sampling throughput through the API, as ratios to Hugging Face `generate` and to one client.

On the tiny Llama and on SmolLM2-135M-Instruct, every sample generates exactly NEW_TOKENS tokens
(stop=[], so no EOS ends one early) from a 32-token prompt at temperature 1:

- baseline: `model.generate(do_sample=True, min_new_tokens=max_new_tokens=NEW_TOKENS)` with the KV
  cache, batch 1 and batch 8 (the prompt repeated), as a researcher runs it: bench/_hf_generate.py
  in a process of its own that never imports openrld, with transformers' and torch's defaults
  (the checkpoint's dtype, torch's own threads and wait policy);
- API: `openrld serve` with its default config, and the real SDK in a process of its own
  (bench/_sdk_loop.py): one `sample` call with num_samples = 1 or 8 (the engine prefills the
  prompt once and decodes the 8 together);
- concurrency: 4 SDK clients (threads of that process, one ServiceClient each) each sampling
  batch 1 REPEATS times at once, against 1 client doing the same alone.

Rounds alternate: API, then baseline, then the clients; each round's ratios are printed, then
the medians. One round of the tiny model is short (a 4-client burst is ~0.2 s) and this shared
machine's speed swings by up to 2x from one burst to the next, hence its 15 rounds. Printed:

    batch 1 ratio      = API tokens/s / HF tokens/s at batch 1    (target >= 1.0)
    batch 8 ratio      = API tokens/s / HF tokens/s at batch 8    (target >= 1.5)
    concurrency ratio  = total tokens/s of 4 clients / 1 client   (target >= 2.5)

Run: `.venv/bin/python bench/sample_throughput.py` (`--models tiny-llama` for the tiny model alone,
`--rounds N` for N rounds of each model).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, daemon, vocab_size
from _workload import PROMPT_TOKENS, prompt

NEW_TOKENS, REPEATS, CLIENTS = 64, 3, 4
ROUNDS = {"tiny-llama": 15, "smollm2": 3}
TARGETS = {"batch 1": 1.0, "batch 8": 1.5, "clients": 2.5}


def measure(name: str, model_dir: Path, rounds: int) -> None:
    vocab = vocab_size(model_dir)
    ids = prompt(vocab)
    with daemon({name: model_dir}) as url, child("_sdk_loop.py", url, name, vocab) as sdk, \
            child("_hf_generate.py", model_dir) as hf:

        def api(batch: int) -> float:
            return batch * NEW_TOKENS / sdk.call("sample", batch=batch, new_tokens=NEW_TOKENS, lora=False)

        def baseline(batch: int) -> float:
            return hf.call(prompt=ids, batch=batch, new_tokens=NEW_TOKENS)["tokens_per_s"]

        api(1)  # warm-up: model load, first connections
        baseline(1)
        ratios: dict[str, list[float]] = {key: [] for key in TARGETS}
        for index in range(rounds):
            line = []
            for batch in (1, 8):
                ours, theirs = api(batch), baseline(batch)
                ratios[f"batch {batch}"].append(ours / theirs)
                line.append(f"batch {batch}: API {ours:7.1f} tok/s, HF {theirs:7.1f} tok/s, {ours / theirs:.2f}")
            one = sdk.call("clients", clients=1, repeats=REPEATS, new_tokens=NEW_TOKENS)
            many = sdk.call("clients", clients=CLIENTS, repeats=REPEATS, new_tokens=NEW_TOKENS)
            ratios["clients"].append(many / one)
            line.append(f"{CLIENTS} clients {many:7.1f} tok/s, 1 client {one:7.1f} tok/s, {many / one:.2f}")
            print(f"{name:10s} round {index + 1}: " + "; ".join(line), flush=True)
    for key, target in TARGETS.items():
        print(f"{name:10s} {key:8s} median ratio {statistics.median(ratios[key]):.2f} (target >= {target}), "
              f"rounds {min(ratios[key]):.2f} to {max(ratios[key]):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ROUNDS), choices=list(ROUNDS))
    parser.add_argument("--rounds", type=int, help="rounds of each model (default: 15 tiny-llama, 3 smollm2)")
    args = parser.parse_args()
    print(f"prompt {PROMPT_TOKENS} tokens, {NEW_TOKENS} new tokens per sample; "
          f"ratios: API/HF generate at batch 1 and 8, {CLIENTS} clients / 1 client", flush=True)
    with bench_models(args.models) as models:
        for name, model_dir in models:
            measure(name, model_dir, args.rounds or ROUNDS[name])


if __name__ == "__main__":
    main()
