"""The image allow-list: fnmatch patterns from `[workers] allowed_images`, none allowing nothing."""

from __future__ import annotations

import pytest

from openrld.errors import BadRequest
from openrld.worker.images import check_image_allowed, image_allowed

ACME = ("ghcr.io/acme/trainers/*", "registry.local/lora:1.*")


@pytest.mark.parametrize(
    ("image", "patterns", "allowed"),
    [
        ("ghcr.io/acme/trainers/lora:2", (), False),
        ("ghcr.io/acme/trainers/lora:2", ACME, True),
        ("ghcr.io/acme/trainers/nested/lora:2", ACME, True),  # `*` crosses `/`
        ("ghcr.io/acme/other:2", ACME, False),
        ("registry.local/lora:1.4", ACME, True),
        ("registry.local/lora:2.0", ACME, False),
        ("GHCR.IO/acme/trainers/lora:2", ACME, False),  # image references are case-sensitive
        ("ghcr.io/acme/trainers/lora:2", ("ghcr.io/acme/trainers/lora:2",), True),
        ("ghcr.io/acme/trainers/lora:22", ("ghcr.io/acme/trainers/lora:2",), False),
        ("registry.local/t@sha256:" + "a" * 64, ("registry.local/t@sha256:" + "a" * 64,), True),
        ("registry.local/lora:1x", ("registry.local/lora:1?",), True),
        ("registry.local/lora:1", ("registry.local/lora:[12]",), True),
    ],
    ids=[
        "no-patterns-allow-none", "repository-prefix", "star-crosses-slash", "other-repository",
        "tag-pattern", "other-tag", "case-sensitive", "exact", "exact-is-not-prefix", "digest",
        "question-mark", "character-class",
    ],
)
def test_image_allowed(image, patterns, allowed):
    assert image_allowed(image, patterns) is allowed


def test_an_allowed_image_passes_the_check():
    check_image_allowed("ghcr.io/acme/trainers/lora:2", ACME)


def test_an_image_off_the_list_is_a_400_naming_the_key_the_image_and_the_setting():
    with pytest.raises(BadRequest) as raised:
        check_image_allowed("docker.io/evil/miner:latest", ACME)
    assert (raised.value.status, raised.value.key) == (400, "openrl.trainer_backend")
    assert str(raised.value) == (
        "openrl.trainer_backend: image 'docker.io/evil/miner:latest' is not allowed: this node's "
        "workers.allowed_images (ghcr.io/acme/trainers/*, registry.local/lora:1.*) does not match it; "
        "the node's operator can add a pattern to workers.allowed_images"
    )


def test_with_no_list_the_400_says_the_node_allows_no_images():
    with pytest.raises(BadRequest) as raised:
        check_image_allowed("ghcr.io/acme/trainers/lora:2", (), key="openrl.sampler_backend")
    assert raised.value.key == "openrl.sampler_backend"
    assert str(raised.value) == (
        "openrl.sampler_backend: image 'ghcr.io/acme/trainers/lora:2' is not allowed: this node allows no "
        "container images (its [workers] allowed_images is empty); the node's operator can add a pattern "
        "to workers.allowed_images"
    )
