"""The node's host-memory ledger: the budget's automatic value, the prefix caches' share, parked state
and its spill to disk past the budget."""

from __future__ import annotations

import trio

from openrld.actors.host_memory import (
    HostMemory,
    fresh_spill_dir,
    machine_memory_bytes,
    park_within_budget,
    resolve_budget,
)

GIB = 2**30
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1000 kB\n"  # 16 GiB


def test_a_budget_of_zero_is_half_the_machines_memory() -> None:
    assert resolve_budget(0, machine_memory_bytes(MEMINFO, None)) == 8 * GIB


def test_a_lower_cgroup_limit_is_the_machines_memory() -> None:
    assert machine_memory_bytes(MEMINFO, f"{4 * GIB}\n") == 4 * GIB
    assert machine_memory_bytes(MEMINFO, "max\n") == 16 * GIB
    assert machine_memory_bytes(MEMINFO, f"{64 * GIB}\n") == 16 * GIB


def test_a_configured_budget_is_taken_as_it_is() -> None:
    assert resolve_budget(3 * GIB, 16 * GIB) == 3 * GIB


def test_the_budget_is_split_equally_among_every_samplers_engines() -> None:
    memory = HostMemory(1200, prefix_cache_cap=1000)
    memory.set_prefix_caches("a", 1, lambda: None)
    assert memory.prefix_cache_share() == 1000  # alone: the cap, under what the budget leaves
    memory.set_prefix_caches("b", 2, lambda: None)
    assert memory.prefix_cache_share() == 400  # three engines, two samplers
    memory.forget("b")
    assert memory.prefix_cache_share() == 1000


def test_parked_and_cpu_resident_state_come_out_of_the_caches_share() -> None:
    memory = HostMemory(1000, prefix_cache_cap=1000)
    memory.set_prefix_caches("sampler", 2, lambda: None)
    memory.state("sampler", 200)
    memory.parked("trainer", 300)
    assert memory.prefix_cache_share() == 250
    memory.parked("trainer", 900)
    assert memory.prefix_cache_share() == 0  # past the budget: caching off, never negative
    memory.parked("trainer", 0)  # resumed
    assert memory.prefix_cache_share() == 400


def test_a_park_past_the_budget_is_counted_not_refused() -> None:
    memory = HostMemory(1000, prefix_cache_cap=100)
    memory.parked("a", 600)
    memory.parked("b", 600)
    stats = memory.statistics()
    assert (stats.parked_bytes, stats.over_budget_parks) == (1200, 1)


def test_every_sampler_is_told_when_the_share_changes() -> None:
    memory = HostMemory(1000, prefix_cache_cap=1000)
    told: list[str] = []
    memory.set_prefix_caches("a", 1, lambda: told.append("a"))
    memory.set_prefix_caches("b", 1, lambda: told.append("b"))
    assert told == ["a", "b"]  # b's arrival halved the share
    memory.state("b", 0)  # no change to the share: nobody is told
    assert told == ["a", "b"]


def test_statistics_sum_what_each_worker_holds() -> None:
    memory = HostMemory(10_000, prefix_cache_cap=1000)
    memory.set_prefix_caches("s", 2, lambda: None)
    memory.prefix_cache_held("s", 0, 300)
    memory.prefix_cache_held("s", 1, 200)
    memory.state("t", 4000)
    stats = memory.statistics()
    assert (stats.budget_bytes, stats.prefix_cache_bytes, stats.prefix_caches, stats.state_bytes) == (10_000, 500, 2, 4000)
    assert stats.prefix_cache_share_bytes == 1000
    assert memory.of("s").prefix_cache_bytes == 500


def test_a_park_past_the_budget_is_spilled_to_disk_and_so_not_counted_over_it(tmp_path) -> None:
    memory = HostMemory(1000, prefix_cache_cap=100, spill_dir=tmp_path)
    memory.parked("a", 600)
    asked: list[str] = []

    async def spill(directory: str) -> int:
        asked.append(directory)
        return 600

    trio.run(park_within_budget, memory, "b", 600, spill)
    stats = memory.statistics()
    assert asked == [str(tmp_path)]
    assert (stats.parked_bytes, stats.spilled_bytes, stats.over_budget_parks) == (600, 600, 0)


def test_a_park_within_the_budget_stays_in_host_memory(tmp_path) -> None:
    memory = HostMemory(1000, prefix_cache_cap=100, spill_dir=tmp_path)

    async def spill(directory: str) -> int:
        raise AssertionError("spilled a park that fits")

    trio.run(park_within_budget, memory, "b", 1000, spill)
    assert (memory.statistics().parked_bytes, memory.statistics().spilled_bytes) == (1000, 0)


def test_a_park_past_the_budget_on_a_node_without_a_spill_directory_stays_and_is_counted() -> None:
    memory = HostMemory(1000, prefix_cache_cap=100)

    async def spill(directory: str) -> int:
        raise AssertionError("spilled without a directory")

    trio.run(park_within_budget, memory, "b", 1200, spill)
    stats = memory.statistics()
    assert (stats.parked_bytes, stats.spilled_bytes, stats.over_budget_parks) == (1200, 0, 1)


def test_a_resume_clears_what_was_parked_and_spilled(tmp_path) -> None:
    memory = HostMemory(1000, prefix_cache_cap=100, spill_dir=tmp_path)
    memory.parked("a", 300, 900)
    memory.parked("a", 0)
    assert (memory.statistics().parked_bytes, memory.statistics().spilled_bytes) == (0, 0)


def test_leftovers_of_an_earlier_daemon_are_removed_from_the_spill_directory(tmp_path) -> None:
    (tmp_path / "trainer-7f.parked").write_bytes(b"x" * 10)
    (tmp_path / "keep.txt").write_text("not ours")
    assert fresh_spill_dir(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
