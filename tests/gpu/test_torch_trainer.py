"""TorchTrainer on a tiny random Llama, built offline once for the module.

Tolerances: logprobs are float32 and computed by the trainer over right-padded
micro-batches and position chunks, by the reference over one unpadded sequence, so the two
differ only in float32 reduction order: atol 1e-5. Gradient sums are compared at 1e-6
(float32 accumulation in another order). Resumed training is compared at 1e-6 too, though
it is expected to be bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

from openrld.autosave import write_snapshot
from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest, Conflict, NotFound
from openrld.gpu import lora_io
from openrld.gpu.models import load_causal_lm, lora_config
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig, plan_micro_batches

CPU = torch.device("cpu")
# Small enough that the test data runs as several micro-batches and several position chunks.
SMALL = TrainerConfig(max_batch_tokens=48, logprob_chunk_positions=7)
SPEC = LoraSpec(rank=4, seed=7)
LOGPROB_ATOL = 1e-5
GRAD_ATOL = 1e-6
TEXTS = (
    "User: what is two plus two? Assistant: four.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, general. The answer is 42.",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def sft_data(model_dir: Path) -> list[TrainDatum]:
    """The texts as SFT datums: the first 4 targets are prompt (weight 0), the rest trained."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    data = []
    for text in TEXTS:
        ids = np.array(tokenizer(text)["input_ids"], np.int64)
        weights = np.ones(len(ids) - 1, np.float32)
        weights[:4] = 0.0
        data.append(TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": weights}))
    return data


@pytest.fixture(scope="module")
def shared_trainer(model_dir: Path) -> TorchTrainer:
    return TorchTrainer(model_dir, CPU, config=SMALL)


@pytest.fixture
def trainer(shared_trainer: TorchTrainer):
    """The module's trainer, with every adapter dropped after each test."""
    yield shared_trainer
    for name in shared_trainer.adapter_names():
        shared_trainer.drop_adapter(name)


def batch(data, loss_fn="cross_entropy", forward_only=False, config=None) -> ForwardBackwardBatch:
    return ForwardBackwardBatch(data=list(data), loss_fn=loss_fn, loss_config=config or {}, forward_only=forward_only)


def train(trainer: TorchTrainer, name: str, data, steps: int, lr: float = 1e-2) -> list[float]:
    """SFT steps; returns the loss of each step's forward_backward."""
    losses = []
    for _ in range(steps):
        losses.append(trainer.forward_backward(name, batch(data)).metrics["loss:sum"])
        trainer.optim_step(name, AdamParams(learning_rate=lr))
    return losses


def with_2d_targets(datum: TrainDatum, k: int = 3) -> TrainDatum:
    """The datum scoring K targets per position (top-K distillation style)."""
    n = len(datum.tokens)
    targets = (np.arange(n * k, dtype=np.int64).reshape(n, k) * 37) % 300
    weights = np.full((n, k), 1.0 / k, np.float32)
    return TrainDatum(tokens=datum.tokens, inputs={"target_tokens": targets, "weights": weights})


def rl_datum(tokens: np.ndarray, sampler_logprob: float, advantage: float) -> TrainDatum:
    """An RL datum predicting each next input token, with constant q and A."""
    n = len(tokens)
    return TrainDatum(tokens, {
        "target_tokens": np.roll(tokens, -1),
        "logprobs": np.full(n, sampler_logprob, np.float32),
        "advantages": np.full(n, advantage, np.float32),
    })


def reference_logprobs(model_dir: Path, data, tensors=None, spec=SPEC) -> list[np.ndarray]:
    """One unpadded HF forward per datum; with `tensors`, loaded the way the sampler loads them."""
    model = load_causal_lm(model_dir, CPU)
    if tensors is not None:
        model = peft.get_peft_model(model, lora_config(spec), adapter_name="v1")
        result = peft.set_peft_model_state_dict(model, tensors, adapter_name="v1")
        assert not result.unexpected_keys
        assert not [key for key in result.missing_keys if "lora_" in key]
    out = []
    with torch.no_grad():
        for datum in data:
            logits = model(input_ids=torch.from_numpy(datum.tokens)[None]).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)  # (N, V)
            targets = torch.from_numpy(datum.inputs["target_tokens"])
            rows = torch.arange(len(datum.tokens))
            out.append((logp[rows, targets] if targets.ndim == 1 else logp[rows[:, None], targets]).numpy())
    return out


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "config",
    [SMALL, TrainerConfig(), TrainerConfig(max_batch_tokens=48, logprob_chunk_positions=7, chunked_head=False)],
    ids=["chunked-micro-batches", "one-batch", "full-logits"],
)
def test_forward_logprobs_match_a_manual_hf_forward_of_the_same_adapter(model_dir, sft_data, config):
    trainer = TorchTrainer(model_dir, CPU, config=config)
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=2)  # B is no longer zero
    tensors = trainer.adapter_tensors("job")
    assert any(key.endswith("lora_B.weight") and tensor.abs().max() > 0 for key, tensor in tensors.items())
    data = sft_data + [with_2d_targets(sft_data[0])]
    result = trainer.forward_backward("job", batch(data, forward_only=True))
    expected = reference_logprobs(model_dir, data, tensors)
    for actual, wanted in zip(result.logprobs, expected):
        assert actual.dtype == np.float32
        assert actual.shape == wanted.shape
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=LOGPROB_ATOL)


