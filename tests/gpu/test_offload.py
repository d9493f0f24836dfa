"""Parking and resuming device state (gpu/offload.py) and the engines' park/resume, on the CPU.

On the CPU the host is the device, so `park` moves nothing; what these tests pin is
that the round trip changes nothing (every tensor object and every bit the same, and
training continues exactly as an unparked run does), that parked engines refuse
compute, and the in-place move itself (`relocate`), driven with a host copy. The CUDA
path (pinned copies, freed device memory) runs in bench/gpu_check.py on a GPU.

Every comparison is exact: the same float32 ops on the same values must give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import offload
from openrld.gpu.optim import AdamW
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=7)
TEXT = "User: what is two plus two? Assistant: four. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def trainer(tiny_llama: Path) -> TorchTrainer:
    return TorchTrainer(tiny_llama, CPU)


@pytest.fixture
def fresh_trainer(trainer: TorchTrainer):
    """The module's trainer, resident, with every adapter dropped after each test."""
    yield trainer
    if trainer.is_parked:
        trainer.resume()
    for name in trainer.adapter_names():
        trainer.drop_adapter(name)


@pytest.fixture(scope="module")
def sft(tiny_llama: Path) -> ForwardBackwardBatch:
    ids = np.array(transformers.AutoTokenizer.from_pretrained(str(tiny_llama))(TEXT)["input_ids"], np.int64)
    datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def step(trainer: TorchTrainer, name: str, batch: ForwardBackwardBatch) -> float:
    loss = trainer.forward_backward(name, batch).metrics["loss:sum"]
    trainer.optim_step(name, AdamParams(learning_rate=1e-2))
    return loss


# ---------------------------------------------------------------------------
# The in-place move


def test_relocate_keeps_each_tensor_object_and_its_bits_in_new_storage() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.nn.Parameter(torch.randn(4))]
    before = snapshot(tensors)
    ids, pointers = [id(t) for t in tensors], [t.data_ptr() for t in tensors]
    moved = offload.relocate(tensors, lambda t: t.clone())
    assert moved == 3 * 5 * 4 + 7 * 8 + 4 * 4
    assert [id(t) for t in tensors] == ids
    assert all(t.data_ptr() != p for t, p in zip(tensors, pointers))
    assert all(bit_equal(t, b) for t, b in zip(tensors, before))
    assert isinstance(tensors[2], torch.nn.Parameter) and tensors[2].requires_grad


def test_relocated_parameters_and_moments_keep_training_as_before() -> None:
    """An optimizer holds its parameters and moments by reference; after a move it still steps them."""
    torch.manual_seed(0)
    start = torch.randn(6)
    grads = [torch.randn(6) for _ in range(4)]
    moved, kept = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizers = AdamW({"w": moved}), AdamW({"w": kept})
    for i, grad in enumerate(grads):
        if i == 2:
            offload.relocate([moved, *optimizers[0].live_state()], lambda t: t.clone())
        for param, optimizer in zip((moved, kept), optimizers):
            param.grad = grad.clone()
            optimizer.step(AdamParams(learning_rate=0.1))
    assert bit_equal(moved.data, kept.data)


def test_unique_tensors_takes_a_shared_tensor_once() -> None:
    shared = torch.nn.Parameter(torch.randn(4, 2))
    model = torch.nn.ModuleDict({"embed": torch.nn.Linear(2, 4, bias=False), "head": torch.nn.Linear(2, 4, bias=False)})
    model["embed"].weight = shared
    model["head"].weight = shared  # tied, as tied embeddings are
    assert offload.unique_tensors(offload.module_tensors(model) + [shared], CPU) == [shared]


def test_unique_tensors_refuses_two_views_of_one_storage() -> None:
    base = torch.randn(8)
    with pytest.raises(ValueError, match="share one storage"):
        offload.unique_tensors([base[:4], base[4:]], CPU)


def test_unique_tensors_leaves_out_tensors_on_other_devices() -> None:
    here, elsewhere = torch.randn(2), torch.empty(2, device="meta")
    assert offload.unique_tensors([here, elsewhere], CPU) == [here]


def test_optimizer_tensors_names_a_torch_optimizers_state() -> None:
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    state = optimizer.state[param]
    assert {id(t) for t in offload.optimizer_tensors(optimizer)} == {id(state[k]) for k in ("step", "exp_avg", "exp_avg_sq")}


# ---------------------------------------------------------------------------
# The trainer


