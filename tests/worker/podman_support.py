"""Podman for the container tests: images built here, and the launcher's settings on this host.

No registry can be reached here, and an image with torch in it is over a gigabyte,
so the test images are a root filesystem skeleton (a few directories, /etc/passwd,
the merged-/usr symlinks) made with `podman import`, and the worker runs the host's
own Python: /usr, the interpreter's prefix, the venv and the repository are
bind-mounted read-only, at the same paths, through the launcher's `run_args`. A real
image holds its own Python, torch and openrld instead (docs/custom-images.md); what
a test image proves is the launcher's part: the run, the socket, the devices, the
mounts, the exit status and the removal.

Each image's tag is a hash of what makes it (the skeleton's bytes and the image's
config), so a run reuses the image an earlier run built, and a change builds anew.

Podman needs the runc runtime and cgroupfs here (crun fails on this kernel's hybrid
cgroups): they are global options, given on every call (`global_args`). A
containers.conf of the tests' own, pointed at by CONTAINERS_CONF, clears
`default_ulimits`, which a container here cannot raise; /etc is never touched.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import openrld

REPO = Path(openrld.__file__).resolve().parents[1]
GLOBAL_ARGS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")
IMAGE_REPOSITORY = "localhost/openrld-test"
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
events_logger = "file"
"""


def require_podman() -> str:
    """podman's path; the tests that need it skip only where it is not installed."""
    found = shutil.which("podman")
    if found is None:
        pytest.skip("podman is not installed")
    return found


def write_containers_conf(directory: Path) -> str:
    """The tests' containers.conf, for CONTAINERS_CONF: podman then reads it, not /etc's."""
    path = directory / "containers.conf"
    path.write_text(CONTAINERS_CONF)
    return str(path)


def podman(*args: str, timeout: float = 300.0) -> str:
    done = subprocess.run(
        ["podman", *GLOBAL_ARGS, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"podman {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def host_python_args() -> tuple[str, ...]:
    """`run_args` that lend the container this host's Python, venv and openrld, read-only."""
    paths = sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix), REPO})
    kept = [p for p in paths if not any(o != p and o in p.parents for o in paths) and Path("/usr") not in p.parents]
    args = ["--volume", "/usr:/usr:ro"]
    for path in kept:
        args += ["--volume", f"{path}:{path}:ro"]
    if Path("/etc/ld.so.cache").exists():
        args += ["--volume", "/etc/ld.so.cache:/etc/ld.so.cache:ro"]
    return tuple(args)


def _skeleton() -> bytes:
    """The root filesystem: empty mount points, the merged-/usr links, root's passwd entry."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname, info.size, info.mtime = kind, mode, link, len(data), 0
            tar.addfile(info, io.BytesIO(data) if data else None)

        for directory in ("dev", "etc", "proc", "root", "run", "sys", "usr", "var", "var/tmp"):
            add(directory, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        for link in ("bin", "lib", "lib64", "sbin"):
            add(link, tarfile.SYMTYPE, 0o777, link=f"usr/{link}")
        add("etc/passwd", tarfile.REGTYPE, 0o644, b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\n")
    return buffer.getvalue()


def skeleton_image(command: list[str]) -> str:
    """The skeleton, running `command` with the venv's bin first on PATH; built once."""
    changes = [
        f"ENV PATH={Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "CMD " + json.dumps(command),
    ]
    skeleton = _skeleton()
    tag = f"{IMAGE_REPOSITORY}:{hashlib.sha256(skeleton + json.dumps(changes).encode()).hexdigest()[:16]}"
    if subprocess.run(["podman", *GLOBAL_ARGS, "image", "exists", tag], timeout=60).returncode != 0:
        done = subprocess.run(
            ["podman", *GLOBAL_ARGS, "import", *(a for c in changes for a in ("--change", c)), "-", tag],
            input=skeleton, capture_output=True, timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"podman import failed: {done.stderr.decode().strip()}")
    return tag


def built_image(context: Path, build_args: dict[str, str]) -> str:
    """`podman build` of a directory with a Containerfile, tagged by a hash of its files and arguments."""
    digest = hashlib.sha256(json.dumps(sorted(build_args.items())).encode())
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(context)).encode() + b"\0" + path.read_bytes())
    tag = f"{IMAGE_REPOSITORY}-{context.name}:{digest.hexdigest()[:16]}"
    if subprocess.run(["podman", *GLOBAL_ARGS, "image", "exists", tag], timeout=60).returncode != 0:
        podman("build", *(a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")),
               "--tag", tag, str(context), timeout=600)
    return tag


def containers_of(node: str) -> list[str]:
    """The names of every container (running or not) labelled with this node."""
    return podman("ps", "--all", "--filter", f"label=openrld.node={node}", "--format", "{{.Names}}").split()


def container_log(name: str) -> str:
    """What the container wrote, stdout and stderr (podman replays each on its own stream)."""
    done = subprocess.run(["podman", *GLOBAL_ARGS, "logs", name], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr
