"""The time-slicer: FIFO turns, a quantum per party, park before resume, lease time per worker.

Workers here are trivial in-test workers (the edge the actor cannot reach is the
engine); time is trio's autojump MockClock, so every figure below is exact.
"""

from __future__ import annotations

import math

import trio

from openrld.actors.timeslicer import DeviceTurns, Grant, Idle, LeaseState, Park, Resume, TimeSlicer

QUANTUM_S = 10.0


class Recorder:
    """A worker's park/resume, each taking `transition_s`, written to a shared log."""

    def __init__(self, name: str, log: list[str], transition_s: float = 1.0) -> None:
        self.name = name
        self.log = log
        self.transition_s = transition_s

    async def park(self) -> bool:
        await trio.sleep(self.transition_s)
        self.log.append(f"park {self.name}")
        return True

    async def resume(self) -> None:
        await trio.sleep(self.transition_s)
        self.log.append(f"resume {self.name}")


async def start_slicer(nursery: trio.Nursery) -> TimeSlicer:
    return await nursery.start(TimeSlicer("cpu:0", quantum_s=QUANTUM_S).run)


async def run_batches(lease, log: list[str], name: str, batches: int, batch_s: float) -> None:
    """A worker with `batches` batches of work, holding the lease around each."""
    for done in range(1, batches + 1):
        async with lease.hold(has_more=lambda done=done: done < batches):
            log.append(f"run {name} at {trio.current_time():g}")
            await trio.sleep(batch_s)


# ---------------------------------------------------------------- DeviceTurns (pure)


def test_a_resident_worker_alone_is_granted_at_once():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("trainer", "job-a")
    turns.claim_resident("trainer")
    assert turns.try_grant_now("trainer", 0.0) is True
    assert turns.state_of("trainer") is LeaseState.RUNNING


def test_a_waiter_of_another_party_parks_the_idle_resident_then_resumes():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("a", "a")
    turns.add_worker("b", "b")
    turns.claim_resident("a")
    turns.claim_resident("b")  # party a is on the device, so b's state counts as parked
    turns.request("b", 0.0)
    assert turns.next_action(0.0) == Park("a")
    assert turns.next_action(0.0) == Idle(math.inf)  # nothing more until the park is done
    turns.parked("a", 1.0)
    assert turns.next_action(1.0) == Resume("b")
    turns.resumed("b", 2.0)
    assert turns.next_action(2.0) == Grant("b")
    assert [turns.state_of("a"), turns.state_of("b")] == [LeaseState.PARKED, LeaseState.RUNNING]


def test_a_new_workers_first_turn_parks_the_other_party_and_its_load_is_no_resume():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("a", "a")
    turns.claim_resident("a")
    turns.add_worker("b", "b")  # nothing on the device yet: it builds its engine in its first turn
    assert turns.try_grant_now("b", 0.0) is False
    turns.request("b", 0.0)
    assert turns.next_action(0.0) == Park("a")
    turns.parked("a", 1.0)
    assert turns.next_action(1.0) == Resume("b")  # the worker's resume finds nothing to bring back
    turns.resumed("b", 1.0)
    assert turns.next_action(1.0) == Grant("b")
    assert [(s.worker, s.parks, s.resumes) for s in turns.statistics(2.0)] == [("a", 1, 0), ("b", 0, 0)]


def test_workers_of_one_party_take_turns_without_parking():
    turns = DeviceTurns(QUANTUM_S)
    for name in ("trainer", "sampler"):
        turns.add_worker(name, "group")
        turns.claim_resident(name)
    assert turns.try_grant_now("trainer", 0.0)
    turns.request("sampler", 0.0)
    turns.release("trainer", 1.0, has_more=True)
    assert turns.next_action(1.0) == Grant("sampler")


