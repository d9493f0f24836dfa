"""The bubblewrap sandbox: escapes fail inside it and leave the host untouched; limits hold.

Each test names the escape and asserts the exact outcome inside the sandbox, then
checks the host. They run only where bwrap can make its namespaces.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from recipes.agentic.backends import pick_backend
from recipes.agentic.sandbox import BwrapSandbox, SandboxLimits, bwrap_works

pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here "
                                                          "(apt-get install bubblewrap)")
PYTHON = "/usr/bin/python3"  # the system interpreter, which the sandbox's read-only /usr holds


# Sandboxes go in the system temp dir, not pytest's tmp_path: run as root the sandbox is
# nobody, and pytest's directories let no one else in.
@pytest.fixture
def sandbox():
    box = BwrapSandbox({"contract.txt": "1. Term. This agreement terminates on 2027-07-22.\n"})
    yield box
    box.close()


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass  # gone meanwhile
    return found


def test_a_workspace_document_is_readable(sandbox):
    result = sandbox.run(["cat", "contract.txt"])
    assert (result.exit_code, result.stdout) == (0, "1. Term. This agreement terminates on 2027-07-22.\n")


def test_reading_a_host_file_by_absolute_path_finds_nothing(sandbox):
    assert Path("/etc/hostname").exists()
    result = sandbox.run(["cat", "/etc/hostname"])
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", "cat: /etc/hostname: No such file or directory\n")


def test_reading_above_the_workspace_finds_nothing(sandbox):
    result = sandbox.run(["cat", "../../etc/hostname"])
    assert (result.exit_code, result.stderr) == (1, "cat: ../../etc/hostname: No such file or directory\n")


def test_the_host_root_is_not_reachable_through_proc(sandbox):
    result = sandbox.run(["cat", "/proc/1/root/etc/hostname"])
    assert (result.exit_code, result.stderr) == (1, "cat: /proc/1/root/etc/hostname: No such file or directory\n")


@pytest.mark.skipif(shutil.which(PYTHON) is None, reason="needs the system python3 for a socket call")
def test_the_network_is_unreachable(sandbox):
    connect = (
        "import errno, socket\n"
        "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n"
        "try:\n    socket.getaddrinfo('example.com', 80)\n"
        "except socket.gaierror:\n    print('no dns')\n"
    )
    result = sandbox.run([PYTHON, "-c", connect])
    assert (result.exit_code, result.stdout) == (0, "ENETUNREACH\nno dns\n")


def test_processes_past_the_limit_cannot_start():
    box = BwrapSandbox({}, SandboxLimits(max_processes=64, wall_s=5.0))
    try:
        result = box.run(["sh", "-c", "for i in $(seq 100); do sleep 1 & done; echo unreachable"])
    finally:
        box.close()
    # dash gives up at the first failed fork, before its echo.
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1].endswith(": Cannot fork")


def test_only_loopback_exists(sandbox):
    result = sandbox.run(["sh", "-c", "ls /sys/class/net 2>/dev/null || tail -n +3 /proc/net/dev | cut -d: -f1"])
    assert result.stdout.split() == ["lo"]


def test_a_fork_bomb_cannot_fork_and_leaves_no_process():
    marker = f"bomb_{uuid.uuid4().hex[:8]}"
    box = BwrapSandbox({}, SandboxLimits(wall_s=2.0))
    try:
        started = time.monotonic()
        result = box.run(["sh", "-c", f"{marker}() {{ {marker} | {marker} & }}; {marker}; sleep 30"])
        took = time.monotonic() - started
    finally:
        box.close()
    assert "Cannot fork" in result.stderr
    assert result.timed_out or result.exit_code != 0
    assert took < 10
    # The kernel kills the pid namespace's processes when its init dies; reaping them
    # takes a moment, so wait (bounded) for the last to go.
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_writing_a_workspace_document_fails_and_the_host_copy_is_unchanged(sandbox):
    result = sandbox.run(["sh", "-c", "echo forged > /workspace/contract.txt"])
    assert (result.exit_code, result.stderr) == (2, "sh: 1: cannot create /workspace/contract.txt: Read-only file system\n")
    assert (sandbox.workspace_dir / "contract.txt").read_text().startswith("1. Term.")


@pytest.mark.parametrize("target", ["/evil", "/usr/evil", "/bin/evil"])
def test_writing_outside_scratch_fails_read_only(sandbox, target: str):
    result = sandbox.run(["sh", "-c", f"echo x > {target}"])
    assert (result.exit_code, result.stderr) == (2, f"sh: 1: cannot create {target}: Read-only file system\n")
    assert not Path(target).exists()


def test_tmp_is_private_to_the_command(sandbox):
    name = f"/tmp/agentic-{uuid.uuid4().hex[:8]}"
    assert sandbox.run(["sh", "-c", f"echo x > {name} && cat {name}"]).stdout == "x\n"
    assert not Path(name).exists()
    assert sandbox.run(["cat", name]).exit_code == 1  # the next command's /tmp is new


def test_writing_scratch_reaches_the_episode_directory_only(sandbox):
    result = sandbox.run(["sh", "-c", "cat > /scratch/answer.txt"], stdin=b"2027-07-22\n")
    assert result.exit_code == 0
    assert (sandbox.scratch_dir / "answer.txt").read_text() == "2027-07-22\n"


@pytest.mark.skipif(shutil.which(PYTHON) is None, reason="needs the system python3 to allocate")
def test_memory_beyond_the_limit_is_refused(sandbox):
    result = sandbox.run([PYTHON, "-c", "bytearray(512 * 1024 * 1024)"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "MemoryError"


def test_output_is_cut_at_the_limit(sandbox):
    result = sandbox.run(["sh", "-c", "yes | head -c 100000"])
    assert (result.exit_code, result.truncated, len(result.stdout)) == (0, True, SandboxLimits().max_output_bytes)


def test_a_file_past_the_size_limit_is_cut_by_the_kernel():
    box = BwrapSandbox({}, SandboxLimits(max_file_bytes=1000))
    try:
        result = box.run(["sh", "-c", "head -c 5000 /dev/zero > /scratch/big"])
        assert (box.scratch_dir / "big").stat().st_size == 1000
    finally:
        box.close()
    assert result.exit_code != 0


def test_a_command_past_its_wall_time_is_killed():
    box = BwrapSandbox({}, SandboxLimits(wall_s=0.5))
    try:
        started = time.monotonic()
        result = box.run(["sleep", "30"])
    finally:
        box.close()
    assert (result.timed_out, result.exit_code) == (True, -9)
    assert time.monotonic() - started < 5


def test_close_removes_the_episode_directory():
    box = BwrapSandbox({"a.txt": "x"})
    box.close()
    assert not box.directory.exists()


def test_auto_picks_bwrap_outside_a_cluster():
    backend, make_sandbox = pick_backend("auto")
    box = make_sandbox({"a.txt": "x"})
    try:
        assert (backend, box.backend, box.run(["cat", "a.txt"]).stdout) == ("bwrap", "bwrap", "x")
    finally:
        box.close()


def test_asking_for_agent_sandbox_outside_a_cluster_is_refused():
    with pytest.raises(RuntimeError, match="agent-sandbox needs a Kubernetes service account"):
        pick_backend("agent-sandbox")
    with pytest.raises(ValueError, match="'docker' is not one of"):
        pick_backend("docker")


def test_with_no_sandbox_the_recipe_refuses_naming_both_backends_before_it_runs(monkeypatch, capsys):
    from recipes.agentic import __main__ as recipe, backends

    monkeypatch.setattr(backends, "bwrap_works", lambda: False)  # a machine without bubblewrap, outside a cluster
    assert recipe.main(["--url", "http://127.0.0.1:9", "--sandbox", "auto"]) == 2
    assert capsys.readouterr().err == ("refused: no sandbox: install bubblewrap (apt-get install bubblewrap) "
                                       "or run in the GKE Job\n")
