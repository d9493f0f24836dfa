"""Shared-prefix training (gpu/shared_prefix.py, BatchScorer's shared micro-batches).

The pure parts (grouping, packing, planning) are pinned to exact plans. The trainers are
compared with themselves with the feature off (`min_shared_prefix=0`), on GRPO-shaped
requests: two groups of 4 datums, each group sharing a 40-token prompt whose targets weigh
0, completions of 3, 7, 12 and 18 tokens.

Tolerances: both sides are float32 and see the same keys and values at every position; only
the order of reductions differs (attention over a cache, row gathers, gradient sums over a
prefix reached by several suffixes). Log-probabilities: atol 1e-5. Losses and metrics
are sums over ~200 positions (|loss:sum| up to ~500, where one fp32 ulp is 3e-5): atol 1e-5
plus rtol 1e-6.
Gradients: atol 1e-5 plus rtol 1e-5 (the largest full fine-tuning gradients are ~20, where
fp32 rounding of a sum is ~2e-6 each). Weights after 3 AdamW steps at lr 1e-3: atol 1e-5,
as the steps stay far from Adam's sign-of-noise regime (eps 1e-12 would amplify a gradient
that is pure rounding noise; with the prompt weighted 0 no trained element has one here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu import losses
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.scoring import MicroBatch, TrainerConfig, plan_micro_batches, plan_passes
from openrld.gpu.shared_prefix import (
    MAX_GROUP_SIZE,
    PrefixGroup,
    SharedPrefixes,
    cache_supports_sharing,
    find_prefix_groups,
    pack_groups,
    shared_cost,
)
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
LOSSES = tuple(losses.LOSSES)  # every built-in loss
PROMPT = 40
COMPLETIONS = (3, 7, 12, 18)
# Several position chunks, so the prefix rows' targets are gathered across chunks, and room
# for both groups in one shared micro-batch.
SHARED = TrainerConfig(max_batch_tokens=4096, logprob_chunk_positions=7)
UNSHARED = TrainerConfig(max_batch_tokens=4096, logprob_chunk_positions=7, min_shared_prefix=0)
ATOL = 1e-5
METRIC_RTOL = 1e-6
GRAD_RTOL = 1e-5
SPEC = LoraSpec(rank=4, seed=7)
ADAM = AdamParams(learning_rate=1e-3)


def grpo_request(loss: str, seed: int = 0) -> ForwardBackwardBatch:
    """Two groups of 4 datums; each group's prompt is shared, its targets weigh 0 (advantage 0)."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(2):
        prompt = rng.integers(0, 384, PROMPT)
        for n in COMPLETIONS:
            sequence = np.concatenate([prompt, rng.integers(0, 384, n)])
            targets = sequence[1:]
            completion = np.arange(len(targets)) >= PROMPT - 1  # targets that are completion tokens
            inputs = {"target_tokens": targets}
            recorded = None
            if loss == "cross_entropy":
                inputs["weights"] = completion.astype(np.float32)
            else:
                inputs["advantages"] = np.where(completion, rng.normal(), 0.0).astype(np.float32)
                inputs["logprobs"] = np.where(completion, -5.95 + 0.1 * rng.normal(size=len(targets)), 0.0).astype(
                    np.float32
                )
            if loss == "gspo":
                inputs["sequence_ratio_mask"] = completion.astype(np.float32)
            if loss == "stable_reinforce":
                recorded = np.where(completion, inputs["logprobs"], np.nan).astype(np.float32)
            data.append(TrainDatum(tokens=sequence[:-1], inputs=inputs, recorded_logprobs=recorded))
    return ForwardBackwardBatch(data=data, loss_fn=loss, loss_config={}, forward_only=False)


def new_trainer(kind: str, model_dir: Path, config: TrainerConfig) -> TorchTrainer | FullTrainer:
    if kind == "lora":
        trainer: TorchTrainer | FullTrainer = TorchTrainer(model_dir, CPU, config=config)
        trainer.add_adapter("job", SPEC)
    else:
        trainer = FullTrainer(model_dir, CPU, config=config)
        trainer.add_adapter("job", None, "adamw")
    return trainer


def trained(trainer: TorchTrainer | FullTrainer) -> dict[str, torch.nn.Parameter]:
    """The tensors a step trains: the adapter's, or every weight."""
    return trainer._adapters["job"].params if isinstance(trainer, TorchTrainer) else trainer._params


