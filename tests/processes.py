"""A test's view of the processes a daemon or launcher started: children by parent pid, and which still run.

Read from /proc, since torchrun has no API for its process tree. A zombie counts as ended:
ranks whose torchrun was killed before them wait as zombies for init, which in some
containers (this one's /process_api) never reaps them; they hold no memory or device.
"""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each child of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((int(entry.name), (entry / "cmdline").read_bytes()))
        except (OSError, ValueError, IndexError):
            continue
    return found


def torchruns(pid: int) -> list[int]:
    """The torchrun children of `pid` (a daemon, or a bench's process): each the parent of its ranks."""
    return [child for child, command in children(pid) if b"torch.distributed.run" in command]


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (neither gone nor a zombie)."""
    return [pid for pid in pids if _state(pid) not in ("", "Z")]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
