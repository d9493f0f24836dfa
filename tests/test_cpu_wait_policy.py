"""Torch's CPU thread pool waits passively in every openrld process, unless the operator says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import openrld, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


def _policy_after_import(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_importing_openrld_makes_the_cpu_thread_pool_wait_passively() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_after_import(env) == "PASSIVE"


def test_an_operators_wait_policy_is_kept() -> None:
    assert _policy_after_import({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
