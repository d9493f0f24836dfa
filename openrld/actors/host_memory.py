"""The node's host-memory budget: what the prefix caches may hold, and what parked state holds.

This module owns `HostMemory`, the one ledger of the memory a node keeps by
choice rather than to compute: the torch samplers' prefix caches (kept for
reuse), the state parked off a device by the time-slicer, and, on a CPU
device, the engines' own state (weights, adapters, gradients, optimizer
state), which lives in host memory there. It answers one question for the
samplers, how many bytes each prefix cache may hold now, and keeps the
accounting `/metrics` and the console show.

Policy (the operator's reading of `host_memory_budget_bytes`):
- The prefix caches give way first. Each torch sampler engine's cache (one per
  replica) may hold an equal share of what the budget leaves after the parked
  state and the engines' host-resident state, and never more than
  `sampler_prefix_cache_bytes`. A new sampler, a new replica, a park or a
  trainer's grown state shrinks every share at once; a share can reach 0
  (caching off until room comes back).
- Parking is never refused: the time-slicer parks a worker to give its device
  to another, and refusing would leave the other waiting for as long as the
  first holds its state. A park whose host copies pass what the budget leaves
  is written to disk instead (`park_within_budget`: the engine's
  `spill_parked`, into the node's spill directory, read back at resume), so
  that parked state keeps within the budget (the copies are made in host memory
  first: for the moment of the write, one park's state is above it). What cannot be spilled (an engine
  without the call, a node without the directory) stays in host memory, and
  that park is counted (`over_budget_parks`) and logged, so that an operator
  sees the budget is too small for the jobs placed on this node.

It is plain state: no I/O except `read_rss_bytes`, `read_machine_memory_bytes`
(reads of /proc and the cgroup files, at startup and per scrape) and
`fresh_spill_dir` (at startup); no trio, no torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Hashable
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

# `host_memory_budget_bytes = 0`: this fraction of the machine's memory (or its cgroup's limit).
AUTO_BUDGET_FRACTION = 0.5


class EngineMemory(msgspec.Struct, frozen=True):
    """One worker's host memory, by part (bytes); what `/metrics` labels by base model."""

    prefix_cache_bytes: int = 0  # KV its prefix caches hold (a sampler; summed over replicas)
    prefix_cache_share_bytes: int = 0  # the most each of its prefix caches may hold now
    parked_bytes: int = 0  # its device state copied to host memory by a park (0 while resident, or on a CPU)
    spilled_bytes: int = 0  # its parked state written to disk instead, past the budget
    state_bytes: int = 0  # its engines' state on a CPU device (weights, adapters, grads, optimizer), measured last


class HostMemoryStatistics(msgspec.Struct, frozen=True):
    budget_bytes: int  # the budget in force (host_memory_budget_bytes, or its automatic value)
    prefix_cache_bytes: int  # every prefix cache's KV held now
    prefix_cache_share_bytes: int  # the most one torch sampler engine's prefix cache may hold now
    prefix_caches: int  # torch sampler engines sharing the prefix caches' part
    parked_bytes: int  # device state parked in host memory
    spilled_bytes: int  # parked device state written to disk because host memory had no room for it
    state_bytes: int  # engines' state on CPU devices (host memory there)
    over_budget_parks: int  # parks that left parked and resident state past the budget
    rss_bytes: int  # the daemon process's resident set when read (`read_rss_bytes`); 0 where unreadable


# What a node without a ledger reports: nothing budgeted, nothing held.
NO_HOST_MEMORY = HostMemoryStatistics(
    budget_bytes=0, prefix_cache_bytes=0, prefix_cache_share_bytes=0, prefix_caches=0, parked_bytes=0,
    spilled_bytes=0, state_bytes=0, over_budget_parks=0, rss_bytes=0,
)


def machine_memory_bytes(meminfo: str, cgroup_max: str | None) -> int:
    """The memory this process may use: MemTotal, or the cgroup's limit where that is lower.

    Args:
        meminfo: the text of /proc/meminfo.
        cgroup_max: the text of the cgroup's memory.max ("max": no limit), or None without one.
    """
    total = 0
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024  # reported in kB
            break
    limit = cgroup_max.strip() if cgroup_max is not None else "max"
    if limit.isdigit() and 0 < int(limit) < total:
        return int(limit)
    return total


def resolve_budget(configured: int, machine_bytes: int) -> int:
    """The budget in force: `configured`, or with 0 a fixed fraction of the machine's memory."""
    if configured > 0:
        return configured
    return int(machine_bytes * AUTO_BUDGET_FRACTION)


def read_machine_memory_bytes() -> int:
    """`machine_memory_bytes` of this machine (Linux); 0 where /proc/meminfo cannot be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return 0
    try:
        cgroup: str | None = Path("/sys/fs/cgroup/memory.max").read_text()
    except OSError:
        cgroup = None
    return machine_memory_bytes(meminfo, cgroup)


def fresh_spill_dir(path: Path) -> Path:
    """`path`, emptied of what an earlier daemon spilled (its parked jobs are gone with it)."""
    if path.is_dir():
        for leftover in path.glob("*.parked"):
            leftover.unlink(missing_ok=True)
    return path


def read_rss_bytes() -> int:
    """This process's resident set (Linux /proc/self/statm); 0 where it cannot be read."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
    except OSError:
        return 0
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