def test_cpu_park_moves_nothing_and_reports_every_tensor(fresh_trainer: TorchTrainer, sft) -> None:
    fresh_trainer.add_adapter("a", SPEC)
    step(fresh_trainer, "a", sft)
    fresh_trainer.forward_backward("a", sft)  # leaves gradients to park
    model = fresh_trainer._model
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    expected = params + grads + list(model.buffers())
    report = fresh_trainer.park()
    lora_params = [p for n, p in model.named_parameters() if ".a." in n]
    moments = 2 * len(lora_params)  # AdamW: m and v per trained tensor
    assert report.tensors == len(expected) + moments
    assert report.bytes_held == sum(t.numel() * t.element_size() for t in expected) + sum(
        2 * p.numel() * p.element_size() for p in lora_params
    )
    assert (report.bytes_moved, report.device_bytes_freed, report.cache_bytes_dropped) == (0, 0, 0)
    assert report.device == "cpu"


def test_park_and_resume_keep_every_trainer_tensor_bit_identical(fresh_trainer: TorchTrainer, sft) -> None:
    fresh_trainer.add_adapter("a", SPEC)
    step(fresh_trainer, "a", sft)
    fresh_trainer.forward_backward("a", sft)
    state = offload.module_tensors(fresh_trainer._model) + fresh_trainer._adapters["a"].optimizer.live_state()
    before = snapshot(state)
    fresh_trainer.park()
    fresh_trainer.resume()
    after = offload.module_tensors(fresh_trainer._model) + fresh_trainer._adapters["a"].optimizer.live_state()
    assert [id(t) for t in after] == [id(t) for t in state]
    assert all(bit_equal(t, b) for t, b in zip(after, before))


