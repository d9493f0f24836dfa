"""forward_backward + optim_step through the API, as a ratio to the same step in a bare PyTorch loop.

Both sides train the same LoRA (rank 8, the same target modules and alpha) on
the tiny Llama with the same batch of 8 sequences x 128 tokens, summed
cross-entropy and AdamW. The bare loop runs in this process; the API loop
drives the real SDK against a real daemon on loopback. Printed figure:

    ratio = bare seconds per step / API seconds per step   (1.0 = no overhead; target >= 0.9)

Run: `make bench` or `.venv/bin/python bench/train_step.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import peft
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import tiny_daemon  # noqa: E402

from openrld.batches import LoraSpec  # noqa: E402
from openrld.gpu.models import load_causal_lm, lora_config  # noqa: E402

BATCH, SEQ_LEN, WARMUP, STEPS, RANK, LR = 8, 128, 3, 10, 8, 1e-4
ROUNDS = 3  # bare and API blocks alternate, so drift in this shared machine's speed hits both


def batch_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(3, 380, size=(BATCH, SEQ_LEN + 1))


class BareLoop:
    def __init__(self, model_dir: Path) -> None:
        self.model = peft.get_peft_model(load_causal_lm(model_dir, torch.device("cpu")), lora_config(LoraSpec(rank=RANK)))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def steps(self) -> list[float]:
        return bare_pytorch(self.model, self.optimizer)


def bare_pytorch(model, optimizer) -> list[float]:
    tokens = torch.from_numpy(batch_tokens())
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    for step in range(WARMUP + STEPS):
        start = time.perf_counter()
        logits = model(input_ids=inputs).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss = -logprobs.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


class ApiLoop:
    def __init__(self, url: str) -> None:
        import tinker

        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.training = self.service.create_lora_training_client(base_model="tiny-llama", rank=RANK, seed=0).result()

    def steps(self) -> list[float]:
        return through_api(self.training)

    def close(self) -> None:
        self.service.close("success")


def through_api(training) -> list[float]:
    from tinker import types

    rows = batch_tokens()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].tolist()},
        )
        for row in rows
    ]
    adam = types.AdamParams(learning_rate=LR)
    times = []
    for step in range(WARMUP + STEPS):
        start = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(adam)  # pipelined, as the SDK and the cookbook do
        fb.result()
        opt.result()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    torch.manual_seed(0)
    with tiny_daemon() as (url, model_dir):
        bare_loop, api_loop = BareLoop(model_dir), ApiLoop(url)
        bare_times: list[float] = []
        api_times: list[float] = []
        for _ in range(ROUNDS):
            bare_times += bare_loop.steps()
            api_times += api_loop.steps()
        api_loop.close()
    bare, api = statistics.median(bare_times), statistics.median(api_times)
    print(f"batch {BATCH}x{SEQ_LEN} tokens, LoRA rank {RANK}, tiny Llama, median of {ROUNDS}x{STEPS} steps each")
    print(f"bare PyTorch step: {bare * 1e3:.2f} ms")
    print(f"API step:          {api * 1e3:.2f} ms")
    print(f"ratio (bare / API, target >= 0.9): {bare / api:.3f}")


if __name__ == "__main__":
    main()
