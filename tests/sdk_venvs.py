"""One venv per tinker SDK release the matrix runs.

The matrix is openrld.sdk_support.TESTED_RELEASES, and any release the
package index holds that is newer than the last of them: `make install-test`
runs this (`python tests/sdk_venvs.py DIR`), which asks the index once
(`pip index versions tinker`) and writes those newer releases to
DIR/NEWER_RELEASES, so the day a release reaches the index the next fresh
`make test` runs the loop with it too, before anyone lists it.
`run_loop` (tests/e2e/sdk_loop.py in one release's venv) calls `ensure_venv`
for any release whose venv is missing, so a plain `pytest` on a fresh clone
builds what it needs. Each venv holds `tinker==<release>` and whatever that
release requires, at the newest versions the index offers, as a user's own
fresh install would.

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

from openrld import sdk_support
from openrld.sdk_support import NEWEST_TESTED, TESTED_RELEASES

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / ".venv-sdk"
LOOP = Path(__file__).resolve().parent / "e2e" / "sdk_loop.py"
LOOP_TIMEOUT_S = 300.0  # one release's whole loop; it takes a few seconds on an idle node
BUILT_MARKER = ".built"
NEWER_RELEASES = "newer-releases.txt"  # releases on the index after NEWEST_TESTED, one a line
INDEX_TIMEOUT_S = 120.0  # one `pip index versions` call


def matrix(root: Path = DEFAULT_ROOT) -> tuple[str, ...]:
    """TESTED_RELEASES, then the newer releases the last build found on the index."""
    listed = root / NEWER_RELEASES
    newer = listed.read_text().split() if listed.exists() else []
    return TESTED_RELEASES + tuple(newer)


def newer_on_index() -> tuple[str, ...]:
    """Final releases of tinker on the index after NEWEST_TESTED, oldest first; () if the index cannot be read."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "tinker", "--disable-pip-version-check"],
            capture_output=True, text=True, timeout=INDEX_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return ()
    line = next((line for line in done.stdout.splitlines() if line.startswith("Available versions:")), "")
    versions = [v.strip() for v in line.partition(":")[2].split(",")]
    newest = sdk_support.release(NEWEST_TESTED)
    found = [(number, v) for v in versions if (number := sdk_support.release(v)) is not None and number > newest]
    return tuple(v for _, v in sorted(found))


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
    newer = newer_on_index()
    if newer:
        print(f"tinker releases newer than {NEWEST_TESTED} on the index join the matrix: {', '.join(newer)}")
    for version in TESTED_RELEASES + newer:
        ensure_venv(root, version)
    root.mkdir(parents=True, exist_ok=True)
    (root / NEWER_RELEASES).write_text("".join(f"{v}\n" for v in newer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
