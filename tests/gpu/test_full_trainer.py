"""FullTrainer on a tiny random Llama: every weight trains, for one job.

Tolerances: the trainer's loss and weights are compared with a bare PyTorch loop (the
same model, `torch.optim.AdamW` with foreach=False, the cross-entropy sum) at 1e-6:
float32 math in a different reduction order (micro-batches, position chunks). A resumed
run is compared with an uninterrupted one at 0: it is the same arithmetic on the same
inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest, Conflict
from openrld.gpu import checkpoint, full_io
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.models import load_causal_lm
from openrld.gpu.scoring import TrainerConfig
from openrld.gpu.tiny_models import build_tiny_model

CPU = torch.device("cpu")
SMALL = TrainerConfig(max_batch_tokens=48, logprob_chunk_positions=7)  # several micro-batches and chunks
ATOL = 1e-6
TEXTS = ("The quick brown fox jumps over the lazy dog.", "Hello world! The answer is 42.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def sft_data(model_dir: Path) -> list[TrainDatum]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    data = []
    for text in TEXTS:
        ids = np.array(tokenizer(text)["input_ids"], np.int64)
        weights = np.ones(len(ids) - 1, np.float32)
        weights[:2] = 0.0
        data.append(TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": weights}))
    return data


def fb(data, forward_only: bool = False) -> ForwardBackwardBatch:
    return ForwardBackwardBatch(data=list(data), loss_fn="cross_entropy", loss_config={}, forward_only=forward_only)


def new_trainer(model_dir: Path, name: str = "job") -> FullTrainer:
    trainer = FullTrainer(model_dir, CPU, config=SMALL)
    trainer.add_adapter(name, None, "adamw")
    return trainer


def train(trainer: FullTrainer, data, steps: int, name: str = "job") -> list[float]:
    losses = []
    for step in range(steps):
        losses.append(trainer.forward_backward(name, fb(data)).metrics["loss:sum"])
        trainer.optim_step(name, AdamParams(learning_rate=1e-3 * (step + 1), weight_decay=0.1, grad_clip_norm=1.0))
    return losses


def test_two_steps_equal_a_bare_pytorch_loop(model_dir: Path, sft_data: list[TrainDatum]) -> None:
    trainer = new_trainer(model_dir)
    losses = train(trainer, sft_data, 2)

    model = load_causal_lm(model_dir, CPU)
    params = [p.requires_grad_(True) for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1, foreach=False)
    bare_losses = []
    for step in range(2):
        optimizer.param_groups[0]["lr"] = 1e-3 * (step + 1)
        total = torch.zeros(())
        for datum in sft_data:
            logits = model(input_ids=torch.from_numpy(datum.tokens)[None]).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(datum.inputs["target_tokens"])[:, None])[:, 0]
            total = total - (lp * torch.from_numpy(datum.inputs["weights"])).sum()
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        bare_losses.append(float(total.detach()))

    np.testing.assert_allclose(losses, bare_losses, rtol=0, atol=ATOL * 10)  # loss sums over ~20 targets
    trained = trainer.adapter_tensors("job")
    for name, param in model.named_parameters():
        torch.testing.assert_close(trained[name], param.detach(), rtol=0, atol=ATOL)


def test_every_parameter_trains_including_the_embeddings(model_dir: Path, sft_data: list[TrainDatum]) -> None:
    trainer = new_trainer(model_dir)
    before = trainer.adapter_tensors("job")
    train(trainer, sft_data, 1)
    after = trainer.adapter_tensors("job")
    assert sorted(after) == sorted(dict(load_causal_lm(model_dir, CPU).named_parameters()))
    unchanged = [name for name in after if torch.equal(after[name], before[name])]
    assert unchanged == []


def test_forward_only_adds_no_gradient(model_dir: Path, sft_data: list[TrainDatum]) -> None:
    trainer = new_trainer(model_dir)
    trainer.forward_backward("job", fb(sft_data, forward_only=True))
    assert trainer.adapter_gradients("job") == {}


def test_dimuon_is_refused_at_creation_naming_lora(model_dir: Path) -> None:
    trainer = FullTrainer(model_dir, CPU, config=SMALL)
    with pytest.raises(BadRequest, match="dimuon needs a LoRA model"):
        trainer.add_adapter("job", None, "dimuon")


def test_dimuon_params_fail_the_step_and_keep_the_gradient(model_dir: Path, sft_data: list[TrainDatum]) -> None:
    trainer = new_trainer(model_dir)
    trainer.forward_backward("job", fb(sft_data))
    grads = trainer.adapter_gradients("job")
    with pytest.raises(BadRequest, match="uses 'adamw' but this optim_step sent DimuonParams"):
        trainer.optim_step("job", DimuonParams(learning_rate=1e-3))
    kept = trainer.adapter_gradients("job")
    assert all(torch.equal(kept[k], grads[k]) for k in grads) and sorted(kept) == sorted(grads)


def test_a_second_job_is_a_conflict(model_dir: Path) -> None:
    trainer = new_trainer(model_dir)
    with pytest.raises(Conflict, match="serves one job"):
        trainer.add_adapter("other", LoraSpec(rank=4), "adamw")


def test_state_checkpoint_is_full_safetensors_of_every_weight(
    model_dir: Path, sft_data: list[TrainDatum], tmp_path: Path
) -> None:
    trainer = new_trainer(model_dir)
    train(trainer, sft_data, 1)
    trainer.save_state("job", tmp_path, with_optimizer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        full_io.FULL_META, full_io.FULL_WEIGHTS, "optimizer.safetensors", "state.json"
    ]
    stored = safetensors.torch.load_file(tmp_path / full_io.FULL_WEIGHTS)
    live = trainer.adapter_tensors("job")
    assert sorted(stored) == sorted(live)
    assert all(torch.equal(stored[k], live[k]) for k in live)


def test_state_is_streamed_into_the_files_the_dict_path_writes_byte_for_byte(
    model_dir: Path, sft_data: list[TrainDatum], tmp_path: Path
) -> None:
    trainer = new_trainer(model_dir)
    train(trainer, sft_data, 1)
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    streamed.mkdir(), whole.mkdir()
    size = trainer.save_state("job", streamed, with_optimizer=True)
    # The dict path: every tensor copied into one dict, serialised whole, then written.
    full_io.save_full(whole, trainer.adapter_tensors("job"))
    state = checkpoint.full_state(1, True)
    checkpoint.write_beside(whole, state, trainer._optimizer.state_tensors())
    assert {p.name: p.read_bytes() for p in streamed.iterdir()} == {p.name: p.read_bytes() for p in whole.iterdir()}
    assert size == sum(p.stat().st_size for p in streamed.iterdir())


def test_resume_with_optimizer_reproduces_the_uninterrupted_losses(
    model_dir: Path, sft_data: list[TrainDatum], tmp_path: Path
) -> None:
    straight = new_trainer(model_dir)
    expected = train(straight, sft_data, 4)

    first = new_trainer(model_dir)
    losses = train(first, sft_data, 2)
    first.save_state("job", tmp_path, with_optimizer=True)
    resumed = FullTrainer(model_dir, CPU, config=SMALL)
    resumed.load_state("restored", tmp_path, None, with_optimizer=True)
    for step in (2, 3):
        losses.append(resumed.forward_backward("restored", fb(sft_data)).metrics["loss:sum"])
        resumed.optim_step("restored", AdamParams(learning_rate=1e-3 * (step + 1), weight_decay=0.1, grad_clip_norm=1.0))
    assert losses == expected


def test_load_without_optimizer_starts_adamw_fresh(model_dir: Path, sft_data: list[TrainDatum], tmp_path: Path) -> None:
    trainer = new_trainer(model_dir)
    train(trainer, sft_data, 2)
    trainer.save_state("job", tmp_path, with_optimizer=True)
    weights_only = FullTrainer(model_dir, CPU, config=SMALL)
    weights_only.load_state("job", tmp_path, None, with_optimizer=False)
    assert weights_only.statistics().optim_steps == 0
    live = trainer.adapter_tensors("job")
    loaded = weights_only.adapter_tensors("job")
    assert all(torch.equal(loaded[k], live[k]) for k in live)


def test_loading_a_sampler_checkpoint_with_optimizer_is_refused(model_dir: Path, tmp_path: Path) -> None:
    trainer = new_trainer(model_dir)
    trainer.sampler_checkpoint("job", tmp_path)
    other = FullTrainer(model_dir, CPU, config=SMALL)
    with pytest.raises(BadRequest, match="checkpoint has no optimizer state"):
        other.load_state("job", tmp_path, None, with_optimizer=True)
    assert not other.has_adapter("job")


def test_a_lora_checkpoint_is_not_full_weights(model_dir: Path, tmp_path: Path) -> None:
    from openrld.gpu.torch_trainer import TorchTrainer

    lora = TorchTrainer(model_dir, CPU, config=SMALL)
    lora.add_adapter("a", LoraSpec(rank=2, seed=1))
    lora.sampler_checkpoint("a", tmp_path)
    with pytest.raises(BadRequest, match="it is not full-model weights"):
        FullTrainer(model_dir, CPU, config=SMALL).load_state("job", tmp_path, None, with_optimizer=False)


def test_the_delta_shadow_is_on_the_trainer_device_and_parks_with_the_weights(model_dir: Path) -> None:
    trainer = FullTrainer(model_dir, CPU, config=SMALL, weight_sync="delta")
    shadow = trainer._shadow
    assert shadow is not None and {t.device for t in shadow.values()} == {trainer.device}
    parked = {id(t) for t in trainer._slot._state()}  # what park() moves off the device
    assert all(id(t) in parked for t in shadow.values())


def test_bf16_weights_train_through_an_fp32_master_and_hold_it_rounded(model_dir: Path, sft_data) -> None:
    trainer = FullTrainer(model_dir, CPU, torch.bfloat16, config=SMALL)
    trainer.add_adapter("job", None, "adamw")
    for _ in range(2):
        trainer.forward_backward("job", fb(sft_data))
        trainer.optim_step("job", AdamParams(learning_rate=1e-4))
    master, weights = trainer.master_weights(), trainer.adapter_tensors("job")
    assert sorted(master) == sorted(weights) and all(m.dtype == torch.float32 for m in master.values())
    assert all(torch.equal(weights[k], master[k].to(torch.bfloat16)) for k in weights)
    # 1e-4 steps are below bf16's rounding of most weights: the master moved where the weights did not.
    moved = sum(int((master[k] != weights[k].float()).sum()) for k in weights)
    assert moved > 0
