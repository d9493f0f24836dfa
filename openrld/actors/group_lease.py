"""One worker's turns on several devices at once: the lease of a trainer that is a torchrun group.

A trainer spread over N devices (openrl.trainer_gpus = N, one rank per device) runs
only when it holds every one of them, and it parks and resumes on all of its ranks
together (one engine call reaches every rank, `worker/ranks.py`). Each device keeps
its own time-slicer (`actors/timeslicer.py`), which knows nothing of groups; this
module makes the group one worker on each of them.

What it owns: the worker's `DeviceLease` on each of its devices, and whether the
group's state is on its devices or parked in host memory.

Guarantees:
- it computes only while holding every device's lease;
- no deadlock: it takes the leases one at a time in device order, the order in
  which `DevicePool` lists a group's ranks, so every spread group asks in the same
  order and no two can each hold a device the other waits for;
- a park asked by any one device's slicer parks the whole group, once, and counts
  as parked on every device: a slicer that asks again finds it parked and is told
  so at once. Two slicers asking together park it once (a lock);
- it resumes only once it holds every lease: a slicer's own resume is a no-op, since
  bringing the ranks back then would put state on devices another party still holds.
  Until then the device whose slicer "resumed" it holds nothing of the group;
- while it waits for a later device it holds the earlier ones, idle: a slicer of
  one of those never asks it to park then (it is their holder), and its state is
  wherever it was: parked, or resident under the leases it holds and the ones it
  waits for.

Why by hand: this is openrld's own scheduling; no library knows its time-slicer.
It never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import trio

from openrld.actors.timeslicer import DeviceLease, LeaseState, Parkable, TakesTurns, TimeSlicer, WorkerLeaseStatistics

__all__ = ["GroupLease"]


class _GroupParking:
    """What each device's slicer parks and resumes: the whole group, parked once, resumed by the lease."""

    def __init__(self, parkable: Parkable) -> None:
        self._parkable = parkable
        self._lock = trio.Lock()
        self.is_parked = False
        self.parks = 0
        self.resumes = 0

    async def park(self) -> bool:
        async with self._lock:
            if not self.is_parked:
                if not await self._parkable.park():
                    return False
                self.is_parked = True
                self.parks += 1
            return True

    async def resume(self) -> None:
        """A slicer's resume: nothing yet; the group comes back when its lease holds every device."""

    async def bring_back(self) -> None:
        async with self._lock:
            if self.is_parked:
                await self._parkable.resume()
                self.is_parked = False
                self.resumes += 1


class GroupLease(TakesTurns):
    """A worker's leases on several devices, acquired and released together (as `DeviceLease` is on one);
    `hold` is `TakesTurns`'."""

    def __init__(self, slicers: Sequence[TimeSlicer], worker: str, party: str, parkable: Parkable) -> None:
        """`slicers` in device order: the order the group takes its leases in (see the module's docstring)."""
        assert len(slicers) > 1, "a worker on one device takes a DeviceLease"
        self._parking = _GroupParking(parkable)
        self._leases: list[DeviceLease] = [slicer.register(worker, party, self._parking) for slicer in slicers]
        self.worker = self._leases[0].worker
        self.device = self._leases[0].device  # its first rank's, as the trainer's statistics name one device
        self.devices = tuple(lease.device for lease in self._leases)

    async def acquire(self) -> None:
        """Wait for every device, in order; when it returns, the group's state is on all of them."""
        taken: list[DeviceLease] = []
        try:
            for lease in self._leases:
                await lease.acquire()
                taken.append(lease)
            # Shielded: a resume half done and abandoned would leave ranks neither parked nor resident.
            with trio.CancelScope(shield=True):
                await self._parking.bring_back()
        except BaseException:
            for lease in reversed(taken):
                lease.release(has_more=False)
            raise

    def release(self, *, has_more: bool) -> None:
        for lease in self._leases:
            lease.release(has_more=has_more)

    def is_due(self) -> bool:
        """Another party waits on any of its devices and the turn there is over: start no new work."""
        return any(lease.is_due() for lease in self._leases)

    def close(self) -> None:
        for lease in self._leases:
            lease.close()

    def statistics(self) -> WorkerLeaseStatistics:
        """Its first device's lease time and turns, with the group's own state, parks and resumes
        (a slicer that asks a parked group to park again counts a park there; the group parked once)."""
        first = self._leases[0].statistics()
        return msgspec.structs.replace(
            first, state=self._state(), parks=self._parking.parks, resumes=self._parking.resumes
        )

    def _state(self) -> LeaseState:
        states = [lease.state() for lease in self._leases]
        if all(state is LeaseState.RUNNING for state in states):
            return LeaseState.RUNNING
        if any(state in (LeaseState.RUNNING, LeaseState.WAITING) for state in states):
            return LeaseState.WAITING  # it holds some of its devices and waits for the rest
        return LeaseState.PARKED if self._parking.is_parked else LeaseState.RESIDENT