def model(request: pytest.FixtureRequest, arch: str) -> Path:
    return request.getfixturevalue(f"tiny_{arch}")


def assert_same_scores(shared, unshared) -> None:
    assert shared.metrics.keys() == unshared.metrics.keys()
    for key, value in unshared.metrics.items():
        assert shared.metrics[key] == pytest.approx(value, rel=METRIC_RTOL, abs=ATOL), key
    for got, expected in zip(shared.logprobs, unshared.logprobs, strict=True):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


# ------------------------------------------------------------------ grouping (pure)


def prompt_and(prompt: list[int], *completions: list[int]) -> list[np.ndarray]:
    return [np.array(prompt + c) for c in completions]


P40 = list(range(100, 140))


@pytest.mark.parametrize(
    ("tokens", "minimum", "expected"),
    [
        ([np.arange(50), np.arange(50) + 1, np.arange(50) + 2], 32, []),
        (prompt_and(list(range(20)), [1, 2], [3, 4], [5]), 32, []),
        (prompt_and(P40, [1, 2]) + [np.arange(45)], 32, []),
        (prompt_and(P40, [1, 2], [3], [4, 5, 6]), 0, []),
        (
            prompt_and(P40, [1, 2], [3]) + [np.arange(45)] + prompt_and(P40, [7, 8, 9]),
            32,
            [PrefixGroup((0, 1, 3), 40)],
        ),
        # The completions share their first token, so the prefix takes it in.
        (prompt_and(P40, [1, 2], [1, 3], [1, 4, 5]), 32, [PrefixGroup((0, 1, 2), 41)]),
        # A datum that is the prompt alone leaves the prefix one token short, so it keeps a suffix.
        (prompt_and(P40, [], [1, 2], [3, 4]), 32, [PrefixGroup((0, 1, 2), 39)]),
        (
            prompt_and(P40, [1], [2]) + prompt_and(list(range(200, 240)), [3], [4], [5]),
            32,
            [PrefixGroup((0, 1), 40), PrefixGroup((2, 3, 4), 40)],
        ),
    ],
    ids=[
        "no-common-prefix",
        "shorter-than-threshold",
        "group-of-one",
        "feature-off",
        "one-group-among-others",
        "shared-completion-token",
        "datum-equal-to-the-prompt",
        "two-groups",
    ],
)
def test_find_prefix_groups_returns_exact_groups(tokens, minimum: int, expected: list[PrefixGroup]) -> None:
    assert find_prefix_groups(tokens, minimum) == expected


def test_datum_whose_prompt_differs_in_one_token_is_not_shared() -> None:
    tokens = prompt_and(P40, [1, 2], [3], [4, 5], [6])
    changed = tokens[2].copy()
    changed[20] = 999  # shares 20 tokens with the others, above the threshold of 8
    tokens[2] = changed
    # With it, 4 datums would share 20 tokens (saving 3 x 20 = 60 prefix tokens); without it,
    # 3 datums share 40 (saving 2 x 40 = 80): it runs whole.
    assert find_prefix_groups(tokens, 8) == [PrefixGroup((0, 1, 3), 40)]


def test_a_larger_group_on_a_shorter_prefix_wins_when_it_saves_more() -> None:
    # 4 datums share 40 tokens (saving 3 x 40 = 120); 5 share 39 (4 x 39 = 156).
    tokens = prompt_and(P40, [1], [2], [3], [4]) + [np.array(P40[:39] + [7, 8])]
    assert find_prefix_groups(tokens, 32) == [PrefixGroup((0, 1, 2, 3, 4), 39)]


def test_more_datums_than_a_group_holds_make_several_groups() -> None:
    tokens = prompt_and(P40, *([k] for k in range(MAX_GROUP_SIZE + 10)))
    groups = find_prefix_groups(tokens, 32)
    assert sorted((len(g.members), g.prefix_len) for g in groups) == [(10, 40), (MAX_GROUP_SIZE, 40)]
    assert sorted(i for g in groups for i in g.members) == list(range(MAX_GROUP_SIZE + 10))


# ------------------------------------------------------------------ planning (pure)