class HostMemory:
    """The ledger. Keys name workers (`("sampler", group name)`, ...); every call is from the event loop.

    Args:
        budget_bytes: the budget in force (see `resolve_budget`).
        prefix_cache_cap: the most one prefix cache may hold whatever the budget leaves
            (`sampler_prefix_cache_bytes`; 0: caching off).
        spill_dir: where parked state past the budget is written; None: it stays in host memory.
    """

    def __init__(self, budget_bytes: int, prefix_cache_cap: int, spill_dir: Path | None = None) -> None:
        assert budget_bytes >= 0 and prefix_cache_cap >= 0, (budget_bytes, prefix_cache_cap)
        self.budget_bytes = budget_bytes
        self.prefix_cache_cap = prefix_cache_cap
        self.spill_dir = spill_dir
        self._spilled: dict[Hashable, int] = {}
        self._caches: dict[Hashable, list[int]] = {}  # worker -> bytes held by each of its engines' caches
        self._parked: dict[Hashable, int] = {}
        self._state: dict[Hashable, int] = {}
        self._over_budget_parks = 0
        self._listeners: dict[Hashable, Callable[[], None]] = {}

    # -- the prefix caches ----------------------------------------------

    def set_prefix_caches(self, worker: Hashable, engines: int, on_change: Callable[[], None]) -> None:
        """`worker` runs `engines` prefix caches now; `on_change` is called whenever the share changes."""
        held = self._caches.get(worker, [])
        before = self.prefix_cache_share()
        self._caches[worker] = (held + [0] * engines)[:engines]
        self._listeners[worker] = on_change
        self._changed(before)

    def prefix_cache_share(self) -> int:
        """The most one prefix cache may hold now: an equal share of what the budget leaves, capped."""
        engines = sum(len(held) for held in self._caches.values())
        left = self.budget_bytes - sum(self._parked.values()) - sum(self._state.values())
        return min(self.prefix_cache_cap, max(left, 0) // max(engines, 1))

    def prefix_cache_held(self, worker: Hashable, engine: int, held_bytes: int) -> None:
        """What engine `engine` of `worker` reported its prefix cache holds."""
        held = self._caches.get(worker)
        if held is not None and engine < len(held):
            held[engine] = held_bytes

    # -- parked and resident state ----------------------------------------

    def fits(self, worker: Hashable, host_bytes: int) -> bool:
        """Whether `worker` may park `host_bytes` in host memory within the budget, beside the rest."""
        others = sum(b for w, b in self._parked.items() if w != worker)
        return others + sum(self._state.values()) + host_bytes <= self.budget_bytes

    def parked(self, worker: Hashable, host_bytes: int, spilled_bytes: int = 0) -> None:
        """`worker` parked `host_bytes` of device state into host memory and `spilled_bytes` to disk
        (0 and 0: it resumed)."""
        before = self.prefix_cache_share()
        for table, value in ((self._parked, host_bytes), (self._spilled, spilled_bytes)):
            if value:
                table[worker] = value
            else:
                table.pop(worker, None)
        if host_bytes and self._used_without_caches() > self.budget_bytes:
            self._over_budget_parks += 1
            logger.warning(
                "parked state past the host memory budget worker=%s parked=%d state=%d budget=%d",
                worker, sum(self._parked.values()), sum(self._state.values()), self.budget_bytes,
            )
        self._changed(before)

    def state(self, worker: Hashable, host_bytes: int) -> None:
        """`worker`'s engines hold `host_bytes` of state in host memory (a CPU device), measured now."""
        before = self.prefix_cache_share()
        self._state[worker] = host_bytes
        self._changed(before)

    def forget(self, worker: Hashable) -> None:
        """`worker` stopped: nothing of it is held any more."""
        before = self.prefix_cache_share()
        for table in (self._caches, self._parked, self._spilled, self._state, self._listeners):
            table.pop(worker, None)
        self._changed(before)

    # -- reading ----------------------------------------------------------

    def of(self, worker: Hashable) -> EngineMemory:
        return EngineMemory(
            prefix_cache_bytes=sum(self._caches.get(worker, ())),
            prefix_cache_share_bytes=self.prefix_cache_share() if worker in self._caches else 0,
            parked_bytes=self._parked.get(worker, 0),
            spilled_bytes=self._spilled.get(worker, 0),
            state_bytes=self._state.get(worker, 0),
        )

    def statistics(self) -> HostMemoryStatistics:
        return HostMemoryStatistics(
            budget_bytes=self.budget_bytes,
            prefix_cache_bytes=sum(sum(held) for held in self._caches.values()),
            prefix_cache_share_bytes=self.prefix_cache_share(),
            prefix_caches=sum(len(held) for held in self._caches.values()),
            parked_bytes=sum(self._parked.values()),
            spilled_bytes=sum(self._spilled.values()),
            state_bytes=sum(self._state.values()),
            over_budget_parks=self._over_budget_parks,
            rss_bytes=read_rss_bytes(),
        )

    def _used_without_caches(self) -> int:
        return sum(self._parked.values()) + sum(self._state.values())

    def _changed(self, share_before: int) -> None:
        if self.prefix_cache_share() == share_before:
            return
        for on_change in list(self._listeners.values()):
            on_change()


async def park_within_budget(
    memory: HostMemory, worker: Hashable, host_bytes: int, spill: Callable[[str], Awaitable[int]] | None
) -> None:
    """Record that `worker`'s park copied `host_bytes` into host memory; where that passes the budget
    and the node has a spill directory, `spill(directory)` (the engines' `spill_parked`, in their
    threads; None: they have none) first moves them to disk and says how many bytes it moved."""
    spilled = 0
    if host_bytes and spill is not None and memory.spill_dir is not None and not memory.fits(worker, host_bytes):
        spilled = await spill(str(memory.spill_dir))
    memory.parked(worker, host_bytes - spilled, spilled)