def test_fresh_adapter_equals_the_base_model(trainer, model_dir, sft_data):
    trainer.add_adapter("job", SPEC)
    tensors = trainer.adapter_tensors("job")
    assert all(tensor.abs().max() == 0 for key, tensor in tensors.items() if "lora_B" in key)
    result = trainer.forward_backward("job", batch(sft_data, forward_only=True))
    for actual, wanted in zip(result.logprobs, reference_logprobs(model_dir, sft_data)):
        np.testing.assert_allclose(actual, wanted, rtol=0, atol=LOGPROB_ATOL)


def test_loss_is_the_weighted_sum_of_the_returned_logprobs(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    result = trainer.forward_backward("job", batch(sft_data, forward_only=True))
    expected = -sum(float(np.dot(d.inputs["weights"], lp)) for d, lp in zip(sft_data, result.logprobs))
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
    assert result.metrics["tokens:sum"] == sum(int((d.inputs["weights"] != 0).sum()) for d in sft_data)


def test_seeded_adapters_start_identical_and_other_seeds_differ(trainer):
    trainer.add_adapter("first", LoraSpec(rank=4, seed=11))
    trainer.add_adapter("second", LoraSpec(rank=4, seed=11))
    trainer.add_adapter("third", LoraSpec(rank=4, seed=12))
    first, second, third = (trainer.adapter_tensors(n) for n in ("first", "second", "third"))
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], third[key]) for key in first if "lora_A" in key)


# ---------------------------------------------------------------- gradients


