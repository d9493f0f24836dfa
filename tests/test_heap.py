"""The daemon's malloc settings (openrld/heap.py): applied at start unless the operator set their own; and
`trim`, which gives the arenas' free pages back."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

from openrld.heap import bound_heap, trim


def test_an_operators_malloc_variable_leaves_glibcs_settings_alone():
    assert bound_heap({"MALLOC_ARENA_MAX": "4"}) == {}


def test_without_one_the_daemon_takes_two_arenas_and_a_fixed_4_mib_mmap_threshold():
    assert bound_heap({"PATH": "/usr/bin"}) == {"arena_max": 2, "mmap_threshold": 4 * 2**20}


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_trim_gives_freed_arena_pages_back_to_the_kernel():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(100_000) for _ in range(1000)]  # 100 MB in blocks below any mmap threshold
    for block in blocks:
        ctypes.memset(block, 1, 100_000)
    for block in blocks[:-1]:  # the last one pins the heap's top, so free() alone gives nothing back
        libc.free(block)
    held = resident_bytes()
    assert trim() is True
    assert held - resident_bytes() > 90_000_000
    libc.free(blocks[-1])


def test_trim_leaves_the_heap_alone_below_its_threshold():
    assert trim(at_least=2**50) is False
