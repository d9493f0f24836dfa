"""openrl.* job settings (openrld/settings.py)."""

from __future__ import annotations

import pytest

from openrld.errors import BadRequest, NotSupportedYet, ServerError
from openrld.settings import (
    FineTuningType,
    JobSettings,
    WeightSync,
    parse_settings,
    require_supported,
    settings_from_dict,
    settings_json_schema,
    settings_to_dict,
)

ALL_KEYS = (
    "fine_tuning_type",
    "weight_sync",
    "exclusive",
    "trainer_backend",
    "trainer_gpus",
    "trainer_cp",
    "sampler_replicas",
    "sampler_backend",
    "autosave_steps",
)


def test_no_settings_gives_the_defaults() -> None:
    settings, own = parse_settings([], {}, {})
    assert settings == JobSettings(
        fine_tuning_type=FineTuningType.LORA,
        weight_sync=WeightSync.DELTA,
        exclusive=False,
        trainer_backend="pytorch",
        trainer_gpus=1,
        trainer_cp=1,
        sampler_replicas=1,
        sampler_backend="node",
        autosave_steps=None,
    )
    assert own == {}


@pytest.mark.parametrize(
    ("tags", "session_metadata", "model_metadata", "replicas"),
    [
        (["openrl.sampler_replicas=2"], {}, {}, 2),
        (["openrl.sampler_replicas=2"], {"openrl.sampler_replicas": "3"}, {}, 3),
        (["openrl.sampler_replicas=2"], {"openrl.sampler_replicas": "3"}, {"openrl.sampler_replicas": "4"}, 4),
        (["openrl.sampler_replicas=2"], {}, {"openrl.sampler_replicas": "4"}, 4),
        ([], {"openrl.sampler_replicas": "3"}, {"openrl.sampler_replicas": "4"}, 4),
    ],
    ids=["tags-alone", "session-over-tags", "model-over-all", "model-over-tags", "model-over-session"],
)
def test_stronger_source_wins(
    tags: list[str], session_metadata: dict[str, str], model_metadata: dict[str, str], replicas: int
) -> None:
    settings, _ = parse_settings(tags, session_metadata, model_metadata)
    assert settings.sampler_replicas == replicas


def test_sources_merge_per_key() -> None:
    settings, _ = parse_settings(
        ["openrl.exclusive=true"], {"openrl.sampler_replicas": "3"}, {"openrl.trainer_backend": "automodel"}
    )
    assert (settings.exclusive, settings.sampler_replicas, settings.trainer_backend) == (True, 3, "automodel")


def test_client_metadata_is_returned_untouched_model_over_session() -> None:
    _, own = parse_settings(
        ["team=ignored", "openrl.exclusive=true"],
        {"team": "rl", "note": " keep  spaces ", "openrl.sampler_replicas": "2"},
        {"team": "sql", "OPENRL.x": "not ours"},
    )
    assert own == {"team": "sql", "note": " keep  spaces ", "OPENRL.x": "not ours"}


def test_tags_without_the_prefix_are_ignored() -> None:
    settings, own = parse_settings(["experiment-7", "exclusive=true", ""], {}, {})
    assert (settings, own) == (JobSettings(), {})


def test_tag_surrounding_whitespace_is_stripped() -> None:
    settings, _ = parse_settings([" openrl.exclusive=true "], {}, {})
    assert settings.exclusive is True


