"""Context parallelism in the Automodel trainer (gpu/automodel_cp.py): a torchrun group of 2 CPU
ranks (gloo) with openrl.trainer_cp = 2, one cp group of two (dp = 1), through `RemoteTrainer` and
the real worker protocol, as tests/gpu/test_automodel_trainer.py drives the dp = 2 group.

What is checked, against a one-process run of the single-device trainers from the same start:
- LoRA parity: over 4 steps of every built-in loss (7 requests of 3 datums each; at step 1 a
  request whose loss is not finite, which must add nothing), the losses, metrics,
  log-probabilities and final weights agree within 1e-5, each micro-batch's datums packed into
  one sequence cut in two;
- a datum longer than max_batch_tokens but within it per rank (40 tokens, budget 24 per rank)
  trains in one pack split over the two ranks, with the one-process values;
- dp = 2 × cp = 2 on 4 ranks: 2 LoRA steps as one process (the cp groups take turns by
  micro-batch; one runs the empty pass while the other scores), with every round's layers
  checkpointed (a budget of 1 byte), so each backward recomputes attention under its pack's
  CP context;
- full fine-tuning parity over 3 steps (FullTrainer);
- the planner: the budget bounds each rank's part of a pack;
- a cp that does not divide the group is refused naming trainer_cp.

Without `.venv-automodel` (make automodel-env) the group tests are skipped. Group starts cost
~20 s on 2 cores: the 2-rank LoRA tests share one group.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from openrld.batches import ForwardBackwardBatch, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu.automodel_cp import plan_packed_micro_batches
from openrld.worker.client import RemoteTrainer
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.torchrun import TorchrunLauncher
from openrld.worker.protocol import Start
from openrld.worker.values import local_payload
from tests.gpu.test_automodel_trainer import (
    ADAM,
    ATOL,
    AUTOMODEL_PYTHON,
    MAX_BATCH_TOKENS,
    SPEC,
    TIMEOUTS,
    assert_runs_agree,
    max_weight_difference,
    single,
    train,
)

needs_automodel = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(),
    reason=".venv-automodel is not built (make automodel-env): the Automodel trainer runs only in its own environment",
)
CP = 2
LORA_STEPS = 4  # includes train()'s poisoned step 1
EARLY_STEPS = 2  # what the 4-rank group trains
FULL_STEPS = 3
LONG = 40  # tokens: over MAX_BATCH_TOKENS (24) on one rank, within it per rank with cp = 2


def cp_group(
    directory: Path, model: Path, fine_tuning: str, cp: int = CP, ranks: int = 2, activation_budget_bytes: int = 0
) -> tuple[RemoteTrainer, dict]:
    """A group of `ranks` with openrl.trainer_cp = `cp`, and the facts its Ready reported."""
    options = {
        "fine_tuning": fine_tuning, "max_batch_tokens": MAX_BATCH_TOKENS, "weight_sync": "delta", "cp": cp,
        "activation_budget_bytes": activation_budget_bytes,
    }
    engine_start = Start("automodel_trainer", str(model), "cpu", threads=1, options=options)
    spec = WorkerSpec(name=engine_start.kind, role="trainer", start=engine_start)
    connection, ready = start_worker(TorchrunLauncher(str(AUTOMODEL_PYTHON), ranks), spec, directory, timeouts=TIMEOUTS)
    return RemoteTrainer(connection), dict(ready.info)


def long_batches() -> list[ForwardBackwardBatch]:
    """A cross-entropy request with one datum of LONG tokens beside two short ones, and an
    importance-sampling request with one of LONG - 3: each longest datum has a pack of its own."""
    rng = np.random.default_rng(7)
    data = []
    for n in (LONG, 6, 9):
        inputs = {"target_tokens": rng.integers(0, 384, n), "weights": (rng.random(n) > 0.2).astype(np.float32)}
        data.append(TrainDatum(tokens=rng.integers(0, 384, n), inputs=inputs))
    sampled = []
    for n in (LONG - 3, 11):
        inputs = {
            "target_tokens": rng.integers(0, 384, n), "advantages": rng.normal(size=n).astype(np.float32),
            "logprobs": (-5.95 + 0.1 * rng.normal(size=n)).astype(np.float32),
        }
        sampled.append(TrainDatum(tokens=rng.integers(0, 384, n), inputs=inputs))
    return [
        ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False),
        ForwardBackwardBatch(data=sampled, loss_fn="importance_sampling", loss_config={}, forward_only=False),
    ]


def train_long(trainer: RemoteTrainer) -> list[list]:
    passes, stepped = trainer.forward_backward_then_step("job", long_batches(), ADAM)
    assert not isinstance(stepped, Exception), stepped
    return [[passes, stepped]]


@pytest.fixture(scope="module")
def sockets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return socket_directory(tmp_path_factory.mktemp("sockets"))


class Run(NamedTuple):
    """One side of a LoRA run: train()'s results and the weights after EARLY_STEPS and LORA_STEPS
    steps, then the long datums' step and the weights after it."""

    results: list[list]
    early_weights: dict
    weights: dict
    long: list[list]
    long_weights: dict


