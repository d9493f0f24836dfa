"""Which of this node's devices each worker group runs on, and the per-device actors.

This module owns the node's device placement (`DevicePool`, pure) and the
per-device runtime pieces the groups use (`NodeDevices`: one time-slicer and
one thread limiter per device).

Placement of a group (a trainer and a sampler):
- with two free devices, the trainer and the sampler each get one;
- with one free device, both share it (workers of one group fit together);
- with none, a shared group joins the least-loaded device that holds no
  exclusive group, and takes turns on it with the groups already there;
- an exclusive group (`openrl.exclusive=true`) takes free devices only, and
  nothing else is ever placed on them; with no free device its creation fails;
- a group whose trainer spans N devices (openrl.trainer_gpus = N, a torchrun
  group) takes N free devices for it, and its sampler the next free device, or
  its trainer's first when there is none. With fewer than N free, a shared one
  takes the N least-loaded devices that no exclusive group holds (in device
  order; its sampler shares the first) and takes turns on each of them; an
  exclusive one, or a shared one on a node with fewer than N such devices, is
  refused, naming the key and how many devices this node has.

Placement is decided synchronously, on the event loop, when a job is created,
so two creations can never book the same free device. It never imports torch
and never starts an engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import trio

from openrld.actors.timeslicer import DeviceStatistics, TimeSlicer
from openrld.errors import NoCapacity, NoSharedDevice

logger = logging.getLogger(__name__)


class Placement(msgspec.Struct, frozen=True):
    key: str  # the group's key
    trainer_device: str  # its first rank's, for a trainer on several devices
    sampler_device: str
    is_exclusive: bool
    trainer_devices: tuple[str, ...] = ()  # every rank's, in rank order, for a trainer on several devices

    @property
    def trainer_ranks(self) -> tuple[str, ...]:
        """The trainer's device for each of its ranks (one rank: its one device)."""
        return self.trainer_devices or (self.trainer_device,)


class DeviceUse(msgspec.Struct, frozen=True):
    device: str
    groups: list[str]  # group keys placed on it, in placement order
    is_exclusive: bool


