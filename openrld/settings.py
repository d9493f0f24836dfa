"""The `openrl.*` job settings: their one definition, parsing and checks.

This module owns `JobSettings`, the single msgspec definition from which
validation, the JSON Schema published by `/openrl/v1/info`, and the stored
form of a run's settings are all derived (docs/settings.md is printed from it). It
guarantees that a parsed `JobSettings` has every value in range and passes
the cross-field rules, and that every refusal is a `BadRequest` (or
`NotSupportedYet`) whose message and `key` name the offending setting. It
never interprets keys without the `openrl.` prefix: those belong to the
client and are handed back untouched. It does no I/O and keeps no state.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, cast

import msgspec

from openrld.errors import BadRequest, NotSupportedYet, ServerError

PREFIX = "openrl."

# The container image reference a custom trainer_backend names. Loose on
# purpose: the registry decides what exists; we only refuse what cannot be a
# reference (no '/', whitespace, shell metacharacters) before it reaches a
# container runtime.
_IMAGE_REF = r"[A-Za-z0-9][A-Za-z0-9._:@-]*(/[A-Za-z0-9._:@-]+)+"
_BACKEND_PATTERN = rf"^(pytorch|automodel|{_IMAGE_REF})$"
_SAMPLER_PATTERN = rf"^(node|{_IMAGE_REF})$"
_MAX_IMAGE_REF_CHARS = 255

_DECIMAL = re.compile(r"[0-9]{1,9}")


class FineTuningType(enum.Enum):
    """What a job trains: a LoRA adapter, or every weight of the model."""

    LORA = "lora"
    FULL = "full"


class WeightSync(enum.Enum):
    """How a full fine-tuning job's new weights reach its sampler."""

    FULL = "full"
    DELTA = "delta"


class JobSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Job settings, given as `openrl.<key>=<value>` strings in a model's or a
    session's user_metadata or in the session's tags (TINKER_TAGS); the model's
    user_metadata is strongest, then the session's, then the tags. Booleans are
    'true' or 'false'; integers are decimal."""

    fine_tuning_type: Annotated[
        FineTuningType,
        msgspec.Meta(
            description="lora: a LoRA adapter on a shared trainer and sampler for the base model; "
            "full: every weight is trained and the job gets its own trainer and sampler group. "
            "A restore takes the checkpoint's."
        ),
    ] = FineTuningType.LORA
    weight_sync: Annotated[
        WeightSync,
        msgspec.Meta(
            description="Full fine-tuning only: how new weights reach the sampler. "
            "full sends every tensor; delta sends only the elements that changed."
        ),
    ] = WeightSync.DELTA
    exclusive: Annotated[
        bool,
        msgspec.Meta(
            description="Dedicated devices for the job's trainer and sampler, never time-sliced (a hero run)."
        ),
    ] = False
    trainer_backend: Annotated[
        str,
        msgspec.Meta(
            pattern=_BACKEND_PATTERN,
            max_length=_MAX_IMAGE_REF_CHARS,
            description="Which trainer runs the job: pytorch, automodel (NeMo Automodel, FSDP2), "
            "or a container image reference (contains '/').",
        ),
    ] = "pytorch"
    trainer_gpus: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=64,
            description="Devices for one trainer; more than 1 needs automodel or an image; more than the "
            "largest node has spans several nodes (automodel).",
        ),
    ] = 1
    trainer_cp: Annotated[
        int,
        msgspec.Meta(ge=1, le=8, description="Context-parallel degree across the trainer's devices; divides trainer_gpus."),
    ] = 1
    sampler_replicas: Annotated[
        int,
        msgspec.Meta(ge=1, le=8, description="Sampler engines draining the job's sampling queue."),
    ] = 1
    sampler_backend: Annotated[
        str,
        msgspec.Meta(
            pattern=_SAMPLER_PATTERN,
            max_length=_MAX_IMAGE_REF_CHARS,
            description="Which sampler serves the job: node (the node's sampler_backend), "
            "or a container image reference (contains '/').",
        ),
    ] = "node"
    autosave_steps: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None,
        msgspec.Meta(
            description="optim_steps between auto-saves of the job's training state to the node's shared "
            "checkpoint root (none without one; never listed as checkpoints); 0: none. Unset: every step for a "
            "LoRA job on the pytorch trainer (its state is copied on the trainer's thread in milliseconds and "
            "written beside the next step), none for other jobs (full fine-tuning, automodel, images: their "
            "state is written on the trainer's thread, so set an interval)."
        ),
    ] = None

    @property
    def autosave_interval(self) -> int:
        """optim_steps between auto-saves (0: none): `autosave_steps` when the job sets it; unset, every
        step for a LoRA job on the built-in trainer (whose `snapshot_state` copies it), else none."""
        if self.autosave_steps is not None:
            return self.autosave_steps
        is_builtin_lora = self.fine_tuning_type is FineTuningType.LORA and self.trainer_backend == "pytorch"
        return 1 if is_builtin_lora else 0

    @property
    def trainer_image(self) -> str | None:
        """The container image the job's trainer runs from; None: a built-in trainer."""
        return self.trainer_backend if "/" in self.trainer_backend else None

    @property
    def sampler_image(self) -> str | None:
        """The container image the job's sampler runs from; None: the node's sampler."""
        return self.sampler_backend if "/" in self.sampler_backend else None


