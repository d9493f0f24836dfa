"""One venv per tinker SDK release the matrix runs (openrld.sdk_support.TESTED_RELEASES).

`make install-test` runs this (`python tests/sdk_venvs.py DIR`), and
`run_loop` (tests/e2e/sdk_loop.py in one release's venv) calls `ensure_venv`
for any release whose venv is missing, so a plain `pytest` on a fresh clone
builds what it needs. Each
venv holds `tinker==<release>` and whatever that release requires, at the
newest versions the index offers, as a user's own fresh install would.

uv makes a venv and installs into it in seconds (`make install-test` installs
it into the project's venv); without it this falls back to `venv` and pip.
A venv counts as built only once its marker file is written, so one cut short
is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from openrld.sdk_support import TESTED_RELEASES

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / ".venv-sdk"
LOOP = Path(__file__).resolve().parent / "e2e" / "sdk_loop.py"
LOOP_TIMEOUT_S = 300.0  # one release's whole loop; it takes a few seconds on an idle node
BUILT_MARKER = ".built"


def venv_python(root: Path, release: str) -> Path:
    return root / release / "bin" / "python"


def ensure_venv(root: Path, release: str) -> Path:
    """The Python of `release`'s venv under `root`, built first if it is not yet."""
    venv = root / release
    if (venv / BUILT_MARKER).exists():
        return venv_python(root, release)
    if importlib.util.find_spec("uv") is not None:
        uv = [sys.executable, "-m", "uv"]
        subprocess.run([*uv, "venv", "--quiet", "--clear", "--python", sys.executable, str(venv)], check=True)
        subprocess.run(
            [*uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), f"tinker=={release}"],
            check=True,
        )
    else:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             f"tinker=={release}"],
            check=True,
        )
    (venv / BUILT_MARKER).touch()
    return venv_python(root, release)


def run_loop(release: str, url: str, base_model: str, *, timeout_s: float = LOOP_TIMEOUT_S) -> dict:
    """tests/e2e/sdk_loop.py run with `release`'s own Python against `url`: what it printed."""
    python = ensure_venv(DEFAULT_ROOT, release)
    done = subprocess.run([str(python), str(LOOP), url, base_model], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"tinker {release}: the loop failed:\n{done.stderr[-6000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else DEFAULT_ROOT
    for release in TESTED_RELEASES:
        ensure_venv(root, release)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