@pytest.mark.parametrize(
    ("key", "value", "detail"),
    [
        ("fine_tuning_type", "qlora", "openrl.fine_tuning_type: expected 'lora' or 'full', got 'qlora'"),
        ("fine_tuning_type", "LoRA", "openrl.fine_tuning_type: expected 'lora' or 'full', got 'LoRA'"),
        ("weight_sync", "fast", "openrl.weight_sync: expected 'full' or 'delta', got 'fast'"),
        ("exclusive", "yes", "openrl.exclusive: expected 'true' or 'false', got 'yes'"),
        ("exclusive", "True", "openrl.exclusive: expected 'true' or 'false', got 'True'"),
        ("exclusive", "1", "openrl.exclusive: expected 'true' or 'false', got '1'"),
        (
            "trainer_backend",
            "tensorflow",
            "openrl.trainer_backend: expected 'pytorch', 'automodel' or a container image reference "
            "containing '/', got 'tensorflow'",
        ),
        (
            "trainer_backend",
            "ghcr.io/org/img;rm -rf",
            "openrl.trainer_backend: expected 'pytorch', 'automodel' or a container image reference "
            "containing '/', got 'ghcr.io/org/img;rm -rf'",
        ),
        ("trainer_gpus", "0", "openrl.trainer_gpus: expected an integer from 1 to 64, got '0'"),
        ("trainer_gpus", "65", "openrl.trainer_gpus: expected an integer from 1 to 64, got '65'"),
        ("trainer_gpus", "-1", "openrl.trainer_gpus: expected an integer from 1 to 64, got '-1'"),
        ("trainer_gpus", "2.0", "openrl.trainer_gpus: expected an integer from 1 to 64, got '2.0'"),
        ("trainer_gpus", " 2", "openrl.trainer_gpus: expected an integer from 1 to 64, got ' 2'"),
        ("trainer_gpus", "", "openrl.trainer_gpus: expected an integer from 1 to 64, got ''"),
        ("trainer_cp", "two", "openrl.trainer_cp: expected an integer from 1 to 8, got 'two'"),
        ("sampler_replicas", "16", "openrl.sampler_replicas: expected an integer from 1 to 8, got '16'"),
    ],
    ids=[
        "type-unknown", "type-wrong-case", "sync-unknown", "bool-yes", "bool-capital", "bool-digit",
        "backend-unknown", "backend-shell-chars", "gpus-zero", "gpus-nine", "gpus-negative", "gpus-float",
        "gpus-space", "gpus-empty", "cp-word", "replicas-sixteen",
    ],
)  # fmt: skip
def test_bad_value_is_400_naming_the_key(key: str, value: str, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings([], {}, {f"openrl.{key}": value})
    assert (excinfo.value.detail, excinfo.value.key, excinfo.value.status) == (detail, f"openrl.{key}", 400)


def test_bad_value_in_a_tag_is_refused_like_metadata() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings(["openrl.weight_sync=fast"], {}, {})
    assert excinfo.value.detail == "openrl.weight_sync: expected 'full' or 'delta', got 'fast'"


def test_bad_value_is_refused_even_when_a_stronger_source_overrides_it() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings(["openrl.sampler_replicas=many"], {}, {"openrl.sampler_replicas": "2"})
    assert excinfo.value.detail == "openrl.sampler_replicas: expected an integer from 1 to 8, got 'many'"


def test_non_string_value_is_refused_saying_strings_are_expected() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings([], {"openrl.trainer_gpus": 2}, {})  # type: ignore[dict-item]
    assert excinfo.value.detail == "openrl.trainer_gpus: expected a string, an integer from 1 to 64, got 2"


@pytest.mark.parametrize(
    ("tags", "session_metadata", "model_metadata", "full_key"),
    [
        ([], {}, {"openrl.colour": "red"}, "openrl.colour"),
        ([], {"openrl.colour": "red"}, {}, "openrl.colour"),
        (["openrl.colour=red"], {}, {}, "openrl.colour"),
        ([], {}, {"openrl.": "red"}, "openrl."),
    ],
    ids=["model-metadata", "session-metadata", "tag", "empty-key"],
)
def test_unknown_openrl_key_is_400_naming_the_key(
    tags: list[str], session_metadata: dict[str, str], model_metadata: dict[str, str], full_key: str
) -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings(tags, session_metadata, model_metadata)
    assert excinfo.value.detail == (
        f"{full_key}: unknown setting; known settings are openrl.fine_tuning_type, openrl.weight_sync, "
        "openrl.exclusive, openrl.trainer_backend, openrl.trainer_gpus, openrl.trainer_cp, openrl.sampler_replicas, "
        "openrl.sampler_backend, openrl.autosave_steps"
    )
    assert excinfo.value.key == full_key


def test_tag_without_a_value_is_refused() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings(["openrl.exclusive"], {}, {})
    assert (excinfo.value.detail, excinfo.value.key) == (
        "tag 'openrl.exclusive': expected 'openrl.exclusive=<value>'",
        "openrl.exclusive",
    )


def test_same_key_twice_in_tags_with_different_values_is_refused() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings(["openrl.sampler_replicas=2", "openrl.sampler_replicas=3"], {}, {})
    assert excinfo.value.detail == "openrl.sampler_replicas: given twice in tags with different values, '2' and '3'"


def test_same_key_twice_in_tags_with_one_value_is_accepted() -> None:
    settings, _ = parse_settings(["openrl.sampler_replicas=2", "openrl.sampler_replicas=2"], {}, {})
    assert settings.sampler_replicas == 2


@pytest.mark.parametrize(
    ("metadata", "key", "detail"),
    [
        (
            {"openrl.weight_sync": "full"},
            "openrl.weight_sync",
            "openrl.weight_sync applies only with openrl.fine_tuning_type=full, "
            "and this job's openrl.fine_tuning_type is 'lora'",
        ),
        (
            {"openrl.weight_sync": "delta", "openrl.fine_tuning_type": "lora"},
            "openrl.weight_sync",
            "openrl.weight_sync applies only with openrl.fine_tuning_type=full, "
            "and this job's openrl.fine_tuning_type is 'lora'",
        ),
        (
            {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "4", "openrl.trainer_cp": "3"},
            "openrl.trainer_cp",
            "openrl.trainer_cp=3 must divide openrl.trainer_gpus=4",
        ),
        (
            {"openrl.trainer_cp": "2"},
            "openrl.trainer_cp",
            "openrl.trainer_cp=2 must divide openrl.trainer_gpus=1",
        ),
        (
            {"openrl.trainer_gpus": "2"},
            "openrl.trainer_gpus",
            "openrl.trainer_gpus=2 needs openrl.trainer_backend 'automodel' or a container image, "
            "and this job's openrl.trainer_backend is 'pytorch'",
        ),
    ],
    ids=["sync-on-lora", "explicit-delta-on-lora", "cp-not-dividing", "cp-above-gpus", "gpus-on-pytorch"],
)
def test_cross_field_rule_names_both_keys(metadata: dict[str, str], key: str, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings([], {}, metadata)
    assert (excinfo.value.detail, excinfo.value.key) == (detail, key)


def test_cross_field_rules_see_the_merged_sources() -> None:
    # gpus from the tags, backend from the model: only together are they legal.
    settings, _ = parse_settings(
        ["openrl.trainer_gpus=4", "openrl.trainer_cp=2"], {}, {"openrl.trainer_backend": "ghcr.io/org/trainer:1.2"}
    )
    assert (settings.trainer_gpus, settings.trainer_cp, settings.trainer_backend) == (4, 2, "ghcr.io/org/trainer:1.2")


def test_weight_sync_on_a_full_job_is_accepted() -> None:
    settings, _ = parse_settings([], {}, {"openrl.fine_tuning_type": "full", "openrl.weight_sync": "full"})
    assert (settings.fine_tuning_type, settings.weight_sync) == (FineTuningType.FULL, WeightSync.FULL)


def test_defaults_are_supported() -> None:
    require_supported(JobSettings())


def test_automodel_on_several_devices_is_supported() -> None:
    require_supported(JobSettings(trainer_backend="automodel", trainer_gpus=4))


def test_context_parallelism_on_an_automodel_group_is_supported() -> None:
    require_supported(JobSettings(trainer_backend="automodel", trainer_gpus=4, trainer_cp=2))


def test_a_trainer_image_on_several_devices_is_not_supported_yet() -> None:
    with pytest.raises(NotSupportedYet) as excinfo:
        require_supported(JobSettings(trainer_backend="ghcr.io/org/trainer:1", trainer_gpus=2))
    assert (excinfo.value.detail, excinfo.value.key) == (
        "openrl.trainer_gpus=2 with a trainer image is not supported yet: an image's trainer runs on one device; "
        "use openrl.trainer_backend=automodel",
        "openrl.trainer_gpus",
    )


def test_a_trainer_image_is_supported_and_left_to_the_nodes_allow_list() -> None:
    require_supported(JobSettings(trainer_backend="ghcr.io/org/trainer:1"))


@pytest.mark.parametrize("sync", [WeightSync.DELTA, WeightSync.FULL], ids=["delta", "full"])
def test_full_fine_tuning_with_either_weight_sync_is_supported(sync: WeightSync) -> None:
    require_supported(JobSettings(fine_tuning_type=FineTuningType.FULL, weight_sync=sync))


def test_exclusive_jobs_are_supported() -> None:
    require_supported(JobSettings(exclusive=True))


def test_sampler_replicas_up_to_eight_are_supported() -> None:
    require_supported(JobSettings(sampler_replicas=8))


def test_schema_has_every_key_with_a_description() -> None:
    schema = settings_json_schema()
    properties = schema["$defs"]["JobSettings"]["properties"]  # type: ignore[index]
    assert tuple(properties) == ALL_KEYS
    assert [key for key, spec in properties.items() if not spec.get("description")] == []


def test_schema_states_defaults_ranges_and_choices() -> None:
    schema = settings_json_schema()
    defs = schema["$defs"]  # type: ignore[index]
    properties = defs["JobSettings"]["properties"]
    assert {key: spec["default"] for key, spec in properties.items()} == {
        "fine_tuning_type": "lora",
        "weight_sync": "delta",
        "exclusive": False,
        "trainer_backend": "pytorch",
        "trainer_gpus": 1,
        "trainer_cp": 1,
        "sampler_replicas": 1,
        "sampler_backend": "node",
        "autosave_steps": None,
    }
    assert (properties["trainer_gpus"]["minimum"], properties["trainer_gpus"]["maximum"]) == (1, 64)
    assert sorted(defs["FineTuningType"]["enum"]) == ["full", "lora"]
    assert sorted(defs["WeightSync"]["enum"]) == ["delta", "full"]
    assert defs["JobSettings"]["additionalProperties"] is False


def test_stored_form_round_trips() -> None:
    settings = JobSettings(fine_tuning_type=FineTuningType.FULL, exclusive=True, trainer_backend="automodel", trainer_gpus=4)
    stored = settings_to_dict(settings)
    assert stored == {
        "fine_tuning_type": "full",
        "weight_sync": "delta",
        "exclusive": True,
        "trainer_backend": "automodel",
        "trainer_gpus": 4,
        "trainer_cp": 1,
        "sampler_replicas": 1,
        "sampler_backend": "node",
        "autosave_steps": None,
    }
    assert settings_from_dict(stored) == settings


@pytest.mark.parametrize(
    ("given", "interval"),
    [
        ({}, 1),
        ({"openrl.fine_tuning_type": "full"}, 0),
        ({"openrl.trainer_backend": "automodel"}, 0),
        ({"openrl.trainer_backend": "registry.example/team/trainer:1"}, 0),
        ({"openrl.autosave_steps": "5"}, 5),
        ({"openrl.fine_tuning_type": "full", "openrl.autosave_steps": "50"}, 50),
        ({"openrl.autosave_steps": "0"}, 0),
    ],
    ids=["lora-every-step", "full-none", "automodel-none", "image-none", "lora-every-5", "full-every-50", "lora-off"],
)
def test_autosave_interval_is_every_step_for_builtin_lora_unless_the_job_sets_one(
    given: dict[str, str], interval: int
) -> None:
    assert parse_settings([], {}, given)[0].autosave_interval == interval


def test_negative_autosave_steps_is_400_naming_the_key() -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_settings([], {}, {"openrl.autosave_steps": "-1"})
    assert (excinfo.value.key, excinfo.value.detail) == (
        "openrl.autosave_steps", "openrl.autosave_steps: expected an integer from 0 to 1000000, got '-1'"
    )


def test_stored_form_missing_keys_take_defaults() -> None:
    assert settings_from_dict({"exclusive": True}) == JobSettings(exclusive=True)


def test_stored_form_with_a_bad_value_is_a_server_error() -> None:
    with pytest.raises(ServerError) as excinfo:
        settings_from_dict({"trainer_gpus": 99})
    assert excinfo.value.detail == "stored job settings are invalid: Expected `int` <= 64 - at `$.trainer_gpus`"