DEFAULT_SETTINGS = JobSettings()

SETTING_KEYS: tuple[str, ...] = JobSettings.__struct_fields__


# --- parsing one value ---------------------------------------------------------------------------

SettingValue = enum.Enum | bool | str | int  # FineTuningType, WeightSync or a plain value


def _enum_parser(enum_type: type[enum.Enum]) -> tuple[str, Callable[[str], SettingValue | None]]:
    values = [member.value for member in enum_type]
    expected = " or ".join(repr(v) for v in values)

    def parse(text: str) -> SettingValue | None:
        for member in enum_type:
            if text == member.value:
                return member
        return None

    return expected, parse


def _parse_bool(text: str) -> bool | None:
    return {"true": True, "false": False}.get(text)


def _int_parser(low: int, high: int) -> tuple[str, Callable[[str], int | None]]:
    def parse(text: str) -> int | None:
        if _DECIMAL.fullmatch(text) is None:
            return None
        number = int(text)
        return number if low <= number <= high else None

    return f"an integer from {low} to {high}", parse


def _parse_backend(text: str, pattern: str = _BACKEND_PATTERN) -> str | None:
    if len(text) <= _MAX_IMAGE_REF_CHARS and re.fullmatch(pattern, text):
        return text
    return None


# key -> (what a good value looks like, for the message; parser answering None for a bad value)
_PARSERS: dict[str, tuple[str, Callable[[str], SettingValue | None]]] = {
    "fine_tuning_type": _enum_parser(FineTuningType),
    "weight_sync": _enum_parser(WeightSync),
    "exclusive": ("'true' or 'false'", _parse_bool),
    "trainer_backend": (
        "'pytorch', 'automodel' or a container image reference containing '/'",
        _parse_backend,
    ),
    "trainer_gpus": _int_parser(1, 64),
    "trainer_cp": _int_parser(1, 8),
    "sampler_replicas": _int_parser(1, 8),
    "sampler_backend": (
        "'node' or a container image reference containing '/'",
        lambda text: _parse_backend(text, _SAMPLER_PATTERN),
    ),
    "autosave_steps": _int_parser(0, 1_000_000),
}
assert set(_PARSERS) == set(SETTING_KEYS), "every JobSettings field needs a parser"


def _parse_value(key: str, value: object) -> SettingValue:
    """The typed value of `openrl.<key>`, or BadRequest naming the key."""
    expected, parse = _PARSERS[key]
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
    if not isinstance(value, str):
        # JSON user_metadata can carry numbers or booleans; settings are strings
        # on every path (tags are), so say so rather than guess.
        raise BadRequest(f"{PREFIX}{key}: expected a string, {expected}, got {shown}", key=PREFIX + key)
    parsed = parse(value)
    if parsed is None:
        raise BadRequest(f"{PREFIX}{key}: expected {expected}, got {shown}", key=PREFIX + key)
    return parsed