def test_training_across_a_park_matches_training_without_one(fresh_trainer: TorchTrainer, sft) -> None:
    """Adapters a and b start equal (same seed); a is parked and resumed between steps 2 and 3."""
    fresh_trainer.add_adapter("a", SPEC)
    fresh_trainer.add_adapter("b", SPEC)
    losses_a = [step(fresh_trainer, "a", sft) for _ in range(2)]
    fresh_trainer.park()
    fresh_trainer.resume()
    losses_a += [step(fresh_trainer, "a", sft) for _ in range(2)]
    losses_b = [step(fresh_trainer, "b", sft) for _ in range(4)]
    assert losses_a == losses_b
    tensors_a, tensors_b = fresh_trainer.adapter_tensors("a"), fresh_trainer.adapter_tensors("b")
    assert all(bit_equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


def test_parked_trainer_refuses_compute_until_resumed(fresh_trainer: TorchTrainer, sft) -> None:
    fresh_trainer.add_adapter("a", SPEC)
    fresh_trainer.park()
    with pytest.raises(offload.EngineParked, match="forward_backward on a parked trainer"):
        fresh_trainer.forward_backward("a", sft)
    with pytest.raises(offload.EngineParked, match="optim_step on a parked trainer"):
        fresh_trainer.optim_step("a", AdamParams())
    with pytest.raises(offload.EngineParked, match="add_adapter on a parked trainer"):
        fresh_trainer.add_adapter("b", SPEC)
    fresh_trainer.resume()
    assert fresh_trainer.forward_backward("a", sft).metrics["loss:sum"] > 0


def test_park_twice_and_resume_unparked_are_refused(fresh_trainer: TorchTrainer) -> None:
    with pytest.raises(offload.EngineParked, match="not parked"):
        fresh_trainer.resume()
    fresh_trainer.park()
    with pytest.raises(offload.EngineParked, match="already parked"):
        fresh_trainer.park()


# ---------------------------------------------------------------------------
# The sampler


@pytest.fixture(scope="module")
def sampler(tiny_llama: Path) -> TorchSampler:
    return TorchSampler(tiny_llama, CPU)


@pytest.fixture(scope="module")
def prompt(tiny_llama: Path) -> np.ndarray:
    return np.array(transformers.AutoTokenizer.from_pretrained(str(tiny_llama))(TEXT)["input_ids"], np.int64)


def job(prompt: np.ndarray, max_tokens: int = 6) -> SampleJob:
    return SampleJob(prompt=prompt, num_samples=2, params=SamplingSpec(max_tokens=max_tokens, seed=11, stop_token_ids=()))


def test_sampler_samples_the_same_after_park_and_resume(sampler: TorchSampler, prompt: np.ndarray) -> None:
    expected = sampler.sample(None, job(prompt))
    sampler.park()
    sampler.resume()
    got = sampler.sample(None, job(prompt))
    for a, b in zip(got.sequences, expected.sequences):
        assert a.tokens.tolist() == b.tokens.tolist() and bit_equal(torch.from_numpy(a.logprobs), torch.from_numpy(b.logprobs))


def test_a_parked_sampler_gives_back_its_packed_weights_and_packs_them_again(
    small_weights_pack: None, tiny_llama: Path, prompt: np.ndarray
) -> None:
    assert_park_gives_back_packed_weights(TorchSampler(tiny_llama, CPU), prompt)


def test_a_parked_gemma3_sampler_gives_back_the_packed_weights_of_its_hf_forward(
    small_weights_pack: None, tmp_path: Path
) -> None:
    gemma3 = TorchSampler(build_tiny_model(tmp_path / "gemma3", "gemma3", seed=3), CPU)
    assert_park_gives_back_packed_weights(gemma3, np.arange(3, 12, dtype=np.int64))


def assert_park_gives_back_packed_weights(sampler: TorchSampler, prompt: np.ndarray) -> None:
    sampler.sample(None, job(prompt))
    packed = sampler.statistics().packed_weight_bytes
    report = sampler.park()
    while_parked = sampler.statistics().packed_weight_bytes
    sampler.resume()
    sampler.sample(None, job(prompt))
    assert packed > 0 and report.cache_bytes_dropped >= packed
    assert (while_parked, sampler.statistics().packed_weight_bytes) == (0, packed)


def test_sampler_refuses_to_park_mid_decode(sampler: TorchSampler, prompt: np.ndarray) -> None:
    sampler.add("r1", None, job(prompt, max_tokens=50))
    sampler.step()  # prefilled: its rows hold KV now
    try:
        with pytest.raises(offload.CannotPark, match=r"decoding requests \['r1'\]"):
            sampler.park()
    finally:
        sampler.cancel("r1")
    assert not sampler.is_parked


def test_parked_sampler_keeps_queued_requests_and_runs_them_after_resume(sampler: TorchSampler, prompt: np.ndarray) -> None:
    expected = sampler.sample(None, job(prompt))
    sampler.park()
    sampler.add("queued", None, job(prompt))
    with pytest.raises(offload.EngineParked, match="step on a parked sampler"):
        sampler.step()
    sampler.resume()
    finished = []
    while not finished:
        finished = sampler.step()
    assert [s.tokens.tolist() for s in finished[0].result.sequences] == [s.tokens.tolist() for s in expected.sequences]



def test_spill_moves_host_tensors_into_one_file_keeping_each_object_and_its_bits(tmp_path: Path) -> None:
    tensors = [
        torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(4).to(torch.bfloat16), torch.tensor(2.5),
    ]
    ids, bits = [id(t) for t in tensors], [t.clone() for t in tensors]
    path = tmp_path / "state.parked"
    moved = offload.spill(tensors, path)
    assert moved == sum(t.numel() * t.element_size() for t in bits)
    assert [id(t) for t in tensors] == ids
    assert all(torch.equal(t, b) and t.dtype == b.dtype and t.shape == b.shape for t, b in zip(tensors, bits))
    assert path.stat().st_size == 3 * 64 + 4  # each tensor starts at a multiple of 64; the last holds 4 bytes
    # Every tensor's storage is now the file's mapping: one storage, no copy of its own.
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_spill_leaves_tensors_it_cannot_map_where_they_are(tmp_path: Path) -> None:
    strided, empty = torch.randn(3, 4)[:, ::2], torch.empty(0)
    before = (strided.data_ptr(), empty.data_ptr())
    assert offload.spill([strided, empty], tmp_path / "none.parked") == 0
    assert (strided.data_ptr(), empty.data_ptr()) == before
    assert not (tmp_path / "none.parked").exists()


def test_spill_maps_a_column_major_matrix_keeping_its_strides(tmp_path: Path) -> None:
    head = torch.randn(4, 6).t().contiguous().t()  # a transposed matrix's layout
    bits = head.clone()
    assert offload.spill([head], tmp_path / "head.parked") == 96
    assert head.stride() == (1, 4)
    assert torch.equal(head, bits)


def test_a_cpu_park_has_nothing_to_spill(fresh_trainer: TorchTrainer, tmp_path: Path) -> None:
    fresh_trainer.park()
    try:
        assert fresh_trainer.spill_parked(str(tmp_path)) == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        fresh_trainer.resume()


def test_spilled_tensors_copy_back_bit_for_bit_and_the_file_can_go(tmp_path: Path) -> None:
    tensors = [torch.randn(8, 8), torch.randn(3).to(torch.float16)]
    bits = [t.clone() for t in tensors]
    path = tmp_path / "state.parked"
    offload.spill(tensors, path)
    offload.relocate(tensors, lambda t: t.clone())  # what resume does, to the device
    path.unlink()
    assert all(torch.equal(t, b) for t, b in zip(tensors, bits))
