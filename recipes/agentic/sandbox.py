"""One episode's sandbox on a Linux node: bubblewrap, no network, limits on time, memory and output.

A `BwrapSandbox` owns a temporary directory holding the task's documents
(`workspace/`) and the episode's writable `scratch/`. Every command it runs
starts a fresh `bwrap --unshare-all` (new user, pid, net, ipc, uts and cgroup
namespaces: no network at all), in a new session, dying with its parent, that
sees only:
- `/usr` read-only (the tools are coreutils, grep and sed),
- `/workspace`: the documents, read-only,
- `/scratch`: the only writable place that outlives the command,
- a private `/tmp` (gone when the command ends), `/proc` and `/dev`,
- a read-only root holding only these mount points.
Run as root, it first drops to nobody (`setpriv`), because the kernel exempts root
from the process limit. Inside, `prlimit` caps address space, processes, CPU seconds and file size (the
file-size cap also caps what the command can write to its stdout and stderr,
which go to files, not pipes), and the host kills the whole process group at
`wall_s`. Output is truncated to `max_output_bytes` before the model sees it.

It never interprets a path: what a command may reach is decided by what is
mounted, so a path the model makes up ("../../etc/passwd") fails inside.
`Sandbox` is the interface the tools use; `gke_sandbox.AgentSandbox` is the
other backend.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Protocol

import msgspec

logger = logging.getLogger(__name__)

WORKSPACE = "/workspace"
SCRATCH = "/scratch"
NOBODY = 65534
# The kernel does not apply RLIMIT_NPROC to root, so as root the sandbox drops to nobody first.
DROP_ROOT = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    wall_s: float = 5.0  # a tool call is a file read or a grep: milliseconds, so 5 s only stops runaways
    cpu_s: int = 5
    memory_bytes: int = 256 * 1024 * 1024  # address space; sh, sed and grep need a few MiB
    max_processes: int = 64  # per sandbox user: enough for a pipeline, too few for a fork bomb
    max_file_bytes: int = 1024 * 1024  # any file written, stdout and stderr included
    max_output_bytes: int = 16 * 1024  # what the model is shown of a command's output


class CommandResult(msgspec.Struct, frozen=True):
    exit_code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool  # stdout or stderr was longer than max_output_bytes


class Sandbox(Protocol):
    """Where an episode's tool actions run. `run` never raises for what the command does."""

    backend: str  # "bwrap" or "agent-sandbox", for the log

    def run(self, argv: list[str], stdin: bytes = b"") -> CommandResult: ...

    def close(self) -> None: ...


def bwrap_path() -> str | None:
    """The bubblewrap binary, or None when it is not installed."""
    return shutil.which("bwrap")


def bwrap_works() -> bool:
    """bwrap is installed and can make its namespaces here, as the user it will run as (a container may forbid them)."""
    path = bwrap_path()
    if path is None:
        return False
    probe = subprocess.run(
        [*(DROP_ROOT if os.geteuid() == 0 else []), path, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
         "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--", "/usr/bin/true"],
        capture_output=True, timeout=10,
    )
    return probe.returncode == 0


def _decode(raw: bytes, limit: int) -> tuple[str, bool]:
    return raw[:limit].decode("utf-8", errors="replace"), len(raw) > limit


class BwrapSandbox:
    """A workspace of `documents` and an empty scratch directory, each command in bubblewrap.

    Args:
        documents: path inside the workspace -> text.
        limits: the per-command limits.
        root: where to make the sandbox's directory (default: the system temp dir). Run as root,
            the sandbox runs as nobody, so every directory above `root` must let others in.
    """

    backend = "bwrap"

    def __init__(self, documents: dict[str, str], limits: SandboxLimits = SandboxLimits(), root: Path | None = None):
        path = bwrap_path()
        if path is None:
            raise RuntimeError("bubblewrap is not installed (apt-get install bubblewrap)")
        self._bwrap = path
        self.limits = limits
        self.directory = Path(tempfile.mkdtemp(prefix="agentic-", dir=root))
        self.workspace_dir = self.directory / "workspace"
        self.scratch_dir = self.directory / "scratch"
        self.workspace_dir.mkdir()
        self.scratch_dir.mkdir()
        for relative, text in documents.items():
            target = self.workspace_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        if os.geteuid() == 0:
            # Root is exempt from the process limit, so the sandbox runs as nobody, which
            # must be able to reach the documents and to write the scratch directory.
            self.directory.chmod(0o755)
            os.chown(self.scratch_dir, NOBODY, NOBODY)

    def _argv(self, argv: list[str]) -> list[str]:
        limits = self.limits
        return [
            *(DROP_ROOT if os.geteuid() == 0 else []),
            self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LC_ALL", "C.UTF-8",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--ro-bind", str(self.workspace_dir), WORKSPACE, "--bind", str(self.scratch_dir), SCRATCH,
            "--remount-ro", "/", "--chdir", WORKSPACE,
            "--", "prlimit", f"--as={limits.memory_bytes}", f"--nproc={limits.max_processes}",
            f"--cpu={limits.cpu_s}", f"--fsize={limits.max_file_bytes}", "--", *argv,
        ]

    def run(self, argv: list[str], stdin: bytes = b"") -> CommandResult:
        """Run `argv` inside a fresh sandbox; returns what it printed, cut to the output limit."""
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            # Files, not pipes: a forked child that keeps a pipe open cannot hang the read,
            # and the file-size limit bounds them.
            process = subprocess.Popen(
                self._argv(argv), stdin=stdin_file, stdout=out, stderr=err, start_new_session=True,
            )
            timed_out = False
            try:
                process.wait(timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                # bwrap's own group; what runs inside dies with the pid namespace's init.
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            out.seek(0)
            err.seek(0)
            stdout, out_cut = _decode(out.read(self.limits.max_output_bytes + 1), self.limits.max_output_bytes)
            stderr, err_cut = _decode(err.read(self.limits.max_output_bytes + 1), self.limits.max_output_bytes)
        return CommandResult(
            exit_code=process.returncode, stdout=stdout, stderr=stderr, timed_out=timed_out,
            truncated=out_cut or err_cut,
        )

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