class DevicePool:
    """Which groups sit on which devices. Pure: no trio, no I/O."""

    def __init__(self, devices: Sequence[str]) -> None:
        assert devices, "a node needs at least one device"
        self._devices = list(devices)
        self._placements: dict[str, Placement] = {}
        self._labels: dict[str, str] = {}  # key -> how messages name the group

    def _groups_on(self, device: str) -> list[str]:
        return [
            key for key, p in self._placements.items() if device in (*p.trainer_ranks, p.sampler_device)
        ]

    def _is_exclusive(self, device: str) -> bool:
        return any(self._placements[key].is_exclusive for key in self._groups_on(device))

    def free_devices(self) -> list[str]:
        return [d for d in self._devices if not self._groups_on(d)]

    def place(self, key: str, *, exclusive: bool, label: str, trainer_devices: int = 1) -> Placement:
        """Devices for group `key` (placing it again answers the first placement).

        Args:
            key: the group's key.
            exclusive: the group must have its devices to itself.
            label: how errors name the group ("job s:train:0", "base model tiny-llama").
            trainer_devices: how many devices its trainer spans (a torchrun group, one rank each).

        Raises:
            NoCapacity (a BadRequest): exclusive, and no device is free (key `openrl.exclusive`);
                or fewer devices than `trainer_devices` it may take: free ones when exclusive,
                else ones no exclusive group holds (key `openrl.trainer_gpus`).
            NoSharedDevice (a ServiceUnavailable): every device is held by an exclusive group.
        """
        if key in self._placements:
            return self._placements[key]
        if trainer_devices > 1:
            return self._place_spread(key, label, trainer_devices, exclusive=exclusive)
        free = self.free_devices()
        if len(free) >= 2:
            trainer, sampler = free[0], free[1]
        elif free:
            trainer = sampler = free[0]
        elif exclusive:
            raise NoCapacity(
                f"openrl.exclusive=true: {label} needs a device of its own, and every device of this node "
                f"is in use ({self._describe_use()}); drop openrl.exclusive, or wait for a job to end",
                key="openrl.exclusive",
            )
        else:
            shared = [d for d in self._devices if not self._is_exclusive(d)]
            if not shared:
                raise NoSharedDevice(
                    f"{label}: every device of this node is held by an exclusive job ({self._describe_use()})"
                )
            trainer = sampler = min(shared, key=lambda d: (len(self._groups_on(d)), self._devices.index(d)))
        placement = Placement(key=key, trainer_device=trainer, sampler_device=sampler, is_exclusive=exclusive)
        self._placements[key] = placement
        self._labels[key] = label
        logger.info(
            "placed group=%s trainer_device=%s sampler_device=%s exclusive=%s", key, trainer, sampler, exclusive
        )
        return placement

    def _place_spread(self, key: str, label: str, count: int, *, exclusive: bool) -> Placement:
        """A group whose trainer spans `count` devices: free ones when there are enough, else
        (shared only) the least-loaded ones no exclusive group holds, taken in turns."""
        free = self.free_devices()
        if len(free) >= count:
            ranks = tuple(free[:count])
            sampler = free[count] if len(free) > count else ranks[0]
        else:
            shared = [d for d in self._devices if not self._is_exclusive(d)]
            if exclusive or len(shared) < count:
                total = len(self._devices)
                have = f"{len(free)} free of {total}" if exclusive else f"{total}, {len(shared)} held by no exclusive job"
                raise NoCapacity(
                    f"openrl.trainer_gpus={count}: {label} needs {count} {'free ' if exclusive else ''}devices on "
                    f"one node, and this node has {have} ({self._describe_use()})",
                    key="openrl.trainer_gpus",
                )
            least = sorted(shared, key=lambda d: (len(self._groups_on(d)), self._devices.index(d)))[:count]
            # Rank order is device order: every group takes its leases in that order, so none deadlock.
            ranks = tuple(sorted(least, key=self._devices.index))
            sampler = ranks[0]
        placement = Placement(
            key=key, trainer_device=ranks[0], sampler_device=sampler, is_exclusive=exclusive, trainer_devices=ranks
        )
        self._placements[key] = placement
        self._labels[key] = label
        logger.info(
            "placed group=%s trainer_devices=%s sampler_device=%s exclusive=%s", key, ",".join(ranks), sampler, exclusive
        )
        return placement

    def hold(self, key: str, count: int, *, label: str) -> Placement:
        """`count` free devices held, exclusive, for ranks of a trainer that spans nodes (another node's
        job, `actors/span_members.py`): no sampler, nothing else placed on them.

        Raises:
            NoCapacity: fewer than `count` free devices (key `openrl.trainer_gpus`).
        """
        free = self.free_devices()
        if len(free) < count:
            raise NoCapacity(
                f"openrl.trainer_gpus: {label} needs {count} free devices here, and this node has {len(free)} "
                f"({self._describe_use()})",
                key="openrl.trainer_gpus",
            )
        ranks = tuple(free[:count])
        placement = Placement(
            key=key, trainer_device=ranks[0], sampler_device=ranks[0], is_exclusive=True, trainer_devices=ranks
        )
        self._placements[key] = placement
        self._labels[key] = label
        logger.info("held group=%s devices=%s", key, ",".join(ranks))
        return placement

    def release(self, key: str) -> None:
        """The group stopped (or never started): its devices are free of it."""
        self._placements.pop(key, None)
        self._labels.pop(key, None)

    def placement_of(self, key: str) -> Placement | None:
        return self._placements.get(key)

    def _describe_use(self) -> str:
        named = {d: [self._labels[key] for key in self._groups_on(d)] for d in self._devices}
        return ", ".join(f"{d}: {', '.join(named[d]) or 'free'}" for d in self._devices)

    def statistics(self) -> list[DeviceUse]:
        return [
            DeviceUse(device=d, groups=self._groups_on(d), is_exclusive=self._is_exclusive(d)) for d in self._devices
        ]


class NodeDevices:
    """The node's devices at run time: placement, and a time-slicer and a thread limiter per device."""

    def __init__(self, devices: Sequence[str], *, quantum_s: float) -> None:
        self.pool = DevicePool(devices)
        self.slicers = {name: TimeSlicer(name, quantum_s=quantum_s) for name in devices}
        # One worker thread per device: engine calls on one device never overlap.
        self.limiters = {name: trio.CapacityLimiter(1) for name in devices}

    async def run(self, *, task_status: trio.TaskStatus[NodeDevices] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every device's time-slicer until cancelled."""
        async with trio.open_nursery() as nursery:
            for slicer in self.slicers.values():
                await nursery.start(slicer.run)
            task_status.started(self)

    def statistics(self) -> list[DeviceStatistics]:
        return [slicer.statistics() for slicer in self.slicers.values()]
