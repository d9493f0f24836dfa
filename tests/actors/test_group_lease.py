"""A trainer on several devices takes turns on all of them at once (actors/group_lease.py).

The workers are in-test recorders (the engine is the edge the actors cannot reach); each
park and resume takes 1 s of trio's autojump MockClock, so every time below is exact.
"""

from __future__ import annotations

import trio

from openrld.actors.group_lease import GroupLease
from openrld.actors.timeslicer import LeaseState, TimeSlicer

QUANTUM_S = 10.0


class Recorder:
    """A worker's park and resume, each taking 1 s, written with the time it ended."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    async def park(self) -> bool:
        await trio.sleep(1.0)
        self.log.append(f"park {self.name} at {trio.current_time():g}")
        return True

    async def resume(self) -> None:
        await trio.sleep(1.0)
        self.log.append(f"resume {self.name} at {trio.current_time():g}")


async def start_slicers(nursery: trio.Nursery, count: int) -> list[TimeSlicer]:
    return [await nursery.start(TimeSlicer(f"cpu:{i}", quantum_s=QUANTUM_S).run) for i in range(count)]


async def run_batches(lease, log: list[str], name: str, batches: int, batch_s: float = 1.0) -> None:
    for done in range(1, batches + 1):
        async with lease.hold(has_more=lambda done=done: done < batches):
            log.append(f"run {name} at {trio.current_time():g}")
            await trio.sleep(batch_s)


async def test_a_group_waits_for_every_device_and_comes_back_only_once_it_holds_them_all(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        group = GroupLease(slicers, "g trainer", "g", Recorder("g", log))
        other = slicers[1].register("q sampler", "q", Recorder("q", log))
        await run_batches(group, log, "g", 1)
        await run_batches(other, log, "q", 1)
        parked = group.statistics().state  # cpu:0's slicer still counts it resident: it parked for cpu:1
        await run_batches(group, log, "g", 1)
        stats = group.statistics()
        nursery.cancel_scope.cancel()
    # g's load is its first turn (nothing to resume); q's turn on cpu:1 parks the whole group, and the
    # group's state comes back after cpu:1 is its own again (q parked at 5), not when cpu:0 was granted.
    assert log == [
        "run g at 0", "park g at 2", "resume q at 3", "run q at 3", "park q at 5", "resume g at 6", "run g at 6",
    ]
    assert (parked, stats.state, stats.parks, stats.resumes) == (LeaseState.PARKED, LeaseState.RESIDENT, 1, 1)


async def test_a_group_is_not_brought_back_while_another_party_holds_one_of_its_devices(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        group = GroupLease(slicers, "g trainer", "g", Recorder("g", log))
        short = slicers[0].register("p", "p", Recorder("p", log))
        long = slicers[1].register("q", "q", Recorder("q", log))
        await run_batches(group, log, "g", 1)
        nursery.start_soon(run_batches, short, log, "p", 1, 1.0)
        nursery.start_soon(run_batches, long, log, "q", 1, 10.0)
        await trio.sleep(2.5)
        await run_batches(group, log, "g", 1)
        nursery.cancel_scope.cancel()
    # cpu:0 is g's again at 5, but q runs on cpu:1 until 13: g's ranks come back only after q parks.
    assert [line for line in log if " g " in f"{line} "] == ["run g at 0", "park g at 2", "resume g at 15", "run g at 15"]


async def test_two_devices_asking_at_once_park_the_group_once(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        group = GroupLease(slicers, "g trainer", "g", Recorder("g", log))
        first = slicers[0].register("a", "a", Recorder("a", log))
        second = slicers[1].register("b", "b", Recorder("b", log))
        await run_batches(group, log, "g", 1)
        async with trio.open_nursery() as others:
            others.start_soon(run_batches, first, log, "a", 1)
            others.start_soon(run_batches, second, log, "b", 1)
        stats = group.statistics()
        nursery.cancel_scope.cancel()
    assert log[:2] == ["run g at 0", "park g at 2"]
    assert sorted(log[2:]) == ["resume a at 3", "resume b at 3", "run a at 3", "run b at 3"]
    assert stats.parks == 1


async def test_two_groups_on_the_same_devices_take_whole_turns_without_deadlock(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        one = GroupLease(slicers, "one trainer", "one", Recorder("one", log))
        two = GroupLease(slicers, "two trainer", "two", Recorder("two", log))
        async with trio.open_nursery() as groups:
            groups.start_soon(run_batches, one, log, "one", 3)
            await trio.sleep(0.5)
            groups.start_soon(run_batches, two, log, "two", 3)
        nursery.cancel_scope.cancel()
    # one keeps both devices for its 3 batches (within its quantum); two's first device parks it, and
    # its second finds it parked already: one park, never a run of one group inside the other's.
    assert log == ["run one at 0", "run one at 1", "run one at 2", "park one at 4", "run two at 4", "run two at 5",
                   "run two at 6"]


async def test_a_group_cancelled_while_waiting_gives_back_the_devices_it_held(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        holder = slicers[1].register("q", "q", Recorder("q", log))
        group = GroupLease(slicers, "g trainer", "g", Recorder("g", log))
        async with holder.hold(has_more=lambda: False):
            with trio.move_on_after(3.0):
                await group.acquire()
            states = [(s.statistics().holder, s.statistics().waiting) for s in slicers]
        nursery.cancel_scope.cancel()
    assert states == [(None, 0), ("q", 0)]


async def test_a_group_is_due_when_its_turn_is_over_on_any_device(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicers = await start_slicers(nursery, 2)
        group = GroupLease(slicers, "g trainer", "g", Recorder("g", log))
        waiter = slicers[1].register("w", "w", Recorder("w", log))
        async with group.hold(has_more=lambda: False):
            nursery.start_soon(waiter.acquire)
            await trio.sleep(QUANTUM_S - 1.0)
            before = group.is_due()
            await trio.sleep(1.0)
            after = group.is_due()
        nursery.cancel_scope.cancel()
    assert (before, after) == (False, True)
