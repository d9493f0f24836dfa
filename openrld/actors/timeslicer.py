"""The time-slicer: one actor per device, granting workers turns on it under a lease.

It owns, for one device, who holds the device now, who waits for it (in
arrival order), whose state is resident on it, and how long each worker has
held it. Workers (a trainer or sampler actor) register with a *party*: workers
of one party fit on the device together (the trainer and sampler of one LoRA
group), while different parties do not and must take turns, one parked while
another runs (two groups, or the trainer and sampler of a full fine-tuning
job on one device).

Guarantees:
- one holder at a time: a worker runs engine calls only between `acquire` and
  `release` of its `DeviceLease`;
- FIFO: waiters are granted in arrival order, so nobody starves;
- turns: a worker that releases with more work keeps the device for its
  party's turn of `quantum_s` even when another party waits; past it, or when
  it releases with nothing more to do, the device goes to the next waiter;
- park before resume: before a worker of another party runs, every resident
  worker of the old party is parked (its `park()` has returned), and a parked
  worker is resumed (its `resume()` has returned) before it is granted again;
- a device with one party (an exclusive job, or a LoRA group alone on it)
  never parks anyone;
- loading is a turn too: a new worker starts parked, with nothing on the
  device, and builds its engine while holding its first lease, so two
  parties never both hold device memory outside their turns. Its first
  `resume()` finds nothing to copy back and is not counted as a resume.

It never runs an engine itself: `park` and `resume` are the worker's own
calls (`Parkable`), which run the engine in the worker's thread. The
decisions live in `DeviceTurns` (pure, sync); `TimeSlicer` is the async shell
that carries them out. It never imports torch.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import msgspec
import trio

logger = logging.getLogger(__name__)


# How soon the slicer asks again a worker that declined to park (it had work in flight,
# such as a request mid-decode); it gets the device back to finish that work meanwhile.
RETRY_PARK_S = 0.05


class Parkable(Protocol):
    """What a worker gives the time-slicer: its own park and resume, run in its own thread."""

    async def park(self) -> bool:
        """Move the worker's device state to host memory and free the device memory.

        Returns False, having moved nothing, when the worker cannot park now (work in
        flight that parking would lose); it is then granted again to finish that work.
        """

    async def resume(self) -> None:
        """Bring the parked state back onto the device."""


class LeaseState(enum.Enum):
    RUNNING = "running"  # holds the lease: its engine is in use
    WAITING = "waiting"  # asked for the lease, not granted yet
    RESIDENT = "resident"  # idle, its state on the device
    PARKING = "parking"
    PARKED = "parked"  # idle or waiting, its state in host memory
    RESUMING = "resuming"


# ---------------------------------------------------------------- decisions


class Grant(msgspec.Struct, frozen=True):
    worker: str


class Park(msgspec.Struct, frozen=True):
    worker: str


class Resume(msgspec.Struct, frozen=True):
    worker: str


class Idle(msgspec.Struct, frozen=True):
    until: float  # math.inf: until something changes


Action = Grant | Park | Resume | Idle


class WorkerLeaseStatistics(msgspec.Struct, frozen=True):
    worker: str
    party: str
    state: LeaseState
    lease_s: float  # total time it held the device
    turns: int  # grants of the lease
    parks: int
    resumes: int


class DeviceStatistics(msgspec.Struct, frozen=True):
    device: str
    holder: str | None
    waiting: int
    resident_party: str | None
    workers: list[WorkerLeaseStatistics]
    last_error: str | None


class _Worker:
    __slots__ = (
        "name", "party", "is_resident", "is_transitioning", "granted_at", "lease_s", "turns", "parks", "resumes",
        "has_loaded",
    )

    def __init__(self, name: str, party: str) -> None:
        self.name = name
        self.party = party
        self.is_resident = False  # a new worker has nothing on the device until its first turn builds it
        self.has_loaded = False  # whether it ever was resident: its first resume is a load, not a resume
        self.is_transitioning = False
        self.granted_at: float | None = None
        self.lease_s = 0.0
        self.turns = 0
        self.parks = 0
        self.resumes = 0


class DeviceTurns:
    """Who holds, waits and is resident on one device, and what happens next. Pure: no trio, no I/O.

    Times are passed in (`now`), so tests drive them; the shell calls
    `next_action` until it answers `Idle`, carrying out each action.
    """

    def __init__(self, quantum_s: float) -> None:
        self.quantum_s = quantum_s
        self._workers: dict[str, _Worker] = {}
        self._queue: deque[str] = deque()
        self.holder: str | None = None
        self.resident_party: str | None = None
        self._turn_started_at = 0.0
        self._contended_at = -math.inf  # when a worker of another party began to wait, this turn
        self._reserved_for: str | None = None  # released with more work: it keeps the device in its turn
        self._declined: tuple[str, float] | None = None  # (worker, when) that could not park yet

    def add_worker(self, name: str, party: str) -> None:
        assert name not in self._workers, f"worker {name!r} registered twice"
        self._workers[name] = _Worker(name, party)

    def has_worker(self, name: str) -> bool:
        return name in self._workers

    def remove_worker(self, name: str) -> None:
        """Forget a worker that stopped; its place in the queue and on the device is free."""
        worker = self._workers.pop(name)
        if name in self._queue:
            self._queue.remove(name)
        if self.holder == name:
            self.holder = None
        if self._reserved_for == name:
            self._reserved_for = None
        if self._declined is not None and self._declined[0] == name:
            self._declined = None
        if worker.is_resident and not self._resident():
            self.resident_party = None

    def _resident(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.is_resident]

    def _is_busy(self) -> bool:
        return self.holder is not None or any(w.is_transitioning for w in self._workers.values())

    def try_grant_now(self, name: str, now: float) -> bool:
        """Grant at once when nothing stands between `name` and the device (the common case)."""
        worker = self._workers[name]
        if self._is_busy() or self._queue or not worker.is_resident:
            return False
        if self._reserved_for not in (None, name):
            return False
        self._grant(worker, now)
        return True

    def request(self, name: str, now: float) -> None:
        """`name` waits for the lease, behind everyone already waiting."""
        assert name not in self._queue and self.holder != name, f"{name} asked twice"
        party = self._workers[name].party
        if party != self.resident_party and not any(self._workers[w].party != self.resident_party for w in self._queue):
            self._contended_at = now  # the resident party has one quantum left from here
        self._queue.append(name)

    def _turn_due(self) -> float:
        """When the resident party's turn ends: a quantum after it began, or after contention began."""
        return max(self._turn_started_at, self._contended_at) + self.quantum_s

    def withdraw(self, name: str) -> None:
        """A waiter gave up (its task was cancelled)."""
        if name in self._queue:
            self._queue.remove(name)

    def release(self, name: str, now: float, *, has_more: bool) -> None:
        """The holder is done with the device for now; `has_more`: it will ask again at once."""
        assert self.holder == name, f"{name} released a lease held by {self.holder}"
        worker = self._workers[name]
        assert worker.granted_at is not None
        worker.lease_s += now - worker.granted_at
        worker.granted_at = None
        self.holder = None
        # With nobody of another party waiting, its turn has no end yet; one starts when someone asks.
        in_turn = not self._other_party_waits() or now < self._turn_due()
        self._reserved_for = name if has_more and in_turn else None

    def _other_party_waits(self) -> bool:
        return any(self._workers[w].party != self.resident_party for w in self._queue)

    def next_action(self, now: float) -> Action:
        """The next step towards serving the waiters; `Idle` when there is none to take now."""
        if self._is_busy():
            return Idle(math.inf)
        if self._declined is not None:
            name, at = self._declined
            if name in self._queue:  # it finishes its work in flight first, ahead of the line
                self._queue.remove(name)
                self._declined = None
                return self._grant(self._workers[name], now)
            if now < at + RETRY_PARK_S:
                return Idle(at + RETRY_PARK_S)
            self._declined = None
        due = self._turn_due()
        if self._reserved_for is not None and self._other_party_waits() and now >= due:
            self._reserved_for = None  # its party's turn is over: it waits in line like anyone
        reserved = self._reserved_for
        if reserved is not None and reserved in self._queue:
            self._queue.remove(reserved)
            return self._grant(self._workers[reserved], now)
        if not self._queue:
            return Idle(math.inf)
        head = self._workers[self._queue[0]]
        if self.resident_party not in (None, head.party):
            if self._reserved_for is not None:
                return Idle(due)  # the holder's party keeps its turn until it is due
            # Another party is on the device: it leaves, one worker at a time, before anyone resumes.
            leaving = self._resident()[0]
            leaving.is_transitioning = True
            return Park(leaving.name)
        if not head.is_resident:
            head.is_transitioning = True
            return Resume(head.name)
        self._queue.popleft()
        return self._grant(head, now)

    def _grant(self, worker: _Worker, now: float) -> Grant:
        if self.resident_party != worker.party:
            self._turn_started_at, self._contended_at = now, -math.inf
        self.resident_party = worker.party
        self.holder = worker.name
        self._reserved_for = None
        worker.granted_at = now
        worker.turns += 1
        return Grant(worker.name)

    def parked(self, name: str, now: float, *, is_parked: bool = True) -> None:
        """A Park finished; `is_parked=False`: the worker declined, and stays resident for now."""
        worker = self._workers[name]
        worker.is_transitioning = False
        if not is_parked:
            self._declined = (name, now)
            return
        worker.is_resident = False
        worker.parks += 1
        if not self._resident():
            self.resident_party = None

    def resumed(self, name: str, now: float) -> None:
        worker = self._workers[name]
        worker.is_transitioning = False
        worker.is_resident = True
        if worker.has_loaded:
            worker.resumes += 1
        worker.has_loaded = True
        if self.resident_party != worker.party:
            self._turn_started_at, self._contended_at = now, -math.inf
        self.resident_party = worker.party

    def claim_resident(self, name: str) -> bool:
        """A worker whose engine was just built on the device: resident, if its party may be there.

        Returns False when another party is on the device: the worker must park its
        state now, and it resumes before its first turn.
        """
        worker = self._workers[name]
        worker.has_loaded = True  # built either way: a later resume brings back parked state
        if self.resident_party not in (None, worker.party):
            return False
        worker.is_resident = True
        self.resident_party = worker.party
        return True

    def is_due(self, name: str, now: float) -> bool:
        """Whether `name`'s party is on the device, a worker of another party waits, and the turn is over."""
        return (
            self.resident_party == self._workers[name].party
            and self._other_party_waits()
            and now >= self._turn_due()
        )

    def state_of(self, name: str) -> LeaseState:
        worker = self._workers[name]
        if self.holder == name:
            return LeaseState.RUNNING
        if worker.is_transitioning:
            return LeaseState.PARKING if worker.is_resident else LeaseState.RESUMING
        if name in self._queue:
            return LeaseState.WAITING
        return LeaseState.RESIDENT if worker.is_resident else LeaseState.PARKED

    def statistics(self, now: float) -> list[WorkerLeaseStatistics]:
        return [
            WorkerLeaseStatistics(
                worker=w.name, party=w.party, state=self.state_of(w.name),
                lease_s=w.lease_s + (now - w.granted_at if w.granted_at is not None else 0.0),
                turns=w.turns, parks=w.parks, resumes=w.resumes,
            )
            for w in self._workers.values()
        ]

    def queue_depth(self) -> int:
        return len(self._queue)