def test_gradients_of_two_calls_accumulate_to_those_of_one_call(trainer, sft_data):
    trainer.add_adapter("two-calls", SPEC)
    trainer.add_adapter("one-call", SPEC)
    trainer.forward_backward("two-calls", batch(sft_data[:1]))
    trainer.forward_backward("two-calls", batch(sft_data[1:]))
    trainer.forward_backward("one-call", batch(sft_data))
    two, one = trainer.adapter_gradients("two-calls"), trainer.adapter_gradients("one-call")
    assert set(two) == set(one) == set(trainer.adapter_tensors("one-call"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=GRAD_ATOL)


def test_forward_only_neither_adds_nor_clears_gradients(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    trainer.forward_backward("job", batch(sft_data[:1]))
    before = trainer.adapter_gradients("job")
    trainer.forward_backward("job", batch(sft_data[1:], forward_only=True))
    after = trainer.adapter_gradients("job")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_forward_only_on_a_fresh_adapter_creates_no_gradient(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    trainer.forward_backward("job", batch(sft_data, forward_only=True))
    assert trainer.adapter_gradients("job") == {}


def test_forward_only_returns_what_forward_backward_returns(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    forward = trainer.forward_backward("job", batch(sft_data, forward_only=True))
    backward = trainer.forward_backward("job", batch(sft_data))
    assert forward.metrics == backward.metrics
    assert all(np.array_equal(a, b) for a, b in zip(forward.logprobs, backward.logprobs))


def test_failed_request_leaves_gradients_unchanged(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    trainer.forward_backward("job", batch(sft_data[:1]))
    before = trainer.adapter_gradients("job")
    # Datum 0 is fine and, being longer, runs (and backpropagates) in its own earlier
    # micro-batch; datum 1 has Δ = lp + 1e30 with A = −1, so its ratio overflows to +inf.
    long_tokens = np.concatenate([d.tokens for d in sft_data])
    short_tokens = sft_data[0].tokens
    assert 2 * len(long_tokens) > SMALL.max_batch_tokens
    rl = [rl_datum(long_tokens, sampler_logprob=-0.5, advantage=1.0), rl_datum(short_tokens, -1e30, -1.0)]
    with pytest.raises(BadRequest, match="loss for 'importance_sampling' is not finite"):
        trainer.forward_backward("job", batch(rl, loss_fn="importance_sampling"))
    after = trainer.adapter_gradients("job")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_invalid_request_is_refused_before_any_gradient(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    bad = TrainDatum(sft_data[1].tokens, {"target_tokens": sft_data[1].inputs["target_tokens"][:-1]})
    with pytest.raises(BadRequest, match=r"datum 1: loss_fn_inputs\['target_tokens'\] has shape"):
        trainer.forward_backward("job", batch([sft_data[0], bad]))
    assert trainer.adapter_gradients("job") == {}


@pytest.mark.parametrize(
    "tokens, message",
    [
        (np.array([1, 2, 400]), "datum 0: model_input has token id 400 at position 2; expected ids in [0, 384)"),
        (np.array([], np.int64), "datum 0: model_input is empty; expected at least one token"),
        (np.zeros(1025, np.int64), "datum 0: model_input has 1025 tokens; the model's context is 1024"),
    ],
    ids=["token-out-of-range", "empty", "too-long"],
)
def test_bad_model_input_is_refused(trainer, tokens, message):
    trainer.add_adapter("job", SPEC)
    datum = TrainDatum(tokens, {"target_tokens": np.zeros(len(tokens), np.int64)})
    with pytest.raises(BadRequest) as error:
        trainer.forward_backward("job", batch([datum]))
    assert error.value.detail == message


# ---------------------------------------------------------------- isolation and optimizer


def test_training_one_adapter_leaves_another_untouched(trainer, model_dir, sft_data):
    # Names where one is a prefix of the other, as model ids "<session>:train:<n>" are.
    trainer.add_adapter("s:train:1", SPEC)
    trainer.add_adapter("s:train:10", SPEC)
    trainer.forward_backward("s:train:10", batch(sft_data[:1]))
    tensors_before = trainer.adapter_tensors("s:train:10")
    grads_before = trainer.adapter_gradients("s:train:10")
    train(trainer, "s:train:1", sft_data, steps=2)
    tensors_after = trainer.adapter_tensors("s:train:10")
    grads_after = trainer.adapter_gradients("s:train:10")
    assert all(torch.equal(tensors_before[key], tensors_after[key]) for key in tensors_before)
    assert all(torch.equal(grads_before[key], grads_after[key]) for key in grads_before)
    # Its moments are untouched too: its first step equals that of a trainer that only ever saw it.
    trainer.optim_step("s:train:10", AdamParams(learning_rate=1e-2))
    alone = TorchTrainer(model_dir, CPU, config=SMALL)
    alone.add_adapter("s:train:10", SPEC)
    alone.forward_backward("s:train:10", batch(sft_data[:1]))
    alone.optim_step("s:train:10", AdamParams(learning_rate=1e-2))
    ours, theirs = trainer.adapter_tensors("s:train:10"), alone.adapter_tensors("s:train:10")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


def test_optim_step_without_gradients_changes_nothing(trainer):
    trainer.add_adapter("job", SPEC)
    before = trainer.adapter_tensors("job")
    result = trainer.optim_step("job", AdamParams(learning_rate=0.1, weight_decay=0.1))
    assert result.metrics == {"grad_norm:mean": 0.0, "learning_rate:mean": 0.1}
    after = trainer.adapter_tensors("job")
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert trainer.statistics().optim_steps == 0


def test_optim_step_clears_the_gradients(trainer, sft_data):
    trainer.add_adapter("job", SPEC)
    trainer.forward_backward("job", batch(sft_data))
    trainer.optim_step("job", AdamParams())
    assert trainer.adapter_gradients("job") == {}


def test_sft_on_a_tiny_dataset_halves_the_loss(trainer, sft_data):
    trainer.add_adapter("job", LoraSpec(rank=8, seed=0))
    first = trainer.forward_backward("job", batch(sft_data, forward_only=True)).metrics["loss:sum"]
    losses = []
    for _ in range(40):
        losses.append(train(trainer, "job", sft_data, steps=1)[0])
        if losses[-1] < first / 2:
            break
    assert losses[-1] < first / 2, f"loss went {first:.2f} -> {losses[-1]:.2f} in {len(losses)} steps"


# ---------------------------------------------------------------- checkpoints


def test_save_and_load_state_with_optimizer_continues_like_an_uninterrupted_run(trainer, model_dir, sft_data, tmp_path):
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=2)
    checkpoint = tmp_path / "state"
    checkpoint.mkdir()
    size = trainer.save_state("job", checkpoint)
    files = {"adapter_model.safetensors", "adapter.json", "optimizer.safetensors", "state.json"}
    assert {p.name for p in checkpoint.iterdir()} == files
    assert size == sum(p.stat().st_size for p in checkpoint.iterdir())
    uninterrupted = train(trainer, "job", sft_data, steps=2)
    resumed_trainer = TorchTrainer(model_dir, CPU, config=SMALL)
    resumed_trainer.load_state("resumed", checkpoint, SPEC, with_optimizer=True)
    resumed = train(resumed_trainer, "resumed", sft_data, steps=2)
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6, atol=0)
    assert resumed_trainer.statistics().optim_steps == 4


@pytest.mark.parametrize(
    ("family", "params"), [("adamw", AdamParams(learning_rate=1e-2)), ("dimuon", DimuonParams(learning_rate=1e-2))],
    ids=["adamw", "dimuon"],
)
def test_a_state_snapshot_writes_what_save_state_wrote_at_that_step_after_the_next_one(
    trainer, sft_data, tmp_path, family, params
):
    trainer.add_adapter("job", SPEC, family)
    trainer.forward_backward("job", batch(sft_data))
    trainer.optim_step("job", params)
    saved, copied = tmp_path / "saved", tmp_path / "copied"
    saved.mkdir(), copied.mkdir()
    snapshot = trainer.snapshot_state("job", with_optimizer=True)
    trainer.save_state("job", saved)
    trainer.forward_backward("job", batch(sft_data))  # the next step changes the live tensors, not the copy
    trainer.optim_step("job", params)
    assert write_snapshot(snapshot, copied) == sum(p.stat().st_size for p in saved.iterdir())
    files = {p.name: p.read_bytes() for p in saved.iterdir()}
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == files
    assert len(files) == 4


def test_a_state_snapshot_after_the_optimizer_state_was_loaded_writes_what_save_state_writes(
    trainer, sft_data, tmp_path
):
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=1)
    first, saved, copied = tmp_path / "first", tmp_path / "saved", tmp_path / "copied"
    for directory in (first, saved, copied):
        directory.mkdir()
    trainer.save_state("job", first)
    trainer.snapshot_state("job", with_optimizer=True)  # the snapshot layouts are kept from here
    train(trainer, "job", sft_data, steps=1)
    trainer.load_state("job", first, SPEC, with_optimizer=True)  # new optimizer tensors: the layout is made anew
    snapshot = trainer.snapshot_state("job", with_optimizer=True)
    trainer.save_state("job", saved)
    write_snapshot(snapshot, copied)
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == {p.name: p.read_bytes() for p in saved.iterdir()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_snapshot_on_a_gpu_is_copied_to_the_host_and_writes_what_save_state_wrote(
    model_dir, sft_data, tmp_path
):
    trainer = TorchTrainer(model_dir, torch.device("cuda"), config=SMALL)  # bf16 where the device takes it
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=1)
    saved, copied = tmp_path / "saved", tmp_path / "copied"
    saved.mkdir(), copied.mkdir()
    snapshot = trainer.snapshot_state("job", with_optimizer=True)
    trainer.save_state("job", saved)
    train(trainer, "job", sft_data, steps=1)
    write_snapshot(snapshot, copied)
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == {p.name: p.read_bytes() for p in saved.iterdir()}


def test_load_state_with_optimizer_from_sampler_weights_is_refused(trainer, tmp_path):
    trainer.add_adapter("job", SPEC)
    sampler_weights = tmp_path / "sampler"
    sampler_weights.mkdir()
    lora_io.save_adapter(sampler_weights, trainer.adapter_tensors("job"), SPEC)
    with pytest.raises(BadRequest, match="checkpoint has no optimizer state"):
        trainer.load_state("restored", sampler_weights, SPEC, with_optimizer=True)
    assert not trainer.has_adapter("restored")


def test_load_state_without_optimizer_restores_weights_and_restarts_the_moments(trainer, sft_data, tmp_path):
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=2)
    checkpoint = tmp_path / "state"
    checkpoint.mkdir()
    trainer.save_state("job", checkpoint)
    trainer.load_state("restored", checkpoint, SPEC, with_optimizer=False)
    saved, restored = trainer.adapter_tensors("job"), trainer.adapter_tensors("restored")
    assert all(torch.equal(saved[key], restored[key]) for key in saved)
    assert trainer.statistics().optim_steps == 2  # "job"'s two; "restored" starts at zero


def test_load_state_refuses_a_checkpoint_of_another_rank(trainer, tmp_path):
    trainer.add_adapter("job", SPEC)
    checkpoint = tmp_path / "state"
    checkpoint.mkdir()
    trainer.save_state("job", checkpoint)
    with pytest.raises(BadRequest, match="checkpoint 'state' has LoRA rank=4; the model wants rank=8"):
        trainer.load_state("bigger", checkpoint, LoraSpec(rank=8), with_optimizer=False)
    assert not trainer.has_adapter("bigger")


def test_adapter_tensors_round_trip_through_lora_io(trainer, sft_data, tmp_path):
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=1)
    tensors = trainer.adapter_tensors("job")
    size = lora_io.save_adapter(tmp_path, tensors, SPEC)
    loaded, spec = lora_io.load_adapter(tmp_path)
    assert spec == SPEC
    assert size == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)


