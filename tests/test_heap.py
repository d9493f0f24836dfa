"""The daemon's malloc settings (openrld/heap.py): applied at start unless the operator set their own."""

from __future__ import annotations

from openrld.heap import bound_heap


def test_an_operators_malloc_variable_leaves_glibcs_settings_alone():
    assert bound_heap({"MALLOC_ARENA_MAX": "4"}) == {}


def test_without_one_the_daemon_takes_two_arenas_and_a_fixed_4_mib_mmap_threshold():
    assert bound_heap({"PATH": "/usr/bin"}) == {"arena_max": 2, "mmap_threshold": 4 * 2**20}
