"""TorchTrainer.forward_backward_many: several requests of one adapter in one pass.

The combined pass must give each request exactly what it would get alone (its lp, its
metrics) and add the sum of their gradients. The two paths differ only in float32
reduction order (other micro-batch shapes, other summation order of the gradients of
~50 positions, each of order 1): a few ulps, so rtol 1e-5 with atol 1e-6 for gradients,
and atol 1e-5 for lp as in test_torch_trainer.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

CPU = torch.device("cpu")
# Micro-batches of at most 40 padded tokens: the requests below straddle several of them.
SMALL = TrainerConfig(max_batch_tokens=40, logprob_chunk_positions=9)
SPEC = LoraSpec(rank=4, seed=3)
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-5
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def trainer(tiny_llama: Path) -> TorchTrainer:
    return TorchTrainer(tiny_llama, CPU, config=SMALL)


@pytest.fixture
def adapter(trainer: TorchTrainer):
    trainer.add_adapter("a", SPEC)
    yield "a"
    trainer.drop_adapter("a")


def _datum(rng: np.random.Generator, n: int, **extra: np.ndarray) -> TrainDatum:
    tokens = rng.integers(3, 300, size=n + 1)
    return TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:], **extra})


def _requests() -> list[ForwardBackwardBatch]:
    """Three requests with different losses and lengths, as one job would pipeline them."""
    rng = np.random.default_rng(0)
    ce = [_datum(rng, n, weights=rng.normal(size=n).astype(np.float32)) for n in (12, 5)]
    rl = []
    for n in (9, 14, 3):
        rl.append(
            _datum(
                rng, n, logprobs=(-rng.random(n) * 3).astype(np.float32),
                advantages=rng.normal(size=n).astype(np.float32),
            )
        )
    return [
        ForwardBackwardBatch(data=ce, loss_fn="cross_entropy", loss_config={}, forward_only=False),
        ForwardBackwardBatch(data=rl[:2], loss_fn="ppo", loss_config={}, forward_only=False),
        ForwardBackwardBatch(data=rl[2:], loss_fn="dro", loss_config={"beta": 0.1}, forward_only=False),
    ]


def test_combined_pass_gives_each_request_what_it_gets_alone(trainer, adapter):
    requests = _requests()
    alone = [trainer.forward_backward(adapter, r) for r in requests]
    alone_grads = trainer.adapter_gradients(adapter)
    trainer.optim_step(adapter, _zero_lr())  # clears the gradients, moves nothing
    combined = trainer.forward_backward_many(adapter, requests)
    combined_grads = trainer.adapter_gradients(adapter)
    for one, many in zip(alone, combined):
        assert one.metrics.keys() == many.metrics.keys()
        for key in one.metrics:
            assert many.metrics[key] == pytest.approx(one.metrics[key], rel=1e-6, abs=1e-6), key
        for lp_one, lp_many in zip(one.logprobs, many.logprobs):
            assert lp_one.shape == lp_many.shape
            np.testing.assert_allclose(lp_many, lp_one, atol=LOGPROB_ATOL, rtol=0)
    assert alone_grads.keys() == combined_grads.keys()
    for key in alone_grads:
        torch.testing.assert_close(combined_grads[key], alone_grads[key], atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_a_failing_request_makes_the_combined_pass_add_nothing(trainer, adapter):
    requests = _requests()
    trainer.forward_backward(adapter, requests[0])
    before = trainer.adapter_gradients(adapter)
    # An advantage of 100 at a position where lp - logprobs is large overflows exp: a non-finite loss.
    bad_datum = requests[1].data[0]
    huge = dict(bad_datum.inputs, logprobs=np.full_like(bad_datum.inputs["logprobs"], -100.0))
    bad = ForwardBackwardBatch(
        data=[TrainDatum(tokens=bad_datum.tokens, inputs=huge)], loss_fn="importance_sampling",
        loss_config={}, forward_only=False,
    )
    with pytest.raises(BadRequest, match="not finite"):
        trainer.forward_backward_many(adapter, [requests[0], bad])
    after = trainer.adapter_gradients(adapter)
    for key in before:
        assert torch.equal(after[key], before[key]), key


def _zero_lr() -> AdamParams:
    return AdamParams(learning_rate=0.0)


def test_activation_checkpointing_gives_the_same_lp_and_gradients(tiny_llama: Path):
    requests = _requests()
    outcomes = []
    for checkpointing in (False, True):
        # A byte's budget checkpoints every micro-batch; the micro-batch budget keeps the datums together.
        config = TrainerConfig(max_batch_tokens=40, activation_checkpointing=checkpointing, activation_budget_bytes=1,
                               micro_batch_budget_bytes=2**40)
        engine = TorchTrainer(tiny_llama, CPU, config=config)
        engine.add_adapter("a", SPEC)
        engine._passes.scorer.step_bytes(1)  # its first use measures the model (probe forwards and backwards)
        # Runs of the first layer's first module: a checkpointed layer runs again in backward.
        runs: list[int] = []
        first_layer = engine._model.get_decoder().layers[0]
        first_layer.input_layernorm.register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        results = engine.forward_backward_many("a", requests[:1])
        outcomes.append((results, engine.adapter_gradients("a"), len(runs)))
    (plain, plain_grads, plain_runs), (checkpointed, checkpointed_grads, checkpointed_runs) = outcomes
    micro_batches = 1  # requests[0]: datums of 12 and 5 tokens, padded to 2 × 12 = 24 <= 40
    assert (plain_runs, checkpointed_runs) == (micro_batches, 2 * micro_batches)
    for one, other in zip(plain, checkpointed):
        assert other.metrics == pytest.approx(one.metrics, rel=1e-6, abs=1e-6)
    # The recomputation repeats the same kernels on the same inputs: identical up to rounding.
    for key in plain_grads:
        torch.testing.assert_close(checkpointed_grads[key], plain_grads[key], atol=GRAD_ATOL, rtol=GRAD_RTOL)