def test_adapter_tensors_have_no_adapter_name_and_no_base_weights(trainer):
    trainer.add_adapter("s:train:3", SPEC)
    keys = trainer.adapter_tensors("s:train:3").keys()
    # 2 layers × 7 projections + lm_head, each with lora_A and lora_B.
    assert len(keys) == 2 * (2 * 7 + 1)
    assert all(".lora_A.weight" in key or ".lora_B.weight" in key for key in keys)
    assert not any("s:train:3" in key for key in keys)


# ---------------------------------------------------------------- bookkeeping


def test_adding_an_existing_adapter_is_a_conflict(trainer):
    trainer.add_adapter("job", SPEC)
    with pytest.raises(Conflict, match="adapter 'job' already exists"):
        trainer.add_adapter("job", SPEC)


def test_unknown_adapter_is_not_found(trainer, sft_data):
    with pytest.raises(NotFound, match="no adapter 'ghost' on this trainer"):
        trainer.forward_backward("ghost", batch(sft_data))


def test_dropped_adapter_is_gone_and_others_stay(trainer):
    trainer.add_adapter("a1", SPEC)
    trainer.add_adapter("a2", SPEC)
    trainer.drop_adapter("a1")
    assert trainer.adapter_names() == ["a2"]
    assert not trainer.has_adapter("a1")
    assert trainer.statistics().adapters == 1


def test_statistics_count_calls_tokens_and_steps(model_dir, sft_data):
    trainer = TorchTrainer(model_dir, CPU)
    trainer.add_adapter("job", SPEC)
    train(trainer, "job", sft_data, steps=2)
    stats = trainer.statistics()
    assert (stats.adapters, stats.optim_steps, stats.forward_backward_calls) == (1, 2, 2)
    assert stats.tokens == 2 * sum(len(d.tokens) for d in sft_data)


def test_micro_batches_go_longest_first_within_the_token_budget():
    # Lengths 30 | 12, 10, 5: 2 × 30 > 40 starts a new batch; 3 × 12 = 36 ≤ 40 fits.
    assert plan_micro_batches([5, 30, 10, 12], 40) == [[1], [3, 2, 0]]
    assert plan_micro_batches([50], 40) == [[0]]
