"""The trainers across model families: what LoRA wraps, that SFT learns, shared prefixes.

Each family's tiny random build (`tiny_models.FAMILIES`) is made once for the module. The
LoRA targets are pinned to exact module counts per family (the tiny builds have 2 layers, or
4 where a family mixes layer kinds). Shared-prefix training is compared with itself off, as
in test_shared_prefix.py, with the same tolerances (float32, only reduction order differs):
log-probabilities atol 1e-5, gradients atol 1e-5 plus rtol 1e-5.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

# The same GRPO-shaped request and trainers (LoraSpec(rank=4, seed=7), or AdamW on every weight).
from test_shared_prefix import grpo_request, new_trainer, trained

from openrld.autosave import write_snapshot
from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu import lora_addmm, packed_linear
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.scoring import TrainerConfig
from openrld.gpu.shared_prefix import cache_supports_sharing
from openrld.gpu.tiny_models import FAMILIES
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=7)
SHARED = TrainerConfig(max_batch_tokens=4096, logprob_chunk_positions=7)
UNSHARED = TrainerConfig(max_batch_tokens=4096, logprob_chunk_positions=7, min_shared_prefix=0)
ATOL = 1e-5
GRAD_RTOL = 1e-5
TEXT = "User: what is two plus two? Assistant: four. The quick brown fox jumps over the lazy dog. Hello world!"

# What peft wraps for LoraSpec(train_attn, train_mlp) besides lm_head: module name -> count.
# "experts" and "base_layer" are the two lora.ParamWrapper of a MoE layer's 3-D expert
# tensors (down_proj outside, gate_up_proj inside).
DENSE = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 2, "up_proj": 2, "down_proj": 2}
LINEAR_ATTENTION = {"in_proj_qkv": 3, "in_proj_z": 3, "out_proj": 3, "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1}
WRAPPED = {
    "llama": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    "mistral": DENSE,
    "olmo2": DENSE,
    "phi3": {"qkv_proj": 2, "o_proj": 2, "gate_up_proj": 2, "down_proj": 2},
    "gemma3": dict.fromkeys(DENSE, 4),
    # Layers 2 and 3 reuse the KV of earlier layers (num_kv_shared_layers=2): no k/v of their own.
    "gemma4": dict.fromkeys(DENSE, 4) | {"k_proj": 2, "v_proj": 2},
    "qwen3_5": LINEAR_ATTENTION | {"gate_proj": 4, "up_proj": 4, "down_proj": 4},
    "qwen3_moe": {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 2, "experts": 2, "base_layer": 2},
    # Every layer is MoE with a shared expert (gate/up/down) beside the routed ones.
    "qwen3_5_moe": LINEAR_ATTENTION | {"gate_proj": 4, "up_proj": 4, "down_proj": 4, "experts": 4, "base_layer": 4},
}
MOE = ("qwen3_moe", "qwen3_5_moe")
# Families whose cache is one growing DynamicLayer per layer; the others have sliding-window
# layers (Gemma 3 and 4) or Gated DeltaNet's recurrent state (Qwen3.5), and train unshared.
SHARES_PREFIXES = {"llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3", "qwen3_moe"}


@pytest.fixture(scope="module")
def sft_batch(family_dirs: dict[str, Path]) -> ForwardBackwardBatch:
    """One datum predicting every next token of TEXT (the families share the tokenizer)."""
    ids = np.array(transformers.AutoTokenizer.from_pretrained(family_dirs["llama"])(TEXT)["input_ids"], np.int64)
    datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def wrapped_modules(trainer: TorchTrainer) -> dict[str, int]:
    assert trainer._peft is not None
    return dict(
        collections.Counter(
            name.rsplit(".", 1)[-1]
            for name, module in trainer._peft.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer)
        )
    )


def sft_losses(trainer: TorchTrainer | FullTrainer, batch: ForwardBackwardBatch, lr: float, steps: int = 4) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(trainer.forward_backward("job", batch).metrics["loss:sum"])
        trainer.optim_step("job", AdamParams(learning_rate=lr))
    return losses


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_wraps_each_familys_attention_and_mlp_modules(family_dirs: dict[str, Path], family: str) -> None:
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", SPEC)
    assert wrapped_modules(trainer) == WRAPPED[family] | {"lm_head": 1}


@pytest.mark.parametrize("family", MOE)
def test_train_mlp_false_leaves_every_expert_frozen(family_dirs: dict[str, Path], family: str) -> None:
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", LoraSpec(rank=4, seed=7, train_mlp=False))
    assert not any(".experts." in key for key in trainer.adapter_tensors("job"))
    assert "experts" not in wrapped_modules(trainer)


@pytest.mark.parametrize("family", MOE)
def test_experts_get_gradients_under_train_mlp(
    family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str
) -> None:
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", LoraSpec(rank=4, seed=7, train_attn=False))
    trainer.forward_backward("job", sft_batch)
    grads = trainer.adapter_gradients("job")
    # lora_B starts at zero, so lora_A's gradient is zero on step one; lora_B's is not.
    experts = [key for key in grads if ".experts." in key and ".lora_B." in key]
    assert len(experts) == 2 * WRAPPED[family]["experts"]  # down_proj's and gate_up_proj's, per layer
    assert all(float(grads[key].abs().sum()) > 0 for key in experts)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_sft_loss_falls(family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str) -> None:
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", LoraSpec(rank=4, seed=7, train_unembed=True))
    losses = sft_losses(trainer, sft_batch, lr=5e-3)
    # A random model starts near ln(vocab) per token (38 tokens x ln 384 ~ 226); 4 steps at
    # lr 5e-3 take every family below 90% of that, falling at every step (measured: 75% to
    # 84%; at 1e-2 some overshoot on the fourth step).
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("family", FAMILIES)
def test_full_sft_loss_falls(family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str) -> None:
    trainer = FullTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", None, "adamw")
    losses = sft_losses(trainer, sft_batch, lr=1e-3)
    # Measured: 4 steps at lr 1e-3 take every family to 86%-92% of its first loss.
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_training_shares_only_where_the_cache_grows(family_dirs: dict[str, Path], family: str) -> None:
    config = transformers.AutoConfig.from_pretrained(family_dirs[family])
    assert cache_supports_sharing(config) is (family in SHARES_PREFIXES)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_scores_and_gradients_equal_unshared(family_dirs: dict[str, Path], family: str, kind: str) -> None:
    """Families that share get the unshared results; those that step aside run unshared."""
    batch = grpo_request("importance_sampling")
    shared, unshared = (new_trainer(kind, family_dirs[family], config) for config in (SHARED, UNSHARED))
    got, expected = shared.forward_backward("job", batch), unshared.forward_backward("job", batch)
    assert shared._passes.scorer._shares_prefixes is (family in SHARES_PREFIXES)
    for a, b in zip(got.logprobs, expected.logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    reference = trained(unshared)
    for name, param in trained(shared).items():
        assert param.grad is not None and reference[name].grad is not None, name
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=GRAD_RTOL, atol=ATOL, msg=name)



@pytest.mark.parametrize("onednn", [False, True], ids=["autograd", "onednn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_lora_linear_adds_its_term_in_one_addmm_with_pefts_scores_and_gradients(
    family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str, onednn: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`gpu/lora_addmm.py` against peft's own forward: a trainer whose linears are given their
    class's forward back. The tiny models' layers are below oneDNN's threshold; `onednn` lowers
    it so that every one of them runs as the oneDNN node."""
    products = []  # oneDNN's products run, by any trainer
    if onednn:
        monkeypatch.setattr(lora_addmm, "MIN_ONEDNN_WORK", 1)
        monkeypatch.setattr(lora_addmm, "ONEDNN_TRAINS", True)  # whoever made this machine's CPU
        linear = packed_linear.linear
        monkeypatch.setattr(packed_linear, "linear", lambda *args: products.append(1) or linear(*args))
    fused, own = (new_trainer("lora", family_dirs[family], UNSHARED) for _ in range(2))
    for trainer in (fused, own):  # B is zero at creation: a step makes the LoRA term matter
        sft_losses(trainer, sft_batch, lr=5e-3, steps=1)
    linears = [m for m in own._model.modules() if isinstance(m, peft.tuners.lora.Linear)]
    for module in linears:
        module.__dict__.pop("forward")
    got, expected = fused.forward_backward("job", sft_batch), own.forward_backward("job", sft_batch)
    x = torch.zeros(1, 1)
    assert [lora_addmm._plain_adapter(m, x) for m in fused._model.modules()
            if isinstance(m, peft.tuners.lora.Linear)] == ["job"] * len(linears)
    assert bool(products) is onednn
    np.testing.assert_allclose(got.logprobs[0], expected.logprobs[0], rtol=0, atol=ATOL)
    reference = trained(own)
    for name, param in trained(fused).items():
        # An element of a gradient is a sum over tokens of terms up to the tensor's largest size
        # (Gemma 4's lora_B up to ~65), summed in another order here: rounding at that scale.
        scale = float(reference[name].grad.abs().max())
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=0, atol=ATOL + GRAD_RTOL * scale, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_exported_adapter_loads_in_peft_with_the_trainers_logprobs(
    family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str, tmp_path: Path
) -> None:
    """The Hugging Face PEFT export names the experts as target_parameters, so peft loads
    them back: the same float32 forward, compared at ATOL."""
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", SPEC)
    sft_losses(trainer, sft_batch, lr=5e-3, steps=2)
    scored = ForwardBackwardBatch(data=sft_batch.data, loss_fn="cross_entropy", loss_config={}, forward_only=True)
    expected = trainer.forward_backward("job", scored).logprobs[0]
    trainer.export_adapter("job", tmp_path, str(family_dirs[family]))
    base = transformers.AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    datum = sft_batch.data[0]
    with torch.no_grad():
        logits = loaded(input_ids=torch.as_tensor(datum.tokens)[None]).logits[0].float()  # (T, V)
    targets = torch.as_tensor(datum.inputs["target_tokens"])
    got = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0].numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_auto_saves_state_snapshot_writes_what_save_state_writes(
    family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str, tmp_path: Path
) -> None:
    # The snapshot keeps each file's layout from one step to the next (MoE experts' 3-D adapters,
    # Gemma 4's layers without k/v of their own among them): the second one, after a step, is the
    # one that reuses it.
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("job", SPEC)
    sft_losses(trainer, sft_batch, lr=5e-3, steps=1)
    trainer.snapshot_state("job", with_optimizer=True)
    sft_losses(trainer, sft_batch, lr=5e-3, steps=1)
    snapshot = trainer.snapshot_state("job", with_optimizer=True)
    saved, copied = tmp_path / "saved", tmp_path / "copied"
    saved.mkdir(), copied.mkdir()
    trainer.save_state("job", saved)
    write_snapshot(snapshot, copied)
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == {p.name: p.read_bytes() for p in saved.iterdir()}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_ended_jobs_adapter_leaves_every_familys_model_and_the_other_job_trains_on(
    family_dirs: dict[str, Path], sft_batch: ForwardBackwardBatch, family: str
) -> None:
    trainer = TorchTrainer(family_dirs[family], CPU)
    trainer.add_adapter("ended", SPEC)
    trainer.add_adapter("job", LoraSpec(rank=4, seed=7, train_unembed=True))  # test_lora_sft_loss_falls's
    trainer.drop_adapter("ended")
    assert trainer._peft is not None
    still_held = [name for name, _ in trainer._peft.named_parameters() if ".ended." in name]
    losses = sft_losses(trainer, sft_batch, lr=5e-3)
    assert (trainer.adapter_names(), still_held, losses[-1] < 0.9 * losses[0]) == (["job"], [], True), losses