# ---------------------------------------------------------------- handle


class TakesTurns:
    """`hold`, around a lease's own `acquire` and `release`: one device's lease, or a group's on several."""

    async def acquire(self) -> None:
        raise NotImplementedError

    def release(self, *, has_more: bool) -> None:
        raise NotImplementedError

    @asynccontextmanager
    async def hold(self, has_more: Callable[[], bool]) -> AsyncIterator[None]:
        """Hold the device(s) around one batch of engine calls; `has_more()` is asked at the end."""
        await self.acquire()
        try:
            yield
        finally:
            self.release(has_more=has_more())


class DeviceLease(TakesTurns):
    """One worker's lease on one device: the only thing a worker holds of the time-slicer.

    Several tasks of one worker (a sampler's replicas) may hold it at once: the
    first to acquire takes the device, the last to release gives it back.
    """

    def __init__(self, slicer: TimeSlicer, worker: str) -> None:
        self._slicer = slicer
        self.worker = worker
        self.device = slicer.device
        self._holders = 0
        self._taking = trio.Lock()

    async def acquire(self) -> None:
        """Wait for this worker's turn; when it returns, the worker's state is on the device."""
        if self._holders > 0:  # another task of this worker holds the device: share its turn
            await trio.lowlevel.checkpoint_if_cancelled()
            self._holders += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        async with self._taking:
            if self._holders == 0:
                await self._slicer.acquire(self.worker)
            self._holders += 1

    def release(self, *, has_more: bool) -> None:
        """Done with the device for now; `has_more`: the worker will ask again at once."""
        self._holders -= 1
        if self._holders == 0:
            self._slicer.release(self.worker, has_more=has_more)

    def is_due(self) -> bool:
        """Another party waits and this party's turn is over: start no new work, finish what runs."""
        return self._slicer.turns.is_due(self.worker, trio.current_time())

    def claim_resident(self) -> bool:
        """Say the worker's engine was just built on the device; False: park it now (see DeviceTurns)."""
        return self._slicer.turns.claim_resident(self.worker)

    def close(self) -> None:
        self._slicer.unregister(self.worker)

    def state(self) -> LeaseState:
        return self._slicer.turns.state_of(self.worker)

    def statistics(self) -> WorkerLeaseStatistics:
        return next(s for s in self._slicer.turns.statistics(trio.current_time()) if s.worker == self.worker)


