"""Which SDK release a request names, where it stands against the range served, and how it is counted."""

from __future__ import annotations

import logging

import pytest

from openrld import sdk_support
from openrld.api.sdk_versions import MAX_VERSIONS, SdkVersionCounter
from openrld.sdk_support import Standing


@pytest.mark.parametrize(
    ("package_version", "user_agent", "found"),
    [
        ("0.16.1", "AsyncTinker/Python 0.16.1", "0.16.1"),
        (None, "AsyncTinker/Python 0.22.7", "0.22.7"),  # a proxy that drops X-Stainless-* headers
        ("not-a-version", "AsyncTinker/Python 0.30.4", "0.30.4"),
        (None, "curl/8.5.0", None),
        ("1" * 40 + ".0.0", None, None),  # no label is built from an arbitrarily long string
    ],
    ids=["header", "user-agent", "bad-header", "curl", "long"],
)
def test_sdk_version_is_read_from_the_package_header_then_the_user_agent(
    package_version: str | None, user_agent: str | None, found: str | None
) -> None:
    assert sdk_support.sdk_version_of(package_version, user_agent) == found


@pytest.mark.parametrize(
    ("version", "where"),
    [
        ("0.16.1", Standing.TESTED),
        ("0.38.0", Standing.TESTED),
        ("0.27.1", Standing.SERVED),
        ("0.15.0", Standing.OLDER),
        ("0.39.0", Standing.NEWER),
        ("0.9.10", Standing.OLDER),  # numbers compare as numbers, not as text
        ("latest", Standing.UNKNOWN),
    ],
    ids=["oldest", "newest", "between", "older", "newer", "numeric", "unknown"],
)
def test_standing_places_a_release_against_the_tested_range(version: str, where: Standing) -> None:
    assert sdk_support.standing(version) is where


@pytest.mark.parametrize(
    ("version", "told"),
    [("0.18.2", False), ("0.21.0", True), ("0.24.1", True), ("0.25.0", False), ("0.38.0", False), (None, False)],
    ids=["0.18.2", "0.21.0", "0.24.1", "0.25.0", "0.38.0", "none"],
)
def test_only_sdks_that_read_proto_write_fwdbwd_are_told_it(version: str | None, told: bool) -> None:
    assert sdk_support.wants_proto_write_flag(version) is told


def test_counter_counts_requests_per_release_and_those_without_one() -> None:
    counter = SdkVersionCounter()
    for version in ("0.16.1", "0.38.0", "0.16.1", None):
        counter.observe(version)
    assert counter.statistics().requests_by_version == {"0.16.1": 2, "0.38.0": 1, "none": 1}


def test_counter_labels_past_the_cap_as_other() -> None:
    counter = SdkVersionCounter()
    for minor in range(MAX_VERSIONS + 3):
        counter.observe(f"0.{minor}.0")
    counts = counter.statistics().requests_by_version
    assert (len(counts), counts["other"]) == (MAX_VERSIONS + 1, 3)


def test_an_sdk_older_than_the_range_is_logged_once_with_the_upgrade(caplog: pytest.LogCaptureFixture) -> None:
    counter = SdkVersionCounter()
    with caplog.at_level(logging.INFO, logger="openrld.api.sdk_versions"):
        counter.observe("0.15.0")
        counter.observe("0.15.0")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "tinker SDK 0.15.0 is older than this node serves (0.16.1 to 0.38.0, tested); "
                    "if a call fails, upgrade: pip install 'tinker>=0.16.1'"),
    ]
