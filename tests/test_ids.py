"""Ids and tinker:// paths (openrld/ids.py)."""

from __future__ import annotations

import re

import pytest

from openrld.errors import BadRequest
from openrld.ids import (
    CheckpointKind,
    TinkerPath,
    model_id,
    new_request_id,
    new_session_id,
    node_tag,
    parse_checkpoint_id,
    parse_tinker_path,
    sampling_session_id,
    tag_of,
    validate_name,
)

KINDS = "'weights', 'sampler_weights' or 'external_weights'"
PATH_SHAPE = f"expected 'tinker://<run_id>/<kind>/<name>' with kind {KINDS}"


def test_session_id_is_s_dash_16_hex_and_a_valid_name() -> None:
    session_id = new_session_id()
    assert re.fullmatch(r"s-[0-9a-f]{16}", session_id)
    assert validate_name(session_id, "run id") == session_id


def test_session_ids_differ() -> None:
    assert new_session_id() != new_session_id()


def test_request_id_is_r_dash_32_hex() -> None:
    assert re.fullmatch(r"r-[0-9a-f]{32}", new_request_id())


def test_a_node_tag_is_8_hex_characters_fixed_by_the_node_name() -> None:
    assert node_tag("node-a") == "66570ff0"  # sha256("node-a"), first 8 hex


def test_a_tagged_session_id_carries_the_tag_before_16_random_hex() -> None:
    session_id = new_session_id(node_tag("node-a"))
    assert re.fullmatch(rf"s-{node_tag('node-a')}[0-9a-f]{{16}}", session_id)
    assert validate_name(session_id, "run id") == session_id


def test_a_tagged_request_id_keeps_the_r_dash_32_hex_form() -> None:
    assert re.fullmatch(rf"r-{node_tag('node-a')}[0-9a-f]{{24}}", new_request_id(node_tag("node-a")))


def test_tag_of_reads_the_tag_of_session_model_sampler_and_request_ids() -> None:
    tag = node_tag("node-a")
    session_id = new_session_id(tag)
    found = [tag_of(i) for i in (session_id, f"{session_id}:train:0", f"{session_id}:sample:3", new_request_id(tag))]
    assert found == [tag] * 4


def test_an_untagged_session_id_has_no_tag() -> None:
    assert (tag_of(new_session_id()), tag_of(f"{new_session_id()}:train:0"), tag_of("copy-1")) == (None, None, None)


def test_model_id_is_the_form_the_sdk_assumes() -> None:
    assert model_id("s-0123456789abcdef", 3) == "s-0123456789abcdef:train:3"


def test_sampling_session_id_form() -> None:
    assert sampling_session_id("s-0123456789abcdef", 0) == "s-0123456789abcdef:sample:0"


@pytest.mark.parametrize(
    ("kind", "checkpoint_type"),
    [
        (CheckpointKind.WEIGHTS, "training"),
        (CheckpointKind.SAMPLER_WEIGHTS, "sampler"),
        (CheckpointKind.EXTERNAL_WEIGHTS, "external"),
    ],
    ids=["weights", "sampler_weights", "external_weights"],
)
def test_checkpoint_kind_maps_to_sdk_checkpoint_type(kind: CheckpointKind, checkpoint_type: str) -> None:
    assert kind.checkpoint_type == checkpoint_type


def test_parse_tinker_path_reads_the_three_parts() -> None:
    path = parse_tinker_path("tinker://s-0123456789abcdef:train:0/sampler_weights/step-10")
    assert path == TinkerPath(
        run_id="s-0123456789abcdef:train:0", kind=CheckpointKind.SAMPLER_WEIGHTS, name="step-10"
    )


def test_tinker_path_uri_and_checkpoint_id() -> None:
    path = TinkerPath.of("s-1:train:0", "weights", "final")
    assert path.uri == "tinker://s-1:train:0/weights/final"
    assert path.checkpoint_id == "weights/final"


def test_tinker_path_uri_round_trips() -> None:
    uri = "tinker://run-a/external_weights/v1.2"
    assert parse_tinker_path(uri).uri == uri