def test_holder_with_more_work_keeps_the_device_until_its_quantum_is_due():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("a", "a")
    turns.add_worker("b", "b")
    turns.claim_resident("a")
    assert turns.try_grant_now("a", 0.0)
    turns.request("b", 2.0)  # contention begins at 2 s: a may keep the device until 12 s
    turns.release("a", 3.0, has_more=True)
    assert turns.next_action(3.0) == Idle(12.0)
    assert turns.try_grant_now("a", 3.0) is False  # b waits, so a asks through the queue
    turns.request("a", 3.0)
    assert turns.next_action(3.0) == Grant("a")
    turns.release("a", 12.0, has_more=True)
    assert turns.next_action(12.0) == Park("a")


def test_holder_with_nothing_more_hands_over_at_once():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("a", "a")
    turns.add_worker("b", "b")
    turns.claim_resident("a")
    assert turns.try_grant_now("a", 0.0)
    turns.request("b", 0.5)
    turns.release("a", 1.0, has_more=False)
    assert turns.next_action(1.0) == Park("a")


def test_a_worker_that_declines_to_park_is_granted_again_ahead_of_the_line():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("sampler", "sampler")
    turns.add_worker("trainer", "trainer")
    turns.claim_resident("sampler")
    assert turns.try_grant_now("sampler", 0.0)
    turns.request("trainer", 0.0)
    turns.release("sampler", 0.0, has_more=False)
    assert turns.next_action(0.0) == Park("sampler")
    turns.parked("sampler", 0.0, is_parked=False)  # a request is mid-decode
    assert turns.state_of("sampler") is LeaseState.RESIDENT
    turns.request("sampler", 0.01)
    assert turns.next_action(0.01) == Grant("sampler")
    turns.release("sampler", 0.02, has_more=False)
    assert turns.next_action(0.02) == Park("sampler")


def test_turn_is_due_only_once_another_party_has_waited_a_quantum():
    turns = DeviceTurns(QUANTUM_S)
    turns.add_worker("a", "a")
    turns.add_worker("b", "b")
    turns.claim_resident("a")
    assert turns.try_grant_now("a", 0.0)
    assert turns.is_due("a", 100.0) is False  # nobody waits: a's turn has no end
    turns.request("b", 100.0)
    assert (turns.is_due("a", 109.0), turns.is_due("a", 110.0), turns.is_due("b", 110.0)) == (False, True, False)


# ---------------------------------------------------------------- TimeSlicer under the fake clock


