"""Which engines hold which families (openrld/model_families.py): pure, table-driven."""

from __future__ import annotations

import pytest

from openrld.errors import BadRequest
from openrld.model_families import FAMILIES, Engine, check_engines, family_of, job_engines, refusal

ALL_ENGINES = tuple(Engine)
MOE = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM")


@pytest.mark.parametrize("arch", [arch for family in FAMILIES for arch in family.architectures])
@pytest.mark.parametrize("engine", ALL_ENGINES, ids=[e.name for e in ALL_ENGINES])
def test_every_listed_family_is_held_by_every_engine(arch: str, engine: Engine) -> None:
    assert refusal("m", arch, engine) is None


@pytest.mark.parametrize(
    "arch", ["Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
             "T5ForConditionalGeneration"],
)
@pytest.mark.parametrize("engine", ALL_ENGINES, ids=[e.name for e in ALL_ENGINES])
def test_a_multimodal_or_encoder_decoder_checkpoint_is_refused_by_every_engine_naming_both(arch: str, engine: Engine) -> None:
    why = refusal("google/gemma-x", arch, engine)
    assert why is not None
    assert why.startswith(f"base_model 'google/gemma-x' ({arch}, {arch}): {engine.value} holds decoder-only")


@pytest.mark.parametrize(
    ("engine", "refused"),
    [
        (Engine.LORA_TRAINER, False), (Engine.FULL_TRAINER, False), (Engine.TORCH_SAMPLER, False),
        (Engine.VLLM_SAMPLER, True), (Engine.AUTOMODEL_TRAINER, True),
    ],
    ids=lambda v: v.name if isinstance(v, Engine) else str(v),
)
def test_an_unlisted_causal_lm_is_held_by_the_torch_engines_only(engine: Engine, refused: bool) -> None:
    why = refusal("m", "MambaForCausalLM", engine)
    assert (why is not None) is refused
    if refused:
        assert why == f"base_model 'm' (MambaForCausalLM, MambaForCausalLM): {engine.value} is tested on " + ", ".join(
            f.name for f in FAMILIES
        ) + " only; train this model with the pytorch engines"


@pytest.mark.parametrize("arch", MOE)
def test_automodel_refuses_a_moe_lora_that_trains_the_mlp_and_holds_one_that_freezes_it(arch: str) -> None:
    why = refusal("m", arch, Engine.AUTOMODEL_TRAINER, trains_mlp=True)
    assert why is not None and "cannot train" in why and "train_mlp=False" in why
    assert refusal("m", arch, Engine.AUTOMODEL_TRAINER, trains_mlp=False) is None
    assert refusal("m", arch, Engine.LORA_TRAINER, trains_mlp=True) is None  # the pytorch trainer trains them


def test_check_engines_raises_the_first_refusal_as_a_400_on_base_model() -> None:
    with pytest.raises(BadRequest) as refused:
        check_engines("m", "Gemma3ForConditionalGeneration", [Engine.LORA_TRAINER, Engine.VLLM_SAMPLER])
    assert (refused.value.status, refused.value.key) == (400, "base_model")
    assert Engine.LORA_TRAINER.value in str(refused.value)


TORCH, VLLM = Engine.TORCH_SAMPLER, Engine.VLLM_SAMPLER


@pytest.mark.parametrize(
    ("full", "automodel", "trainer_image", "sampler_image", "node_sampler", "expected"),
    [
        (False, False, False, False, TORCH, [Engine.LORA_TRAINER, TORCH]),
        (False, False, False, False, VLLM, [Engine.LORA_TRAINER, VLLM]),
        (True, False, False, False, VLLM, [Engine.FULL_TRAINER, TORCH]),  # full jobs sample with torch
        (False, True, False, False, VLLM, [Engine.AUTOMODEL_TRAINER, VLLM]),
        (True, True, False, False, VLLM, [Engine.AUTOMODEL_TRAINER, TORCH]),
        (False, False, True, False, VLLM, [VLLM]),
        (False, False, False, True, VLLM, [Engine.LORA_TRAINER]),
    ],
    ids=["lora", "lora-vllm-node", "full", "automodel-lora", "automodel-full", "trainer-image", "sampler-image"],
)
def test_job_engines_follow_the_settings(
    full: bool, automodel: bool, trainer_image: bool, sampler_image: bool, node_sampler: Engine, expected: list[Engine]
) -> None:
    assert job_engines(
        is_full=full, is_automodel=automodel, trainer_image=trainer_image, sampler_image=sampler_image,
        lora_sampler=node_sampler,
    ) == expected


def test_each_family_is_found_by_its_architecture() -> None:
    assert [family_of(f.architectures[0]) for f in FAMILIES] == list(FAMILIES)
    assert family_of("Gemma3ForConditionalGeneration") is None


def test_a_config_without_architectures_is_left_to_transformers_on_the_torch_engines() -> None:
    # The catalog names such a model by its model_type; AutoModelForCausalLM resolves that.
    assert refusal("m", "llama", Engine.LORA_TRAINER) is None
    assert refusal("m", "llama", Engine.VLLM_SAMPLER) is not None
