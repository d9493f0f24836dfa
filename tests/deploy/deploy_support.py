"""What the deployment tests need, and how they treat a tool that is missing.

On a developer's machine a missing tool (systemd-analyze, the schema checker, the
Containerfile linter) skips the test that needs it. In CI (CI=true, as `.ci/run`
runs) nothing is skipped: the Makefile installs the Python tools, the machine has
systemd, and a test that cannot run fails, saying what is missing.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_module(name: str, install: str) -> ModuleType:
    """Import `name`; without it, skip (fail in CI) naming how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        message = f"{name} is not installed ({install})"
        if IN_CI:
            pytest.fail(f"{message}; CI runs every deployment test: {error}")
        pytest.skip(message)


def require_program(name: str, install: str) -> str:
    """The path of program `name`, from this venv's bin/ or PATH; without it, skip (fail in CI)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        message = f"{name} is not installed ({install})"
        if IN_CI:
            pytest.fail(f"{message}; CI runs every deployment test")
        pytest.skip(message)
    return found


def comment_text(text: str) -> str:
    """A file's comments as one line of prose: '#' and line breaks gone, spaces squeezed."""
    lines = [line.strip().lstrip("#").strip() for line in text.splitlines() if line.strip().startswith("#")]
    return " ".join(" ".join(lines).split())
