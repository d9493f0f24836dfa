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

BATCH, SEQ_LEN, WARMUP, STEPS, RANK, LR = 8, 128, 3, 20, 8, 1e-4


def batch_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(3, 380, size=(BATCH, SEQ_LEN + 1))


def bare_pytorch(model_dir: Path) -> float:
    model = peft.get_peft_model(load_causal_lm(model_dir, torch.device("cpu")), lora_config(LoraSpec(rank=RANK)))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
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
    return statistics.median(times)


def through_api(url: str) -> float:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=RANK, seed=0)
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
    service.close()
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    with tiny_daemon() as (url, model_dir):
        bare = bare_pytorch(model_dir)
        api = through_api(url)
    print(f"batch {BATCH}x{SEQ_LEN} tokens, LoRA rank {RANK}, tiny Llama, median of {STEPS} steps")
    print(f"bare PyTorch step: {bare * 1e3:.2f} ms")
    print(f"API step:          {api * 1e3:.2f} ms")
    print(f"ratio (bare / API, target >= 0.9): {bare / api:.3f}")


if __name__ == "__main__":
    main()