def _setting_key(full_key: str) -> str:
    """The field name of `openrl.<key>`, or BadRequest for an unknown key."""
    key = full_key[len(PREFIX) :]
    if key not in _PARSERS:
        known = ", ".join(PREFIX + k for k in SETTING_KEYS)
        raise BadRequest(f"{full_key}: unknown setting; known settings are {known}", key=full_key)
    return key


# --- parsing the sources -------------------------------------------------------------------------


def _tag_settings(tags: Sequence[str]) -> dict[str, SettingValue]:
    """The settings given as `openrl.key=value` tags; other tags are ignored."""
    found: dict[str, tuple[str, SettingValue]] = {}
    for raw in tags:
        # TINKER_TAGS is comma-split by the SDK, so "a, openrl.x=y" leaves a space.
        tag = raw.strip()
        if not tag.startswith(PREFIX):
            continue
        full_key, sep, text = tag.partition("=")
        if not sep:
            raise BadRequest(f"tag {tag!r}: expected '{full_key}=<value>'", key=full_key)
        key = _setting_key(full_key)
        value = _parse_value(key, text)
        if key in found and found[key][1] != value:
            raise BadRequest(
                f"{full_key}: given twice in tags with different values, {found[key][0]!r} and {text!r}",
                key=full_key,
            )
        found[key] = (text, value)
    return {key: value for key, (_, value) in found.items()}


def _metadata_settings(metadata: Mapping[str, object]) -> dict[str, SettingValue]:
    """The settings among a user_metadata dict's `openrl.` keys."""
    return {
        key: _parse_value(key, value)
        for key, value in ((_setting_key(k), v) for k, v in metadata.items() if k.startswith(PREFIX))
    }