def lora_run(trainer: RemoteTrainer) -> Run:
    early = train(trainer, range(EARLY_STEPS))
    early_weights = local_payload(trainer.adapter_tensors("job"))
    results = early + train(trainer, range(EARLY_STEPS, LORA_STEPS))
    weights = local_payload(trainer.adapter_tensors("job"))
    long = train_long(trainer)
    return Run(results, early_weights, weights, long, local_payload(trainer.adapter_tensors("job")))


@pytest.fixture(scope="module")
def lora_cp_run(tmp_path_factory, sockets, tiny_llama):
    """The start state, the one-process LoRA run (TorchTrainer), the cp group's from that start,
    and the facts the group's Ready reported."""
    root = tmp_path_factory.mktemp("lora-cp")
    reference = single(sockets, tiny_llama, "lora_trainer")
    reference.add_adapter("job", SPEC, "adamw")
    reference.save_state("job", root, False)
    theirs = lora_run(reference)
    reference.close()
    trainer, info = cp_group(sockets, tiny_llama, "lora")
    try:
        trainer.load_state("job", root, SPEC, False, "adamw")
        ours = lora_run(trainer)
    finally:
        trainer.close()
    yield root, theirs, ours, info


@needs_automodel
def test_a_cp_group_trains_lora_as_one_process_does_with_every_loss(lora_cp_run):
    _, theirs, ours, info = lora_cp_run
    worst = assert_runs_agree(ours.results, theirs.results)
    difference = max_weight_difference(ours.weights, theirs.weights)
    print(f"lora cp=2 parity: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL
    assert (info["world_size"], info["dp"], info["cp"]) == (2, 1, 2)


@needs_automodel
def test_a_datum_over_one_ranks_budget_trains_split_over_the_cp_group(lora_cp_run):
    _, theirs, ours, _ = lora_cp_run
    assert len(ours.long[0][0][0].logprobs[0]) == LONG
    worst = assert_runs_agree(ours.long, theirs.long)
    difference = max_weight_difference(ours.long_weights, theirs.long_weights)
    print(f"long datum cp=2: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL


@needs_automodel
def test_two_cp_groups_of_two_train_lora_as_one_process_does_their_layers_checkpointed(lora_cp_run, sockets, tiny_llama):
    """dp = 2 × cp = 2 on 4 ranks: the cp groups take turns by micro-batch, and in a round where
    one has none left its two ranks run the empty pass together. A budget of 1 byte checkpoints
    every round: each layer's attention recomputes in backward, exchanging K/V over its cp group."""
    root, theirs, _, _ = lora_cp_run
    trainer, info = cp_group(sockets, tiny_llama, "lora", ranks=4, activation_budget_bytes=1)
    try:
        trainer.load_state("job", root, SPEC, False, "adamw")
        ours = train(trainer, range(EARLY_STEPS))
        weights = trainer.adapter_tensors("job")
    finally:
        trainer.close()
    assert (info["world_size"], info["dp"], info["cp"]) == (4, 2, 2)
    worst = assert_runs_agree(ours, theirs.results[:EARLY_STEPS])
    difference = max_weight_difference(weights, theirs.early_weights)
    print(f"lora dp=2 cp=2 parity: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL


@needs_automodel
def test_a_cp_group_trains_every_weight_as_one_process_does(sockets, tiny_llama):
    reference = single(sockets, tiny_llama, "full_trainer")
    reference.add_adapter("job", None, "adamw")
    theirs = train(reference, range(FULL_STEPS))
    their_weights = reference.adapter_tensors("job")
    reference.close()
    trainer, _ = cp_group(sockets, tiny_llama, "full")
    try:
        trainer.add_adapter("job", None, "adamw")
        ours = train(trainer, range(FULL_STEPS))
        weights = trainer.adapter_tensors("job")
    finally:
        trainer.close()
    worst = assert_runs_agree(ours, theirs)
    difference = max_weight_difference(weights, their_weights)
    print(f"full cp=2 parity: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL


def test_the_budget_bounds_each_ranks_part_of_a_pack():
    # Longest first; a pack holds up to cp × budget tokens, so each rank's part is within the budget
    # (plus under 2 tokens of padding to a multiple of 2·cp).
    assert plan_packed_micro_batches([LONG, 6, 9, 30, 12], 24, 2) == [[0], [3, 4], [2, 1]]
    assert plan_packed_micro_batches([LONG, 6, 9, 30, 12], 24, 1) == [[0], [3], [4, 2], [1]]
    assert plan_packed_micro_batches([100], 24, 2) == [[0]]  # over the budget: a pack of its own


@needs_automodel
def test_a_cp_that_does_not_divide_the_group_is_refused_naming_trainer_cp(sockets, tiny_llama):
    with pytest.raises(BadRequest, match=r"openrl.trainer_cp=3 does not divide openrl.trainer_gpus=2") as refused:
        cp_group(sockets, tiny_llama, "lora", cp=3)
    assert refused.value.key == "trainer_cp"
