"""openrl-doctor, run beside an old tinker SDK, reports it against the range a real node serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sdk_venvs import DEFAULT_ROOT, ensure_venv

from openrld import __version__
from openrld.sdk_support import NEWEST_TESTED, OLDEST_SERVED

DOCTOR = str(Path(sys.executable).with_name("openrl-doctor"))


def test_doctor_reports_the_sdk_it_runs_with_against_the_served_range(shared_daemon, tmp_path):
    # The doctor reads the installed SDK's version from its metadata; put the oldest release's
    # dist-info ahead of the project's own 0.38.0, and nothing else of that venv.
    python = ensure_venv(DEFAULT_ROOT, OLDEST_SERVED)
    [dist_info] = python.parent.parent.glob(f"lib/python*/site-packages/tinker-{OLDEST_SERVED}.dist-info")
    (tmp_path / dist_info.name).symlink_to(dist_info)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TINKER_API_KEY", None)
    out = subprocess.run(
        [DOCTOR, "--url", shared_daemon.url, "--no-smoke", "--json"], capture_output=True, text=True, timeout=300, env=env
    )
    [version] = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "version"]
    assert (version["status"], version["summary"]) == (
        "ok",
        f"tinker {OLDEST_SERVED} is installed here; openrld {__version__} serves tinker SDK "
        f"{OLDEST_SERVED} to {NEWEST_TESTED} (one of the releases its tests run)",
    )
