"""Windowed attention for sliding layers (`gpu/long_attention.py`) against transformers' sdpa path.

Each family with sliding layers is built tiny (`tiny_models`, window 8) and loaded twice, once
as transformers loads it (sdpa) and once switched to `ATTENTION`. Sequences of 50 tokens cross
the window six times, so a sliding layer runs 7 query blocks of 8 rows, the last one partial.
Float32 throughout, only summation order differs: logits agree within atol 1e-5, the tolerance
test_trainer_families.py uses; a gradient within 1e-5 of its own largest element (rounding grows
with the magnitude: the test losses' gradients reach a few hundred) plus rtol 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from openrld.batches import ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.long_attention import ATTENTION, use_long_attention
from openrld.gpu.tiny_models import SLIDING_WINDOW
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
SLIDING_FAMILIES = ("gemma3", "gemma4")
TOKENS = 50  # > 6 windows of 8
ATOL = 1e-5
GRAD_ATOL = 3e-5  # of the gradient's largest entry
GRAD_RTOL = 1e-5


def load(model_dir: Path, long: bool) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if long:
        assert use_long_attention(model)
    return model


def batch_ids(rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(3, 300, (rows, TOKENS), generator=generator)


def logits_and_grads(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits at the real positions, and every weight's gradient of a fixed weighted sum of them."""
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[real]  # (P, V)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_same_as_sdpa(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    expected_logits, expected_grads = logits_and_grads(load(model_dir, long=False), ids, mask)
    logits, grads = logits_and_grads(load(model_dir, long=True), ids, mask)
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close_grad(grad, expected_grads[name], name)


def assert_close_grad(grad: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # A weight's gradient sums over every position, in another order in each path: Gemma 4's
    # per-layer input gate (largest entry ~100) came out 1.1e-5 of its scale apart on one machine.
    scale = float(expected.abs().max())
    torch.testing.assert_close(grad, expected, atol=GRAD_ATOL * max(scale, 1.0), rtol=GRAD_RTOL, msg=name)


def test_only_the_families_with_sliding_layers_are_switched(family_dirs: dict[str, Path]) -> None:
    switched = {arch for arch, model_dir in family_dirs.items() if use_long_attention(load(model_dir, long=False))}
    assert switched == set(SLIDING_FAMILIES)


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
def test_one_unpadded_datum_matches_sdpa_forward_and_gradients(family_dirs: dict[str, Path], arch: str) -> None:
    assert_same_as_sdpa(family_dirs[arch], batch_ids(1), None)


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
def test_a_right_padded_batch_matches_sdpa_at_its_real_positions(family_dirs: dict[str, Path], arch: str) -> None:
    mask = torch.ones(3, TOKENS, dtype=torch.long)
    mask[1, 37:] = 0  # a datum of 37 tokens padded to 50
    mask[2, 5:] = 0  # one shorter than the window
    assert_same_as_sdpa(family_dirs[arch], batch_ids(3), mask)


@pytest.mark.parametrize("arch", SLIDING_FAMILIES)
def test_a_left_padded_batch_takes_the_dense_mask_and_matches_sdpa(family_dirs: dict[str, Path], arch: str) -> None:
    mask = torch.ones(2, TOKENS, dtype=torch.long)
    mask[1, :13] = 0  # padding before real tokens: causal attention alone would reach it
    assert_same_as_sdpa(family_dirs[arch], batch_ids(2), mask)


def test_no_tensor_kept_for_backward_grows_with_tokens_squared(family_dirs: dict[str, Path]) -> None:
    # Under sdpa, the 400 × 400 mask and 4 heads of 400 × 400 attention weights are kept;
    # windowed, the largest is a (1, 400, 128) MLP activation, and blocks of 8 × 15 scores.
    tokens = 400
    largest = {}
    for long in (False, True):
        sizes = [0]

        def pack(tensor: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(tensor.numel())
            return tensor

        model = load(family_dirs["gemma3"], long)
        ids = torch.arange(tokens)[None] % 300 + 3
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model.get_decoder()(input_ids=ids, use_cache=False)
        largest[long] = max(sizes)
    assert largest[False] >= tokens * tokens
    assert largest[True] < tokens * tokens // 2


def test_the_trainers_load_their_sliding_models_with_windowed_attention(family_dirs: dict[str, Path]) -> None:
    lora = TorchTrainer(family_dirs["gemma3"], CPU)
    full = FullTrainer(family_dirs["gemma3"], CPU)
    plain = TorchTrainer(family_dirs["llama"], CPU)
    implementations = [t._model.config._attn_implementation for t in (lora, full, plain)]
    assert implementations == [ATTENTION, ATTENTION, "sdpa"]


def test_a_lora_step_on_a_long_datum_matches_sdpa(family_dirs: dict[str, Path]) -> None:
    tokens = np.arange(6 * SLIDING_WINDOW + 1, dtype=np.int64) % 300 + 3
    datum = TrainDatum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
    batch = ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False)
    results = []
    for long in (True, False):
        trainer = TorchTrainer(family_dirs["gemma3"], CPU)
        if not long:
            trainer._model.set_attn_implementation("sdpa")
        trainer.add_adapter("a", LoraSpec(rank=4, seed=3))
        lp = trainer.forward_backward("a", batch).logprobs[0]
        results.append((lp, trainer.adapter_gradients("a")))
    (lp, grads), (expected_lp, expected_grads) = results
    np.testing.assert_allclose(lp, expected_lp, atol=ATOL, rtol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close_grad(grad, expected_grads[name], name)
