"""`make vllm-env` installs: its pinned vLLM's own requirements resolve, proved with uv's resolver.

vLLM's wheel is 336 MB, and the package index here serves no separate metadata file for it
(PEP 658), so pip would download all of it to read its requirements. Instead the wheel's
METADATA is read through HTTP range requests (a zip keeps its directory at the end: a few
hundred kB in all), its Requires-Dist are evaluated for this Python (the image's is 3.11 too),
and `uv pip compile` resolves those together with the environment's other pins for Python 3.11
on manylinux x86_64: nothing is installed, and vLLM itself is never downloaded. uv (installed by
`make install-test` for the SDK matrix) rather than pip's `--dry-run`, which takes about 85 s
for the same 200 packages here against uv's 10 to 20: both resolve by the same standards.

Needs the package index; skipped without it.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
WHEEL_TAG = "manylinux_2_28_x86_64.whl"
pytestmark = pytest.mark.slow


def make_variable(name: str) -> str:
    match = re.search(rf"^{name} := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile defines no {name}"
    return match.group(1).strip()


class RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests; counts the bytes it fetched."""

    def __init__(self, url: str) -> None:
        self.url = url
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            self.size = int(response.headers["Content-Length"])
        self.position = 0
        self.fetched = 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        end = min(self.position + len(buffer), self.size)
        if end <= self.position:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 206, f"the index ignored a range request (HTTP {response.status})"
            data = response.read()
        buffer[: len(data)] = data
        self.position += len(data)
        self.fetched += len(data)
        return len(data)


def wheel_metadata(requirement: str) -> tuple[str, int, int]:
    """(METADATA text, bytes fetched, wheel size) of the pinned wheel, by range requests."""
    name, version = requirement.split("==")
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
    except (urllib.error.URLError, TimeoutError) as error:
        pytest.skip(f"no package index here ({error})")
    url = next(f["url"] for f in files if f["filename"].startswith(f"{name}-{version}-") and f["filename"].endswith(WHEEL_TAG))
    remote = RangeFile(url)
    with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=256 * 1024)) as wheel:
        text = wheel.read(f"{name}-{version}.dist-info/METADATA").decode()
    return text, remote.fetched, remote.size


def test_the_containerfile_builds_the_same_vllm_as_make_vllm_env() -> None:
    assert f"ARG VLLM={make_variable('VLLM')}\n" in (ROOT / "Containerfile").read_text()


def test_the_pinned_vllms_requirements_resolve_without_downloading_vllm() -> None:
    vllm, extras = make_variable("VLLM"), make_variable("VLLM_EXTRAS").split()
    metadata, fetched, size = wheel_metadata(vllm)
    assert fetched < 4 << 20, f"read {fetched} of the wheel's {size} bytes"
    environment = {**default_environment(), "extra": ""}
    requirements = [
        str(req) for req in map(Requirement, Parser().parsestr(metadata).get_all("Requires-Dist") or [])
        if req.marker is None or req.marker.evaluate(environment)
    ]
    done = subprocess.run(
        [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate",
         "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28", "-"],
        input="\n".join([*requirements, *extras]), capture_output=True, text=True, timeout=1200,
    )
    assert done.returncode == 0, f"uv could not resolve {vllm}'s requirements with {extras}:\n{done.stderr[-4000:]}"
    pins = (line.split("==") for line in done.stdout.splitlines() if "==" in line)
    resolved = {name.strip().lower(): version.strip() for name, version in pins}
    torch_pin = next(r for r in requirements if Requirement(r).name == "torch")
    assert Requirement(torch_pin).specifier.contains(resolved["torch"])
    assert "vllm" not in resolved
    for extra in extras:
        name, version = extra.split("==")
        assert resolved[name] == version
    # What openrld's worker side imports from the environment vLLM brings.
    assert {"transformers", "msgspec", "safetensors", "numpy"} <= set(resolved)