class NoLease:
    """The lease of a worker on a device it never shares: always granted, never parked."""

    device = ""

    @asynccontextmanager
    async def hold(self, has_more: Callable[[], bool]) -> AsyncIterator[None]:
        yield

    def is_due(self) -> bool:
        return False

    def claim_resident(self) -> bool:
        return True

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- actor


class TimeSlicer:
    """The async shell around DeviceTurns for one device: grants, parks and resumes."""

    def __init__(self, device: str, *, quantum_s: float) -> None:
        self.device = device
        self.turns = DeviceTurns(quantum_s)
        self._parkables: dict[str, Parkable] = {}
        self._granted: dict[str, trio.Event] = {}
        self._wake = trio.Event()
        self._last_error: str | None = None

    def register(self, worker: str, party: str, parkable: Parkable) -> DeviceLease:
        """A new worker on this device; `party` says who may be co-resident.

        A name already taken (a group restarted after a failed start) gets a suffix.
        """
        base, n = worker, 1
        while self.turns.has_worker(worker):
            n += 1
            worker = f"{base} #{n}"
        self.turns.add_worker(worker, party)
        self._parkables[worker] = parkable
        return DeviceLease(self, worker)

    def unregister(self, worker: str) -> None:
        self.turns.remove_worker(worker)
        self._parkables.pop(worker, None)
        self._wake.set()

    async def acquire(self, worker: str) -> None:
        # A checkpoint either way, as trio's locks are; a cancel comes before the grant, never after.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.turns.try_grant_now(worker, trio.current_time()):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        granted = self._granted[worker] = trio.Event()
        self.turns.request(worker, trio.current_time())
        self._wake.set()
        try:
            await granted.wait()
        except BaseException:
            # Cancelled while waiting: give the place up, or the turn if it came at the same moment.
            if self.turns.holder == worker:
                self.release(worker, has_more=False)
            else:
                self.turns.withdraw(worker)
                self._wake.set()
            raise
        finally:
            self._granted.pop(worker, None)

    def release(self, worker: str, *, has_more: bool) -> None:
        self.turns.release(worker, trio.current_time(), has_more=has_more)
        if self.turns.queue_depth():  # with nobody waiting there is nothing for the actor to decide
            self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[TimeSlicer] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        while True:
            action = self.turns.next_action(trio.current_time())
            match action:
                case Grant(worker=worker):
                    self._granted[worker].set()
                case Park(worker=worker):
                    is_parked = await self._park(worker)
                    if self.turns.has_worker(worker):  # its group may have stopped meanwhile
                        self.turns.parked(worker, trio.current_time(), is_parked=is_parked)
                    logger.info("park device=%s worker=%s parked=%s", self.device, worker, is_parked)
                case Resume(worker=worker):
                    await self._resume(worker)
                    if self.turns.has_worker(worker):
                        self.turns.resumed(worker, trio.current_time())
                    logger.info("resumed device=%s worker=%s", self.device, worker)
                case Idle(until=until):
                    with trio.move_on_at(until):
                        await self._wake.wait()
                    self._wake = trio.Event()

    async def _park(self, worker: str) -> bool:
        try:
            return await self._parkables[worker].park()
        except Exception as error:  # one worker's failed offload must not stop the device for everyone
            logger.exception("park failed device=%s worker=%s", self.device, worker)
            self._last_error = f"park {worker}: {type(error).__name__}: {error}"
            return True  # counted as parked: its next resume tells whether its state survived

    async def _resume(self, worker: str) -> None:
        try:
            await self._parkables[worker].resume()
        except Exception as error:  # the worker's own next engine call fails and reports it
            logger.exception("resume failed device=%s worker=%s", self.device, worker)
            self._last_error = f"resume {worker}: {type(error).__name__}: {error}"

    def statistics(self) -> DeviceStatistics:
        return DeviceStatistics(
            device=self.device, holder=self.turns.holder, waiting=self.turns.queue_depth(),
            resident_party=self.turns.resident_party, workers=self.turns.statistics(trio.current_time()),
            last_error=self._last_error,
        )
