"""openrl-doctor's verdict on the tinker SDK installed beside it, against the releases a node serves."""

from __future__ import annotations

import pytest

from openrld.doctor import Status, sdk_verdict

INFO = {
    "version": "0.1.0",
    "tinker_sdk_version": "0.38.0",
    "tinker_sdk_releases": {"oldest": "0.16.1", "newest": "0.38.0", "tested": ["0.16.1", "0.30.4", "0.38.0"]},
}


@pytest.mark.parametrize(
    ("installed", "status", "summary", "next_step"),
    [
        ("0.30.4", Status.OK,
         "tinker 0.30.4 is installed here; openrld 0.1.0 serves tinker SDK 0.16.1 to 0.38.0 (one of the releases its tests run)",
         None),
        ("0.27.1", Status.OK,
         "tinker 0.27.1 is installed here; openrld 0.1.0 serves tinker SDK 0.16.1 to 0.38.0 (within that range)", None),
        ("0.15.0", Status.WARN,
         "tinker 0.15.0 is installed here, older than openrld 0.1.0 serves (tinker SDK 0.16.1 to 0.38.0)",
         "pip install 'tinker>=0.16.1' (the loop is tested with 0.16.1, 0.30.4, 0.38.0)"),
        ("0.39.0", Status.WARN,
         "tinker 0.39.0 is installed here, newer than openrld 0.1.0 was tested with (tinker SDK 0.16.1 to 0.38.0)",
         "if a call fails, pip install tinker==0.38.0"),
        (None, Status.WARN, "openrld 0.1.0 serves tinker SDK 0.16.1 to 0.38.0; no tinker SDK is installed here",
         "pip install tinker==0.38.0"),
    ],
    ids=["tested", "between", "older", "newer", "none"],
)
def test_installed_sdk_is_judged_against_the_range_the_node_serves(installed, status, summary, next_step) -> None:
    verdict = sdk_verdict(installed, INFO)
    assert (verdict.status, verdict.summary, verdict.next_step) == (status, summary, next_step)


def test_a_node_that_states_one_release_is_judged_against_that_release() -> None:
    verdict = sdk_verdict("0.30.4", {"version": "0.0.9", "tinker_sdk_version": "0.38.0"})
    assert (verdict.status, verdict.summary) == (
        Status.WARN, "tinker 0.30.4 is installed here, older than openrld 0.0.9 serves (tinker SDK 0.38.0)"
    )
