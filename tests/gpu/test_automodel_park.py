"""Parking the Automodel trainer (gpu/automodel_park.py, gpu/automodel_trainer.py).

What is checked:
- the storage mover on plain tensors, in this process: a parked storage holds 0 bytes,
  views of one storage are views of it again after resume, with every value back;
  storages of 0 bytes are skipped and shared ones moved once; memory torch does not own
  is refused before anything moves;
- a 2-rank gloo group in the Automodel environment, through `RemoteTrainer` and the real
  worker protocol (as tests/gpu/test_automodel_trainer.py drives it): a LoRA job parked
  between steps, or between a forward_backward and its optim_step (gradients held),
  trains bit for bit as one never parked; so does full fine-tuning; the park report's
  bytes are the storages a rank holds, derived here from the model file; compute on a
  parked group and a second park are refused, naming park and resume.

The group tests need `.venv-automodel` (`make automodel-env`) and are skipped without
it; they share one LoRA group (a start costs ~20 s on 2 cores) and run in file order.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import safetensors
import torch

from openrld.batches import AdamParams
from openrld.gpu.automodel_park import StorageSlot, distinct_storages, empty_to_host, refill
from openrld.worker.launchers import socket_directory
from openrld.worker.values import WorkerFault, local_payload
from tests.gpu.test_automodel_trainer import AUTOMODEL_PYTHON, SPEC, group, step_batches

needs_automodel = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(),
    reason=".venv-automodel is not built (make automodel-env): the Automodel trainer runs only in its own environment",
)

ADAM = AdamParams(learning_rate=5e-3, grad_clip_norm=5.0)
STEPS = 4
HELD_STEP = 2  # the step run as two calls (forward_backward, then optim_step) in every run
REQUESTS = 3  # of step_batches' 7 (cross_entropy, importance_sampling, ppo): enough to move every weight


# ---------------------------------------------------------------------------
# The storage mover, on plain tensors


def test_a_parked_storage_is_empty_and_its_views_are_views_of_it_again_after_resume():
    base = torch.arange(24, dtype=torch.float32)
    rows = base.view(4, 6)[1:3]  # (2, 6) view at element offset 6
    column = base.view(4, 6)[:, 2]  # (4,) strided view
    other = torch.full((3,), 7, dtype=torch.int64)
    expected = [t.clone() for t in (base, rows, column, other)]
    slot = StorageSlot("trainer", torch.device("cpu"), lambda: [rows, column, base, other])

    report = slot.park()

    assert (report.tensors, report.bytes_moved, report.bytes_held) == (2, 24 * 4 + 3 * 8, 24 * 4 + 3 * 8)
    assert base.untyped_storage().nbytes() == rows.untyped_storage().nbytes() == other.untyped_storage().nbytes() == 0
    resumed = slot.resume()
    assert (resumed.tensors, resumed.bytes_moved) == (2, 24 * 4 + 3 * 8)
    for tensor, value in zip((base, rows, column, other), expected, strict=True):
        assert torch.equal(tensor, value)
    # Still views of one storage: a write through one is seen through the others.
    rows[0, 0] = -1.0
    assert base[6] == -1.0 and column[1] == base[8]
    assert rows.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_empty_storages_are_skipped_and_a_shared_storage_is_moved_once():
    shared = torch.ones(5, dtype=torch.float32)
    freed = torch.ones(8, dtype=torch.float32)
    freed.untyped_storage().resize_(0)  # as FSDP2 frees an all-gathered weight between passes
    chosen = distinct_storages([shared, shared[1:], freed, shared.view(5, 1)], torch.device("cpu"))
    assert len(chosen) == 1 and chosen[0].nbytes() == 5 * 4
    parked = empty_to_host(chosen, torch.device("cpu"))
    assert shared.untyped_storage().nbytes() == 0 and parked.nbytes == 20
    assert refill(parked) == 20
    assert torch.equal(shared, torch.ones(5))
    assert freed.untyped_storage().nbytes() == 0  # left as FSDP2 left it


def test_a_storage_torch_does_not_own_is_refused_before_anything_moves():
    owned = torch.ones(4)
    borrowed = torch.from_numpy(np.zeros(3, np.float32))
    refusal = r"cannot park: a \(3,\) torch.float32 tensor's storage \(12 bytes\) is not resizable"
    with pytest.raises(ValueError, match=refusal):
        distinct_storages([owned, borrowed], torch.device("cpu"))
    slot = StorageSlot("trainer", torch.device("cpu"), lambda: [owned, borrowed])
    with pytest.raises(ValueError):
        slot.park()
    assert not slot.is_parked and owned.untyped_storage().nbytes() == 16


# ---------------------------------------------------------------------------
# A 2-rank group


def run(trainer, park_at: tuple[str, int] | None = None) -> tuple[list, dict[str, torch.Tensor]]:
    """The job's results over STEPS steps from its seeded start, and its final weights.

    Step HELD_STEP is a forward_backward then an optim_step (gradients held between them);
    `park_at` parks and resumes the group ("after", step) once that step is done, or
    ("held", HELD_STEP) between its two calls.
    """
    results = []
    for step in range(STEPS):
        batches = step_batches(step)[:REQUESTS]
        if step == HELD_STEP:
            passes = trainer.forward_backward_many("job", batches)
            if park_at == ("held", step):
                park_and_resume(trainer)
            stepped = trainer.optim_step("job", ADAM)
        else:
            passes, stepped = trainer.forward_backward_then_step("job", batches, ADAM)
        results.append((passes, stepped))
        if park_at == ("after", step):
            park_and_resume(trainer)
    return results, local_payload(trainer.adapter_tensors("job"))


def park_and_resume(trainer) -> None:
    parked = trainer.park()
    assert parked.bytes_moved > 0
    assert trainer.resume().bytes_moved == parked.bytes_moved


def assert_bit_identical(ours: tuple[list, dict], theirs: tuple[list, dict]) -> None:
    """Every loss, metric, log-probability and weight exactly equal (==, torch.equal)."""
    (results, weights), (their_results, their_weights) = ours, theirs
    for (passes, stepped), (their_passes, their_stepped) in zip(results, their_results, strict=True):
        assert stepped.metrics == their_stepped.metrics
        for mine, reference in zip(passes, their_passes, strict=True):
            assert mine.metrics == reference.metrics
            assert all(np.array_equal(a, b) for a, b in zip(mine.logprobs, reference.logprobs, strict=True))
    assert weights.keys() == their_weights.keys()
    assert all(torch.equal(weights[key], their_weights[key]) for key in weights)


def fresh_job(trainer) -> None:
    """Close the job if open and open it again: the seeded LoRA init gives every run the same start."""
    if trainer.has_adapter("job"):
        trainer.drop_adapter("job")
    trainer.add_adapter("job", SPEC, "adamw")


@pytest.fixture(scope="module")
def sockets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return socket_directory(tmp_path_factory.mktemp("sockets"))


@pytest.fixture(scope="module")
def lora_group(sockets, tiny_llama):
    trainer = group(sockets, tiny_llama, "lora")
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def never_parked(lora_group):
    fresh_job(lora_group)
    return run(lora_group)


@needs_automodel
def test_a_lora_job_parked_between_steps_trains_bit_for_bit_as_one_never_parked(lora_group, never_parked):
    fresh_job(lora_group)
    assert_bit_identical(run(lora_group, park_at=("after", 1)), never_parked)


@needs_automodel
def test_gradients_held_across_a_park_step_bit_for_bit_as_never_parked(lora_group, never_parked):
    fresh_job(lora_group)
    assert_bit_identical(run(lora_group, park_at=("held", HELD_STEP)), never_parked)


@needs_automodel
def test_the_park_report_counts_every_storage_rank_0_holds(lora_group, tiny_llama):
    # After a step, with no gradients held: each weight, and AdamW's two moments of each LoRA shard.
    fresh_job(lora_group)
    lora_group.forward_backward_then_step("job", step_batches(0)[:1], ADAM)
    expected_storages, expected_bytes = rank0_storages(lora_group, tiny_llama, lora_copies=3)

    parked = lora_group.park()
    resumed = lora_group.resume()

    assert (parked.tensors, parked.bytes_held) == (expected_storages, expected_bytes)
    assert parked.bytes_moved == expected_bytes
    assert (parked.device, parked.device_bytes_freed, parked.cache_bytes_dropped) == ("cpu", 0, 0)
    assert (resumed.tensors, resumed.bytes_moved) == (expected_storages, expected_bytes)


@needs_automodel
def test_a_park_with_gradients_held_moves_rank_0s_gradient_shards_too(lora_group, tiny_llama):
    # A step, then a pass whose gradients wait for the next optim_step: each LoRA shard has a
    # gradient shard of its size too. FSDP2 writes one unit's gradients as views into that
    # unit's one reduce-scatter output: 3 storages, for the units that train (the two decoder
    # layers, and the root for lm_head's LoRA).
    fresh_job(lora_group)
    lora_group.forward_backward_then_step("job", step_batches(0)[:1], ADAM)
    lora_group.forward_backward("job", step_batches(1)[0])
    storages, expected_bytes = rank0_storages(lora_group, tiny_llama, lora_copies=4)
    expected_storages = storages - len(local_payload(lora_group.adapter_tensors("job"))) + 3

    parked = lora_group.park()
    lora_group.resume()

    assert (parked.tensors, parked.bytes_moved) == (expected_storages, expected_bytes)


def rank0_storages(trainer, tiny_llama, lora_copies: int) -> tuple[int, int]:
    """The storages rank 0 of 2 holds on its device (fp32 on a CPU), and their bytes:
    - every weight of the model, LoRA's too, as FSDP2's shard: rank 0 holds ceil(rows / 2) of a
      tensor's rows (torch.chunk's split), in a storage padded to that size on every rank;
    - `lora_copies` - 1 more tensors of each LoRA shard's size (AdamW's moments, gradients);
    - the rotary embedding's two buffers, inv_freq and original_inv_freq: head_dim / 2 floats
      each, whole on every rank.
    Each is a storage of its own; the views over them (DTensors, AdamW's shards) add none.
    """
    base = safetensors.safe_open(str(tiny_llama / "model.safetensors"), framework="pt")
    base_shapes = [tuple(base.get_slice(key).get_shape()) for key in base.keys()]  # noqa: SIM118  # safe_open is no dict: keys() is its only listing
    lora_shapes = [tuple(t.shape) for t in local_payload(trainer.adapter_tensors("job")).values()]
    head_dim = 16  # tiny-llama: hidden 64 over 4 heads
    rotary_bytes = 2 * (head_dim // 2) * 4
    total = sum(map(rank0_bytes, base_shapes)) + lora_copies * sum(map(rank0_bytes, lora_shapes)) + rotary_bytes
    return len(base_shapes) + lora_copies * len(lora_shapes) + 2, total


def rank0_bytes(shape: tuple[int, ...]) -> int:
    """fp32 bytes of rank 0's shard of a tensor of `shape` over 2 ranks: ceil(rows / 2) rows."""
    return -(-shape[0] // 2) * int(np.prod(shape[1:], dtype=np.int64)) * 4


@needs_automodel
def test_compute_while_parked_a_second_park_and_a_resume_unparked_are_refused_naming_them(lora_group):
    fresh_job(lora_group)
    scoring = msgspec.structs.replace(step_batches(0)[0], forward_only=True)
    before = lora_group.forward_backward("job", scoring)
    lora_group.park()
    try:
        with pytest.raises(WorkerFault, match=EVERY_RANK + r"model job on a parked trainer; resume\(\) it first"):
            lora_group.forward_backward("job", scoring)
        with pytest.raises(WorkerFault, match=EVERY_RANK + "the trainer is already parked"):
            lora_group.park()
    finally:
        lora_group.resume()
    with pytest.raises(WorkerFault, match=EVERY_RANK + "the trainer is not parked"):
        lora_group.resume()
    after = lora_group.forward_backward("job", scoring)
    assert after.metrics == before.metrics and all(map(np.array_equal, after.logprobs, before.logprobs))


# Every rank refuses alike; the worker names the first, and an engine's own error by its class.
EVERY_RANK = r"ranks 0, 1 of 2 failed; rank 0: EngineParked: "


@needs_automodel
def test_a_full_fine_tuning_job_parked_between_and_within_steps_trains_bit_for_bit(sockets, tiny_llama, tmp_path):
    trainer = group(sockets, tiny_llama, "full")
    try:
        trainer.add_adapter("job", None, "adamw")
        start = tmp_path / "start"
        start.mkdir()
        trainer.sampler_checkpoint("job", start)  # the start, to take the second run back to
        never = run_full(trainer, parks=())
        trainer.load_state("job", start, None, False, "adamw")  # the start's weights, AdamW reset
        parked = run_full(trainer, parks=(("after", 0), ("held", 1)))
        assert_bit_identical(parked, never)
    finally:
        trainer.close()


def run_full(trainer, parks: tuple[tuple[str, int], ...]) -> tuple[list, dict[str, torch.Tensor]]:
    """Two steps of full fine-tuning (the second as two calls), parking where `parks` says."""
    results = []
    passes, stepped = trainer.forward_backward_then_step("job", step_batches(0)[:REQUESTS], ADAM)
    results.append((passes, stepped))
    if ("after", 0) in parks:
        park_and_resume(trainer)
    passes = trainer.forward_backward_many("job", step_batches(1)[:REQUESTS])
    if ("held", 1) in parks:
        park_and_resume(trainer)
    results.append((passes, trainer.optim_step("job", ADAM)))
    return results, local_payload(trainer.adapter_tensors("job"))