@pytest.mark.parametrize(
    ("given", "detail"),
    [
        ("http://run/weights/a", f"tinker path: {PATH_SHAPE}, got 'http://run/weights/a'"),
        (42, f"tinker path: {PATH_SHAPE}, got 42"),
        ("tinker://run/weights", f"tinker path: {PATH_SHAPE}, got 'tinker://run/weights' with 2 parts"),
        ("tinker://run/weights/a/b", f"tinker path: {PATH_SHAPE}, got 'tinker://run/weights/a/b' with 4 parts"),
        ("tinker://run/optimizer/a", f"checkpoint kind: expected {KINDS}, got 'optimizer'"),
        ("tinker://../weights/a", "tinker path run id: must not start with '.', got '..'"),
        ("tinker://run/weights/", "tinker path checkpoint name: must not be empty"),
        ("tinker:///weights/a", "tinker path run id: must not be empty"),
        ("tinker://run/weights/a b", "tinker path checkpoint name: may contain only letters, digits and '.', '_', ':', '-'; got 'a b'"),
    ],
    ids=["wrong-scheme", "not-a-string", "two-parts", "four-parts", "unknown-kind", "dotdot-run", "empty-name", "empty-run", "space"],
)
def test_parse_tinker_path_refuses_malformed(given: object, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_tinker_path(given)
    assert excinfo.value.detail == detail


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("", "checkpoint name: must not be empty"),
        ("a" * 129, "checkpoint name: must be at most 128 characters, got 129"),
        ("a\x00b", "checkpoint name: must not contain NUL, got 'a\\x00b'"),
        ("a/b", "checkpoint name: must not contain '/' or '\\', got 'a/b'"),
        ("/etc/passwd", "checkpoint name: must not contain '/' or '\\', got '/etc/passwd'"),
        ("a\\b", "checkpoint name: must not contain '/' or '\\', got 'a\\\\b'"),
        (".", "checkpoint name: must not start with '.', got '.'"),
        ("..", "checkpoint name: must not start with '.', got '..'"),
        (".hidden", "checkpoint name: must not start with '.', got '.hidden'"),
        ("a b", "checkpoint name: may contain only letters, digits and '.', '_', ':', '-'; got 'a b'"),
        ("naïve", "checkpoint name: may contain only letters, digits and '.', '_', ':', '-'; got 'naïve'"),
        ("a#old", "checkpoint name: may contain only letters, digits and '.', '_', ':', '-'; got 'a#old'"),
        (7, "checkpoint name: expected a string, got 7"),
    ],
    ids=[
        "empty", "too-long", "nul", "slash", "absolute", "backslash", "dot", "dotdot", "leading-dot", "space", "non-ascii",
        "hash", "not-a-string",
    ],
)
def test_validate_name_refuses_unsafe_names(name: object, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        validate_name(name, "checkpoint name")
    assert excinfo.value.detail == detail


@pytest.mark.parametrize(
    "name",
    ["step-10", "s-0123456789abcdef:train:0", "v1.2_final", "a" * 128, "a..b"],
    ids=["dash", "run-id-with-colons", "dot-underscore", "max-length", "inner-dots"],
)
def test_validate_name_accepts_safe_names(name: str) -> None:
    assert validate_name(name, "checkpoint name") == name


def test_tinker_path_of_refuses_unsafe_name() -> None:
    with pytest.raises(BadRequest) as excinfo:
        TinkerPath.of("run", CheckpointKind.WEIGHTS, "../x")
    assert excinfo.value.detail == "checkpoint name: must not contain '/' or '\\', got '../x'"


def test_parse_checkpoint_id_reads_kind_and_name() -> None:
    assert parse_checkpoint_id("sampler_weights/step-3") == (CheckpointKind.SAMPLER_WEIGHTS, "step-3")


@pytest.mark.parametrize(
    ("given", "detail"),
    [
        ("weights", "checkpoint id: expected '<kind>/<name>', got 'weights'"),
        ("weights/a/b", "checkpoint id: expected '<kind>/<name>', got 'weights/a/b'"),
        ("model/a", f"checkpoint kind: expected {KINDS}, got 'model'"),
        ("weights/..", "checkpoint name: must not start with '.', got '..'"),
    ],
    ids=["no-slash", "two-slashes", "unknown-kind", "dotdot"],
)
def test_parse_checkpoint_id_refuses_malformed(given: str, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        parse_checkpoint_id(given)
    assert excinfo.value.detail == detail