def test_shared_cost_is_padded_prefixes_plus_padded_suffixes() -> None:
    lengths = [42, 45, 50, 31, 33]
    groups = [PrefixGroup((0, 1, 2), 40), PrefixGroup((3, 4), 30)]
    # 2 prefixes padded to 40, then 5 suffixes padded to the longest, 50 - 40 = 10.
    assert shared_cost(groups, lengths) == 2 * 40 + 5 * 10


def test_pack_groups_keeps_each_micro_batch_within_the_budget() -> None:
    lengths = [42, 45, 50, 43, 44, 101, 102]
    a, b, c = PrefixGroup((0, 1, 2), 40), PrefixGroup((3, 4), 40), PrefixGroup((5, 6), 100)
    # Longest suffix first: a (10), b (4), c (2). a + b costs 2 x 40 + 5 x 10 = 130, within
    # 130; adding c would cost 3 x 100 + 7 x 10 = 370, so c starts its own (100 + 2 x 2).
    assert pack_groups([a, b, c], lengths, 130) == [[a, b], [c]]
    # One token less and a + b is over: each group alone.
    assert pack_groups([a, b, c], lengths, 129) == [[a], [b], [c]]
    assert pack_groups([a, b, c], lengths, 370) == [[a, b, c]]


def test_plan_passes_counts_a_group_as_its_prefix_and_suffixes() -> None:
    tokens = prompt_and(P40, [1] * 10, [2] * 8, [3] * 6, [4] * 4) + [np.arange(30), np.arange(25) + 500]
    # The group: prefix 40, suffixes 10, 8, 6, 4: cost 40 + 4 x 10 = 80, where whole its 4
    # datums cost 4 x 50 = 200; the two others run whole, 2 x 30 = 60 within 80.
    assert plan_passes(tokens, 80, 32) == [
        MicroBatch((4, 5)),
        MicroBatch((0, 1, 2, 3), SharedPrefixes(rows=(0, 0, 0, 0), lengths=(40,))),
    ]


def test_plan_passes_splits_a_group_over_the_budget_and_runs_a_lone_part_whole() -> None:
    tokens = prompt_and(P40, [1] * 10, [2] * 8, [3] * 6)
    # Budget 60 leaves 20 for suffixes: [10, 8] (2 x 10 = 20) share the prefix, [6] runs whole.
    assert plan_passes(tokens, 60, 32) == [
        MicroBatch((2,)),
        MicroBatch((0, 1), SharedPrefixes(rows=(0, 0), lengths=(40,))),
    ]


def test_plan_passes_without_sharing_is_plan_micro_batches() -> None:
    tokens = prompt_and(P40, [1] * 10, [2] * 8, [3] * 6) + [np.arange(30)]
    lengths = [len(t) for t in tokens]
    expected = [MicroBatch(tuple(sorted(part))) for part in plan_micro_batches(lengths, 100)]
    assert plan_passes(tokens, 100, 0) == expected


def test_plan_passes_gives_each_group_its_prefix_row() -> None:
    tokens = prompt_and(P40, [1], [2]) + prompt_and(list(range(200, 236)), [3], [4], [5])
    assert plan_passes(tokens, 4096, 32) == [
        MicroBatch((0, 1, 2, 3, 4), SharedPrefixes(rows=(0, 0, 1, 1, 1), lengths=(40, 36))),
    ]


# ------------------------------------------------------------------ models that step aside


