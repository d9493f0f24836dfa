"""The daemon's malloc settings (openrld/heap.py): applied at start unless the operator set their own; and
`trim`, which gives the arenas' free pages back."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch

from openrld.heap import bound_heap, release_file_pages, trim


def test_an_operators_malloc_variable_leaves_glibcs_settings_alone():
    assert bound_heap({"MALLOC_ARENA_MAX": "4"}) == {}


def test_without_one_the_daemon_takes_one_arena_and_a_fixed_4_mib_mmap_threshold():
    assert bound_heap({"PATH": "/usr/bin"}) == {"arena_max": 1, "mmap_threshold": 4 * 2**20}


def resident_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


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


def test_release_file_pages_unmaps_a_mapped_files_pages_and_keeps_their_bytes(tmp_path: Path):
    path = tmp_path / "weights.bin"
    torch.arange(16 * 2**20, dtype=torch.float32).numpy().tofile(path)  # 64 MiB
    mapped = torch.from_file(str(path), shared=False, size=16 * 2**20, dtype=torch.float32)
    total = float(mapped.sum())  # reads every page in
    held = resident_bytes("RssFile")
    released = release_file_pages(mapped.data_ptr(), 64 * 2**20)
    assert released == 64 * 2**20  # the mapping starts on a page: every page of it
    assert held - resident_bytes("RssFile") > 60 * 2**20
    assert float(mapped.sum()) == total  # read again from the file


def test_release_file_pages_leaves_anonymous_memory_alone():
    tensor = torch.full((4 * 2**20,), 3.0)
    assert release_file_pages(tensor.data_ptr(), tensor.numel() * 4) == 0
    assert float(tensor.sum()) == 3.0 * 4 * 2**20
