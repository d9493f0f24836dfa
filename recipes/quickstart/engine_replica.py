"""The quickstart's loop run in-process on openrld's engines, for sweeping its hyperparameters fast.

Same task (`task.py`), sampler and trainer engines, loss and datum layout as
`train.py`, without the daemon and the SDK in between, so that several
settings can run side by side on one machine's cores (`taskset`). The README's
curve came from this with lr 5e-4, group 8, 4 problems, 10 tokens:

    python -m recipes.quickstart.engine_replica MODEL_DIR --learning-rate 5e-4 --out replica.jsonl

MODEL_DIR is a Hugging Face directory (the GGUF's conversion under a node's
`<data_dir>/models/gguf/`). Each line of the output is one step's record.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu.scoring import TrainerConfig
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer
from recipes.quickstart import task

ADAPTER = "quickstart"


def _datum(prompt: list[int], reply: list[int], logprobs: np.ndarray, advantage: float) -> TrainDatum:
    tokens = np.array(prompt + reply, np.int64)
    n_targets, n_prompt_targets = len(tokens) - 1, len(prompt) - 1
    sampled = np.zeros(n_targets, np.float32)
    sampled[n_prompt_targets:] = logprobs
    advantages = np.zeros(n_targets, np.float32)
    advantages[n_prompt_targets:] = advantage
    return TrainDatum(
        tokens=tokens[:-1], inputs={"target_tokens": tokens[1:], "logprobs": sampled, "advantages": advantages}
    )


def run(args: argparse.Namespace) -> None:
    cpu = torch.device("cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    sampler = TorchSampler(args.model_dir, cpu)
    trainer = TorchTrainer(args.model_dir, cpu, config=TrainerConfig(max_batch_tokens=8192))
    spec = LoraSpec(rank=args.lora_rank, seed=0)
    trainer.add_adapter(ADAPTER, spec)
    eos = int(tokenizer.eos_token_id)
    rng = random.Random(0)
    started = time.perf_counter()
    with open(args.out, "w") as log:
        for step in range(args.steps):
            version = f"v{step}"
            sampler.load_version(version, trainer.sampler_payload(ADAPTER, version), spec)
            if step:
                sampler.drop_version(f"v{step - 1}")
            problems = task.make_problems(rng, args.problems_per_step)
            messages = [[{"role": "user", "content": p.question}] for p in problems]
            prompts = [
                list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"])
                for m in messages
            ]
            params = SamplingSpec(max_tokens=args.max_tokens, temperature=1.0, seed=step, stop_token_ids=(eos,))
            for i, prompt in enumerate(prompts):
                job = SampleJob(prompt=np.array(prompt, np.int64), num_samples=args.group_size, params=params)
                sampler.add(f"{step}-{i}", version, job)
            results = {}
            while sampler.has_work():
                results.update((f.request_id, f.result) for f in sampler.step())
            data, rewards, lengths = [], [], []
            for i, (problem, prompt) in enumerate(zip(problems, prompts)):
                sequences = results[f"{step}-{i}"].sequences
                replies = [
                    tokenizer.decode([t for t in s.tokens.tolist() if t != eos], skip_special_tokens=True)
                    for s in sequences
                ]
                group_rewards = [task.reward(problem, reply) for reply in replies]
                rewards += group_rewards
                lengths += [len(s.tokens) for s in sequences]
                advantages = task.group_advantages(group_rewards)
                if any(a != 0.0 for a in advantages):
                    data += [_datum(prompt, s.tokens.tolist(), s.logprobs, a) for s, a in zip(sequences, advantages)]
            if data:
                batch = ForwardBackwardBatch(
                    data=data, loss_fn="importance_sampling", loss_config={}, forward_only=False
                )
                trainer.forward_backward(ADAPTER, batch)
                trainer.optim_step(ADAPTER, AdamParams(learning_rate=args.learning_rate))
            record = {
                "step": step, "mean_reward": sum(rewards) / len(rewards),
                "full_marks_fraction": sum(r == task.EXACT_REWARD for r in rewards) / len(rewards),
                "mean_reply_tokens": sum(lengths) / len(lengths), "elapsed_s": time.perf_counter() - started,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.quickstart.engine_replica")
    parser.add_argument("model_dir")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("replica.jsonl"))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
