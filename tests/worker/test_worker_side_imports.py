"""The worker's side imports neither trio, nor the daemon, nor torch until an engine needs it,
and the daemon's side of the protocol imports neither trio nor torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("trio", "torch", "openrld.daemon", "openrld.api", "openrld.actors", "openrld.gpu")


def loaded_after(modules: str) -> list[str]:
    code = f"import sys, {modules}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return [m for m in out.split(",") if m]


@pytest.mark.parametrize(
    "modules",
    [
        "openrld.worker.server, openrld.worker.base, openrld.worker.builtin",  # what a custom image imports
        "openrld.worker.client, openrld.worker.launchers, openrld.worker.launchers.process, openrld.worker.hosting",
    ],
    ids=["worker-side", "daemon-side"],
)
def test_the_protocol_loads_no_event_loop_no_daemon_and_no_torch(modules):
    assert loaded_after(modules) == []