async def test_replicas_of_one_worker_share_its_lease(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        sampler = slicer.register("sampler", "sampler", Recorder("sampler", log))
        sampler.claim_resident()
        async with trio.open_nursery() as replicas:
            for name in ("r0", "r1"):
                replicas.start_soon(run_batches, sampler, log, name, 2, 1.0)
        stats = slicer.statistics().workers[0]
        nursery.cancel_scope.cancel()
    # Both replicas ran at once; their holds overlap, so the one grant lasts both batches: 2 s held (not 4).
    assert sorted(log) == ["run r0 at 0", "run r0 at 1", "run r1 at 0", "run r1 at 1"]
    assert (stats.turns, stats.lease_s) == (1, 2.0)


async def test_park_of_the_holder_comes_before_resume_of_the_waiter(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        trainer = slicer.register("trainer", "trainer", Recorder("trainer", log))
        sampler = slicer.register("sampler", "sampler", Recorder("sampler", log))
        trainer.claim_resident()
        async with trainer.hold(has_more=lambda: False):
            log.append("run trainer")
            nursery.start_soon(run_batches, sampler, log, "sampler", 1, 2.0)
            await trio.sleep(5.0)
        await trio.sleep(20.0)
        nursery.cancel_scope.cancel()
    # The trainer ran 0-5 s; its park takes 1 s, the sampler's resume 1 s.
    assert log == ["run trainer", "park trainer", "resume sampler", "run sampler at 7"]


async def test_waiters_of_three_parties_are_granted_in_arrival_order(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        leases = {name: slicer.register(name, name, Recorder(name, log, transition_s=0.0)) for name in "abc"}
        leases["a"].claim_resident()
        async with leases["a"].hold(has_more=lambda: False):
            for name in "cb":  # c asks first
                nursery.start_soon(run_batches, leases[name], log, name, 1, 1.0)
                await trio.sleep(0.5)
        await trio.sleep(10.0)
        nursery.cancel_scope.cancel()
    runs = [line for line in log if line.startswith("run")]
    assert runs == ["run c at 1", "run b at 2"]


async def test_a_busy_worker_cannot_starve_a_waiter_past_one_quantum(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        busy = slicer.register("busy", "busy", Recorder("busy", log, transition_s=0.0))
        other = slicer.register("other", "other", Recorder("other", log, transition_s=0.0))
        busy.claim_resident()
        nursery.start_soon(run_batches, busy, log, "busy", 100, 1.0)
        await trio.sleep(2.5)
        nursery.start_soon(run_batches, other, log, "other", 1, 1.0)
        await trio.sleep(200.0)
        nursery.cancel_scope.cancel()
    # other asked at 2.5 s; busy keeps its turn to 12.5 s and releases at 13 s, after the batch begun at 12 s.
    # Parks and resumes take no time here; other runs 13-14 s, then busy's parked state comes back.
    start = log.index("run busy at 12")
    assert log[start : start + 7] == [
        "run busy at 12", "park busy", "resume other", "run other at 13", "park other", "resume busy", "run busy at 14",
    ]


async def test_lease_time_is_recorded_per_worker(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        a = slicer.register("a", "group", Recorder("a", log))
        b = slicer.register("b", "group", Recorder("b", log))
        a.claim_resident()
        b.claim_resident()
        await run_batches(a, log, "a", 3, 2.0)
        await run_batches(b, log, "b", 1, 0.5)
        stats = {s.worker: s for s in slicer.statistics().workers}
        nursery.cancel_scope.cancel()
    assert (stats["a"].lease_s, stats["a"].turns) == (6.0, 3)
    assert (stats["b"].lease_s, stats["b"].turns) == (0.5, 1)
    assert stats["a"].parks == stats["b"].parks == 0


async def test_a_parked_worker_is_resumed_before_its_next_turn(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        a = slicer.register("a", "a", Recorder("a", log))
        b = slicer.register("b", "b", Recorder("b", log))
        a.claim_resident()
        await run_batches(a, log, "a", 1, 1.0)
        await run_batches(b, log, "b", 1, 1.0)
        await run_batches(a, log, "a", 1, 1.0)
        assert [a.state(), b.state()] == [LeaseState.RESIDENT, LeaseState.PARKED]
        nursery.cancel_scope.cancel()
    assert log == ["run a at 0", "park a", "resume b", "run b at 3", "park b", "resume a", "run a at 6"]


async def test_a_cancelled_waiter_gives_up_its_place(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await start_slicer(nursery)
        a = slicer.register("a", "a", Recorder("a", log))
        b = slicer.register("b", "b", Recorder("b", log))
        a.claim_resident()
        async with a.hold(has_more=lambda: False):
            with trio.move_on_after(1.0):
                await b.acquire()
            assert slicer.statistics().waiting == 0
        await trio.sleep(5.0)
        assert (b.state(), log) == (LeaseState.PARKED, [])  # nobody waits, so a is never parked
        nursery.cancel_scope.cancel()


async def test_a_party_alone_on_its_device_is_never_parked(autojump_clock):
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        slicer = await nursery.start(TimeSlicer("cuda:1", quantum_s=QUANTUM_S).run)
        trainer = slicer.register("trainer", "hero", Recorder("trainer", log))
        sampler = slicer.register("sampler", "hero", Recorder("sampler", log))
        trainer.claim_resident()
        sampler.claim_resident()
        async with trio.open_nursery() as work:
            work.start_soon(run_batches, trainer, log, "trainer", 20, 1.0)
            work.start_soon(run_batches, sampler, log, "sampler", 20, 1.0)
        nursery.cancel_scope.cancel()
    assert [line for line in log if not line.startswith("run")] == []
    assert len(log) == 40