def client_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The keys of one user_metadata dict that belong to the client (no `openrl.` prefix)."""
    return {key: value for key, value in metadata.items() if not key.startswith(PREFIX)}


def parse_settings(
    tags: Sequence[str],
    session_metadata: dict[str, str],
    model_metadata: dict[str, str],
) -> tuple[JobSettings, dict[str, str]]:
    """Read a job's settings from its three sources.

    Every `openrl.` value in every source is checked, including one that a
    stronger source overrides, so a typo never hides. Then the strongest
    source wins per key: model metadata, then session metadata, then tags.

    Args:
        tags: the session's tags; those without the `openrl.` prefix are ignored.
        session_metadata: the session's user_metadata.
        model_metadata: the model's user_metadata ({} when parsing for a session).

    Returns:
        The settings, and the client's own metadata: the keys without the
        `openrl.` prefix of both dicts, the model's over the session's, values
        untouched. (Use `client_metadata` to take one dict's keys alone.)

    Raises:
        BadRequest: an unknown `openrl.` key, a bad value, or a broken
            cross-field rule; `key` names the setting.
    """
    given: dict[str, SettingValue] = {}
    for source in (_tag_settings(tags), _metadata_settings(session_metadata), _metadata_settings(model_metadata)):
        given.update(source)
    settings = JobSettings(**given)  # type: ignore[arg-type]  # keys and types checked by _parse_value
    _check_cross_fields(settings, set(given))
    own = client_metadata(session_metadata)
    own.update(client_metadata(model_metadata))
    return settings, own


def _check_cross_fields(settings: JobSettings, given: set[str]) -> None:
    """The rules between settings; each message names both keys."""
    if "weight_sync" in given and settings.fine_tuning_type is not FineTuningType.FULL:
        raise BadRequest(
            f"{PREFIX}weight_sync applies only with {PREFIX}fine_tuning_type=full, "
            f"and this job's {PREFIX}fine_tuning_type is {settings.fine_tuning_type.value!r}",
            key=PREFIX + "weight_sync",
        )
    if settings.trainer_gpus % settings.trainer_cp != 0:
        raise BadRequest(
            f"{PREFIX}trainer_cp={settings.trainer_cp} must divide {PREFIX}trainer_gpus={settings.trainer_gpus}",
            key=PREFIX + "trainer_cp",
        )
    if settings.trainer_gpus > 1 and settings.trainer_backend == "pytorch":
        raise BadRequest(
            f"{PREFIX}trainer_gpus={settings.trainer_gpus} needs {PREFIX}trainer_backend 'automodel' "
            f"or a container image, and this job's {PREFIX}trainer_backend is 'pytorch'",
            key=PREFIX + "trainer_gpus",
        )


# --- what this node has built ---------------------------------------------------------------------

# For each setting, which values this node can run; later work widens a row as
# its feature lands. An explicit weight_sync is legal only with
# fine_tuning_type=full (see _check_cross_fields).
_IS_BUILT: dict[str, Callable[[SettingValue], bool]] = {
    "fine_tuning_type": lambda value: True,  # full: gpu/full_trainer.py, a group per job
    "weight_sync": lambda value: True,  # gpu/delta.py; legal only with fine_tuning_type=full
    "exclusive": lambda value: True,  # actors/device_pool.py books devices of its own, or refuses
    # pytorch; automodel (gpu/automodel_trainer.py, where the node has its environment: jobs.py
    # checks); or an image (has a '/'), run by the node's container runtime
    "trainer_backend": lambda value: True,
    "trainer_gpus": lambda value: True,  # > 1: automodel as a torchrun group; an image: below
    # Context parallelism: gpu/automodel_cp.py (Automodel's block-diagonal CP); it must divide
    # trainer_gpus (_check_cross_fields), so cp > 1 means a torchrun group
    "trainer_cp": lambda value: True,
    "sampler_replicas": lambda value: True,  # 1-8, checked by the schema; actors/sampler.py runs them
    "sampler_backend": lambda value: True,  # the node's, or an image the node's allow-list decides on
    "autosave_steps": lambda value: True,  # actors/autosaves.py, where the node has a shared checkpoint root
}
assert set(_IS_BUILT) == set(SETTING_KEYS), "every setting needs a row in _IS_BUILT"


def setting_text(value: SettingValue) -> str:
    """A setting's value as it is written in `openrl.<key>=<value>`."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def require_supported(settings: JobSettings) -> None:
    """Refuse settings that name a feature this node has not built yet.

    Raises:
        NotSupportedYet: for the first such setting, in field order, with `key` set.
    """
    for key in SETTING_KEYS:
        value = getattr(settings, key)
        if not _IS_BUILT[key](value):
            raise NotSupportedYet(
                f"{PREFIX}{key}={setting_text(value)} is not supported yet by this node",
                key=PREFIX + key,
            )
    if settings.trainer_gpus > 1 and settings.trainer_image is not None:
        # A container image is one worker on one device; a torchrun group of an image is not built.
        raise NotSupportedYet(
            f"{PREFIX}trainer_gpus={settings.trainer_gpus} with a trainer image is not supported yet: "
            f"an image's trainer runs on one device; use {PREFIX}trainer_backend=automodel",
            key=PREFIX + "trainer_gpus",
        )


# --- schema and stored form ------------------------------------------------------------------------


def settings_json_schema() -> dict[str, object]:
    """The JSON Schema of JobSettings, with a description on every key."""
    return msgspec.json.schema(JobSettings)


def settings_to_dict(settings: JobSettings) -> dict[str, str | int | float | bool | None]:
    """The stored form: {"fine_tuning_type": "lora", "exclusive": False, ...} (the store's JSON scalars)."""
    return cast("dict[str, str | int | float | bool | None]", msgspec.to_builtins(settings))


def settings_from_dict(stored: Mapping[str, object]) -> JobSettings:
    """Read the form `settings_to_dict` wrote; missing keys take their defaults.

    Raises:
        ServerError: the dict is not one this module wrote (a corrupt store).
    """
    try:
        return msgspec.convert(stored, JobSettings)
    except msgspec.ValidationError as exc:
        raise ServerError(f"stored job settings are invalid: {exc}") from exc
