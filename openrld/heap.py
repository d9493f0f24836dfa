"""glibc malloc settings for the daemon's own process, where the inproc engines run.

glibc gives each thread that allocates its own arena (up to 8 per core), and
raises its mmap threshold each time a large block is freed (up to 32 MiB), after
which tensors of that size come from the arenas and stay there when freed. The
daemon's engine threads and trio's worker threads then each held the peak of
what they once allocated: a node serving two text-to-SQL jobs on SmolLM2 (64
rows of ~350 tokens a step, a trainer step of 32 sequences) grew to 23.6 GB and
was killed by the kernel within six minutes. A TorchSampler alone, on an
engine thread, serving four rounds of 64 such requests: 2.8, 3.2, 5.0, 5.4 GB
resident after each round by default; 1.6, 1.8, 1.9, 1.9 GB with two arenas and
a fixed 4 MiB threshold (bench/sampler_heap.py measures it).

One arena, not two, since an engine thread on a CPU device ends when idle and
the next call starts another (actors/engine_thread.py): glibc gives a new
thread the next arena in turn, so with two, each engine's working set came to
be held in both. The text-to-SQL sweep's peak (bench/sql_memory.py, one run
each, back to back): 4.36 GB with long-lived engine threads and two arenas,
4.77 GB with threads that end idle and two arenas, 4.40 GB with one. The
engines of a CPU device compute one at a time, and Python's small objects come
from its own allocator, so one arena's lock is seldom contended.

The settings are glibc's own (`mallopt`), applied at start: glibc reads the
MALLOC_* environment variables only when a process starts, and a daemon is
started by systemd, a DaemonSet or a user's shell, none of which sets them.
An operator who sets any MALLOC_* variable keeps exactly that. Worker
processes get theirs from the launcher (`worker/launchers/process.py`).
Written by hand because the standard library has no binding for `mallopt`.

`trim` gives the arenas' free pages back to the kernel (`malloc_trim`). The
4 MiB threshold leaves everything smaller in the arenas: a trainer step's
small tensors and a sampler's prefix-cache blocks. Freed, they stay resident
until the arenas reuse them, and the next large tensors, which are mmapped,
never do. A TorchTrainer step of the text-to-SQL sweep's shape on SmolLM2 (16
sequences of ~194 tokens) left 1.66 GiB resident from 0.92 before it; 1.10
GiB with a trim after the pass. The sampler calls it once it has run dry, when
the arenas hold `TRIM_AT_BYTES` free or more. The trainer does not: in a
training loop the next pass faults every trimmed page in again (~2 µs a
page), which cost SmolLM2's 8 x 128 SFT step about 0.3-0.5 s of its ~4.5, and
the text-to-SQL sweep peaked at 4.55 GB with a trim after each pass and 4.63
GB without (bench/sql_memory.py), so it bought no peak.

`release_file_pages` unmaps pages of a mapped checkpoint that a tensor was copied
out of (`packed_linear`: weights packed for oneDNN), so that they are not counted twice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 1  # every thread shares it (the docstring)
MMAP_THRESHOLD_BYTES = 4 * 2**20  # a fixed threshold also stops glibc raising it
# What the sampler lets the arenas keep free after a sampling burst before `trim`.
TRIM_AT_BYTES = 128 * 2**20


def bound_heap(environ: Mapping[str, str]) -> dict[str, int]:
    """Apply the daemon's malloc settings unless `environ` sets any MALLOC_* variable; returns what
    was applied ({} when nothing was: an operator's settings, or a C library without mallopt)."""
    if any(name.startswith("MALLOC_") for name in environ):
        return {}
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return {}
    applied = {}
    for name, parameter, value in (("arena_max", M_ARENA_MAX, ARENAS), ("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)):
        if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) == 1:
            applied[name] = value
    logger.debug("malloc settings %s", applied)
    return applied


def trim(at_least: int = 0) -> bool:
    """Return the heap's free memory to the kernel (glibc's `malloc_trim(0)`, every arena) when the
    arenas hold at least `at_least` free bytes; whether any was returned (False too where the C
    library has neither `malloc_trim` nor, for a nonzero `at_least`, `mallinfo2`).

    A threshold, because what is returned is faulted in again when next used (~2 µs a page): a
    small step that leaves little behind keeps it for the next."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    if at_least and free_heap_bytes() < at_least:
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))


def free_heap_bytes() -> int:
    """The bytes free in the arenas (mallinfo2's fordblks); 0 without `mallinfo2` (glibc < 2.33)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages from this process's page tables


def release_file_pages(address: int, nbytes: int) -> int:
    """Unmap from this process the whole pages of [address, address + nbytes) when that range lies
    in a file-backed mapping (a checkpoint that torch or safetensors mapped), and return the bytes
    released; 0 when it does not, or where `madvise` is missing.

    For a caller that has copied a tensor out of a mapped checkpoint and holds no view of the old
    bytes: the mapping lives on for the file's other tensors, so the copied pages would stay
    resident and counted twice. Released, they stay in the page cache and come back from the file
    if read again (a private file mapping's clean pages are the file's bytes), so nothing is lost.
    Anonymous memory is never touched: there the advice would zero bytes that the allocator may
    still hand out."""
    start, end = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE, (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    libc = _libc()
    if end <= start or libc is None or not hasattr(libc, "madvise") or not _in_file_mapping(address, address + nbytes):
        return 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_DONTNEED)) != 0:
        return 0
    return end - start


def _in_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one mapping of a file (/proc/self/maps; False where that is missing)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= start and end <= high:
            return len(fields) == 6 and fields[5].startswith("/")
    return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    return ctypes.CDLL(path) if path else None
