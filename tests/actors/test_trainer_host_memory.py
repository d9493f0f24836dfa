"""A trainer under the node's host-memory budget: what its engine holds on a CPU, and its parks.

The engine is a stand-in whose park copies a set number of bytes into host memory, as a
CUDA engine's does (on the CPU a park moves nothing), and whose `spill_parked` moves them
to disk.
"""

from __future__ import annotations

from pathlib import Path

import trio

from openrld.actors.futures import FutureTable
from openrld.actors.host_memory import HostMemory
from openrld.actors.trainer import TrainerActor
from openrld.engine_types import ParkReport, ResumeReport
from tests.actors.test_sampler_replicas import MemoryLog

STATE = 300  # what the stand-in holds in host memory while resident
PARKED = 800  # what its park copies into host memory


class ParkingTrainer:
    def __init__(self) -> None:
        self.spilled_to: list[str] = []

    def host_state_bytes(self) -> int:
        return STATE

    def park(self) -> ParkReport:
        return ParkReport(device="cuda:0", tensors=1, bytes_held=PARKED, bytes_moved=PARKED, cache_bytes_dropped=0,
                          device_bytes_freed=PARKED, device_bytes_reserved_after=0, seconds=0.0)

    def resume(self) -> ResumeReport:
        return ResumeReport(device="cuda:0", tensors=1, bytes_moved=PARKED, seconds=0.0)

    def spill_parked(self, directory: str) -> int:
        self.spilled_to.append(directory)
        return PARKED

    def close(self) -> None:
        pass


def run_parked(memory: HostMemory) -> tuple[list[tuple[int, int, int]], ParkingTrainer]:
    """(state, parked, spilled) of the ledger: after the build, after a park, after the resume."""
    engine = ParkingTrainer()
    seen = []

    def ledger() -> tuple[int, int, int]:
        stats = memory.statistics()
        return stats.state_bytes, stats.parked_bytes, stats.spilled_bytes

    async def main() -> None:
        actor = TrainerActor(
            name="t", build_engine=lambda: engine, limiter=trio.CapacityLimiter(1), futures=FutureTable(MemoryLog()),
            checkpoints=None, sampler=None,  # type: ignore[arg-type]  # no op here saves
            host_memory=memory,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            seen.append(ledger())
            await actor.park()  # the time-slicer's calls
            seen.append(ledger())
            await actor.resume()
            seen.append(ledger())
            nursery.cancel_scope.cancel()

    trio.run(main)
    return seen, engine


def test_a_trainer_park_within_the_budget_is_held_in_host_memory(tmp_path: Path) -> None:
    seen, engine = run_parked(HostMemory(STATE + PARKED, prefix_cache_cap=0, spill_dir=tmp_path))
    assert seen == [(STATE, 0, 0), (STATE, PARKED, 0), (STATE, 0, 0)]
    assert engine.spilled_to == []


def test_a_trainer_park_past_the_budget_is_spilled_to_the_nodes_directory(tmp_path: Path) -> None:
    seen, engine = run_parked(HostMemory(STATE + PARKED - 1, prefix_cache_cap=0, spill_dir=tmp_path))
    assert seen == [(STATE, 0, 0), (STATE, 0, PARKED), (STATE, 0, 0)]
    assert engine.spilled_to == [str(tmp_path)]