def test_sliding_window_model_does_not_share(tiny_llama: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    assert cache_supports_sharing(config)
    sliding = transformers.MistralConfig(sliding_window=16, **{k: getattr(config, k) for k in ("vocab_size", "hidden_size")})
    assert not cache_supports_sharing(sliding)


def test_a_group_that_activation_checkpointing_takes_runs_whole_with_unshared_results(tiny_llama: Path) -> None:
    request = grpo_request("importance_sampling")
    checkpointed = TorchTrainer(tiny_llama, CPU, config=TrainerConfig(activation_budget_bytes=1))
    checkpointed.add_adapter("job", SPEC)
    got = checkpointed.forward_backward("job", request)
    tokens = [np.asarray(datum.tokens) for datum in request.data]
    with torch.enable_grad():
        plan = checkpointed._passes.scorer._plan(tokens)
    assert [micro.shared for micro in plan] == [None] * len(plan)
    assert_same_scores(got, new_trainer("lora", tiny_llama, UNSHARED).forward_backward("job", request))


def test_a_group_under_the_activation_budget_still_shares_its_prefix(tiny_llama: Path) -> None:
    request = grpo_request("importance_sampling")
    trainer = TorchTrainer(tiny_llama, CPU, config=TrainerConfig())  # the CPU's defaults: 2 GiB, micro-batches of 512 MiB
    trainer.add_adapter("job", SPEC)
    trainer.forward_backward("job", request)
    tokens = [np.asarray(datum.tokens) for datum in request.data]
    with torch.enable_grad():
        plan = trainer._passes.scorer._plan(tokens)
    assert [micro.shared is not None for micro in plan] == [True]


def test_smollm2_shares_prefixes_though_its_hidden_states_reach_tens(smollm2_conversion: Path) -> None:
    """SmolLM2's hidden states reach ~42; the two passes' summation orders then differ by up to
    ~5e-4 on a near-zero element, 1e-5 of the scale, which a fixed atol of 1e-4 refused."""
    trainer = TorchTrainer(smollm2_conversion, CPU, config=SHARED)
    assert trainer._passes.scorer._can_share_prefixes() is True


# ------------------------------------------------------------------ trainers: same results


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("loss", LOSSES)
def test_shared_request_scores_and_gradients_equal_unshared(
    request: pytest.FixtureRequest, loss: str, arch: str, kind: str
) -> None:
    model_dir = model(request, arch)
    batch = grpo_request(loss)
    shared, unshared = new_trainer(kind, model_dir, SHARED), new_trainer(kind, model_dir, UNSHARED)
    assert_same_scores(shared.forward_backward("job", batch), unshared.forward_backward("job", batch))
    assert shared._passes.scorer._shares_prefixes is True  # it did share
    expected = trained(unshared)
    for name, param in trained(shared).items():
        assert param.grad is not None and expected[name].grad is not None, name
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=GRAD_RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("loss", LOSSES)
def test_three_shared_steps_reach_the_unshared_weights(
    request: pytest.FixtureRequest, loss: str, arch: str, kind: str
) -> None:
    model_dir = model(request, arch)
    shared, unshared = new_trainer(kind, model_dir, SHARED), new_trainer(kind, model_dir, UNSHARED)
    for step in range(3):
        batch = grpo_request(loss, seed=step)
        for trainer in (shared, unshared):
            trainer.forward_backward("job", batch)
            trainer.optim_step("job", ADAM)
    expected = trained(unshared)
    for name, param in trained(shared).items():
        torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=0, atol=ATOL, msg=name)


def test_forward_only_shares_and_scores_as_unshared(tiny_qwen3: Path) -> None:
    request = grpo_request("cross_entropy")
    forward = ForwardBackwardBatch(data=request.data, loss_fn="cross_entropy", loss_config={}, forward_only=True)
    shared = new_trainer("lora", tiny_qwen3, SHARED).forward_backward("job", forward)
    assert_same_scores(shared, new_trainer("lora", tiny_qwen3, UNSHARED).forward_backward("job", forward))


def test_full_logits_path_scores_and_gradients_equal_unshared(tiny_llama: Path) -> None:
    # Without the chunked output layer, both passes return the model's own logits.
    config = TrainerConfig(chunked_head=False)
    batch = grpo_request("ppo")
    shared, unshared = new_trainer("full", tiny_llama, config), new_trainer("full", tiny_llama, UNSHARED)
    assert_same_scores(shared.forward_backward("job", batch), unshared.forward_backward("job", batch))
    expected = trained(unshared)
    for name, param in trained(shared).items():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=GRAD_RTOL, atol=ATOL, msg=name)


def test_groups_across_requests_share_and_score_as_unshared(tiny_llama: Path) -> None:
    # The same prompts in two requests of different losses: a group spans both requests.
    batches = [grpo_request("cross_entropy"), grpo_request("cispo")]
    shared = new_trainer("lora", tiny_llama, SHARED).forward_backward_many("job", batches)
    unshared = new_trainer("lora", tiny_llama, UNSHARED).forward_backward_many("job", batches)
    for got, expected in zip(shared, unshared, strict=True):
        assert_same_scores(got, expected)
