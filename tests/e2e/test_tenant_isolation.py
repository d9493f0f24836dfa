"""Tenant isolation: two LoRA jobs on one base model train as if each were alone.

Each job is trained twice through the real SDK on one daemon: alone, and at the same
time as the other job (two threads, so their requests interleave in the shared trainer).
The losses, the grad norms and the final adapter tensors must agree within 1e-6: the
jobs share the frozen base model and nothing else.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrld import ids
from openrld.gpu import lora_io

API_KEY = "tml-test"
STEPS = 4
TOLERANCE = 1e-6  # the bound on the CPU; in practice the runs are bit-identical


class Job:
    """What one job is: its LoRA shape, its data and its loss."""

    def __init__(self, rank: int, seed: int, loss_fn: str) -> None:
        self.rank = rank
        self.seed = seed
        self.loss_fn = loss_fn
        rng = np.random.default_rng(seed)
        self.data = [self._datum(rng) for _ in range(3)]

    def _datum(self, rng: np.random.Generator) -> types.Datum:
        tokens = rng.integers(3, 300, size=20).tolist()
        inputs: dict = {"target_tokens": tokens[1:]}
        if self.loss_fn == "importance_sampling":
            inputs["logprobs"] = (-rng.random(19) * 4).astype(np.float32).tolist()
            inputs["advantages"] = rng.normal(size=19).astype(np.float32).tolist()
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


class Outcome:
    def __init__(self, losses: list[float], grad_norms: list[float], tensors: dict[str, torch.Tensor]) -> None:
        self.losses = losses
        self.grad_norms = grad_norms
        self.tensors = tensors


JOBS = (Job(rank=8, seed=0, loss_fn="cross_entropy"), Job(rank=4, seed=1, loss_fn="importance_sampling"))


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def _train(service: tinker.ServiceClient, data_dir: Path, job: Job, name: str) -> Outcome:
    training = service.create_lora_training_client(base_model="tiny-llama", rank=job.rank, seed=job.seed).result()
    losses, grad_norms = [], []
    for step in range(STEPS):
        fb = training.forward_backward(job.data, job.loss_fn)
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2 / (step + 1), weight_decay=0.01))
        losses.append(fb.result().metrics["loss:sum"])
        grad_norms.append(optim.result().metrics["grad_norm:mean"])
    path = ids.parse_tinker_path(training.save_state(name).result().path)
    tensors, _ = lora_io.load_adapter(data_dir / "checkpoints" / path.run_id / path.kind.value / path.name)
    return Outcome(losses, grad_norms, tensors)


def _assert_same(alone: Outcome, together: Outcome) -> None:
    np.testing.assert_allclose(together.losses, alone.losses, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(together.grad_norms, alone.grad_norms, rtol=0, atol=TOLERANCE)
    assert together.tensors.keys() == alone.tensors.keys()
    for key in alone.tensors:
        torch.testing.assert_close(together.tensors[key], alone.tensors[key], rtol=0, atol=TOLERANCE)


def test_two_jobs_training_at_once_end_as_each_trained_alone(service, shared_daemon):
    data_dir = shared_daemon.data_dir
    alone = [_train(service, data_dir, job, f"alone-{i}") for i, job in enumerate(JOBS)]
    with ThreadPoolExecutor(max_workers=len(JOBS)) as pool:
        running = [pool.submit(_train, service, data_dir, job, f"together-{i}") for i, job in enumerate(JOBS)]
        together = [future.result() for future in running]
    for one, other in zip(alone, together):
        _assert_same(one, other)
    # The jobs really trained: their weights moved away from the shared base (B starts at 0).
    for outcome in together:
        assert any(key.endswith("lora_B.weight") and outcome.tensors[key].abs().max() > 0 for key in outcome.tensors)
