"""Which tinker SDK releases a node serves, and how to tell which one a client runs.

Owns `TESTED_RELEASES`, the one list of SDK releases the test suite runs its
loop with (tests/e2e/test_sdk_matrix.py; `make install-test` builds a venv for
each), and so the range a node states (`/openrl/v1/info`, `openrl-doctor`, the
README). A release that reaches the package index goes at the end of the list.

Also how a request names its SDK (`sdk_version_of`): the SDK is a Stainless
client, so every request carries `X-Stainless-Package-Version` and a
`User-Agent` of `AsyncTinker/Python <version>`. Never does I/O.
"""

from __future__ import annotations

import enum
import re

# Every release the suite's matrix runs, oldest first: the range's ends are served and
# tested, releases between them are served; each minor line's last patch is listed.
TESTED_RELEASES: tuple[str, ...] = (
    "0.16.1", "0.18.2", "0.21.0", "0.22.7", "0.23.4", "0.24.1", "0.25.0", "0.30.4", "0.33.1", "0.36.0", "0.38.0",
)
OLDEST_SERVED = TESTED_RELEASES[0]
NEWEST_TESTED = TESTED_RELEASES[-1]

# SDKs 0.21 to 0.24 send forward_backward as protobuf only when the client config says
# `proto_write_fwdbwd` (later ones always do, earlier ones never); the node says it to them.
PROTO_WRITE_FLAG_RELEASES = ("0.21.0", "0.25.0")  # [from, until)

PACKAGE_VERSION_HEADER = "x-stainless-package-version"
_USER_AGENT = re.compile(r"Tinker/Python (\S+)")  # "AsyncTinker/Python 0.16.1"
# A release number as PyPI spells tinker's: small numbers only, so a label built from it stays short.
_RELEASE = re.compile(r"(\d{1,4})\.(\d{1,4})\.(\d{1,4})")


class Standing(enum.Enum):
    """Where a release stands against the range a node serves."""

    TESTED = "tested"  # in TESTED_RELEASES
    SERVED = "served"  # between the ends, not itself in the matrix
    OLDER = "older"  # before OLDEST_SERVED: not tested; upgrading is the advice
    NEWER = "newer"  # after NEWEST_TESTED: not tested yet
    UNKNOWN = "unknown"  # not a release number


def release(text: str | None) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a release number such as "0.16.1", or None if `text` is not one."""
    match = _RELEASE.fullmatch(text.strip()) if text else None
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def standing(version: str | None) -> Standing:
    """Where `version` stands against OLDEST_SERVED and NEWEST_TESTED."""
    number = release(version)
    if number is None:
        return Standing.UNKNOWN
    if version in TESTED_RELEASES:
        return Standing.TESTED
    if number < release(OLDEST_SERVED):  # type: ignore[operator]
        return Standing.OLDER
    if number > release(NEWEST_TESTED):  # type: ignore[operator]
        return Standing.NEWER
    return Standing.SERVED


def sdk_version_of(package_version: str | None, user_agent: str | None) -> str | None:
    """The SDK release a request names: its package-version header, else its User-Agent; None if neither does."""
    if release(package_version) is not None:
        return package_version.strip()  # type: ignore[union-attr]
    match = _USER_AGENT.search(user_agent or "")
    if match and release(match[1]) is not None:
        return match[1]
    return None


def wants_proto_write_flag(version: str | None) -> bool:
    """Whether an SDK of `version` reads `proto_write_fwdbwd` (and `fwd_via_fwdbwd`) in its client config."""
    number = release(version)
    start, until = (release(v) for v in PROTO_WRITE_FLAG_RELEASES)
    return number is not None and start <= number < until  # type: ignore[operator]
