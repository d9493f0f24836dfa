"""Torch's CPU thread pool spins briefly, then sleeps, in every openrld process, unless the operator says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import openrld, os, torch; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"
OURS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _policy_after_import(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_importing_openrld_makes_the_cpu_thread_pool_spin_about_a_millisecond() -> None:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    assert _policy_after_import(env) == "ACTIVE 100000"


def test_an_operators_wait_policy_and_spin_count_are_kept() -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert _policy_after_import(env) == "PASSIVE 0"
