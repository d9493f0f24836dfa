"""Which tinker SDK releases a node's clients use: counted for /metrics, logged at first sight.

`SdkVersionWatch` is an ASGI layer in front of the app; it reads the release a
request names (`sdk_support.sdk_version_of`), counts it in `SdkVersionCounter`
and passes the request on untouched. The counter's label set is bounded: only
strings that are release numbers become labels, at most MAX_VERSIONS of them,
and the rest count under "other" (a request that names none, under "none"), so
a client cannot grow the scrape. Each release is logged once, the first time
it is seen, with where it stands against the range the node serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from openrld import sdk_support

if TYPE_CHECKING:  # http1 imports metrics, which imports this module's statistics
    from openrld.api.http1 import ASGIApp

logger = logging.getLogger(__name__)

MAX_VERSIONS = 64  # distinct release labels; a node sees a handful, a scrape must stay small
_PACKAGE_VERSION_HEADER = sdk_support.PACKAGE_VERSION_HEADER.encode()
NO_VERSION = "none"  # a request without an SDK header: curl, the console, a peer
OTHER_VERSION = "other"  # past MAX_VERSIONS distinct releases


class SdkVersionStatistics(msgspec.Struct, frozen=True):
    requests_by_version: dict[str, int]  # release (or "none"/"other") -> requests that named it


class SdkVersionCounter:
    """Requests per SDK release. Not thread-safe: used from the event loop only."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def observe(self, version: str | None) -> None:
        """Count one request from an SDK of `version` (None: the request named none)."""
        label = NO_VERSION if version is None else version
        if label not in self._counts and version is not None:
            if len(self._counts) >= MAX_VERSIONS:
                label = OTHER_VERSION
            else:
                self._log_first_sight(version)
        self._counts[label] = self._counts.get(label, 0) + 1

    def statistics(self) -> SdkVersionStatistics:
        return SdkVersionStatistics(dict(sorted(self._counts.items())))

    @staticmethod
    def _log_first_sight(version: str) -> None:
        standing = sdk_support.standing(version)
        served = f"{sdk_support.OLDEST_SERVED} to {sdk_support.NEWEST_TESTED}"
        if standing is sdk_support.Standing.OLDER:
            logger.warning(
                "tinker SDK %s is older than this node serves (%s, tested); "
                "if a call fails, upgrade: pip install 'tinker>=%s'", version, served, sdk_support.OLDEST_SERVED,
            )
        elif standing is sdk_support.Standing.NEWER:
            logger.warning("tinker SDK %s is newer than this node was tested with (%s)", version, served)
        else:
            logger.info("tinker SDK %s seen (%s; this node serves %s)", version, standing.value, served)


class SdkVersionWatch:
    """ASGI: counts each HTTP request under the SDK release it names, then passes it on."""

    def __init__(self, inner: ASGIApp, counter: SdkVersionCounter) -> None:
        self._inner = inner
        self._counter = counter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            package_version = user_agent = None
            for name, value in scope["headers"]:
                if name == _PACKAGE_VERSION_HEADER:
                    package_version = value.decode("latin-1")
                elif name == b"user-agent":
                    user_agent = value.decode("latin-1")
            self._counter.observe(sdk_support.sdk_version_of(package_version, user_agent))
        await self._inner(scope, receive, send)
