"""A member node's part of a trainer that spans nodes: its devices held for another node's job, and its ranks.

A job whose trainer is wider than any node (`cluster/placement/spanning.py`) is
owned by its home node, which hosts rank 0 and the rendezvous; every other node
of its plan is a member. The home asks each member over the peer API
(`api/peer.py`, `SpanOrder`); the member's `SpanMembers`:
- holds the devices in its own pool, exclusive, for the job (refusing when they
  are no longer free: the pool is the authority, as for any placement);
- starts its torchrun (`launch`, given by the daemon: `worker/launchers/torchrun.py`
  `member_command`), whose ranks join the home's rendezvous and follow rank 0;
- watches it: when it exits (a rank died, the home's ranks are gone) or the home
  node is declared dead (its ranks are then killed at once: cut off from the home,
  a graceful stop waits on the network), its devices are freed, and the home is
  told (`SpanEnded`), so that the job ends on every node;
- stops it when the home says the job has ended (`stop`).

It never imports torch and never speaks the worker protocol: a member's ranks
have no connection to this daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import trio

from openrld.actors.device_pool import DevicePool
from openrld.errors import Conflict

logger = logging.getLogger(__name__)

WATCH_S = 0.5  # how often a member's ranks and its home's liveness are looked at
STOP_GRACE_S = 10.0  # a stopped member's torchrun: SIGTERM after this, then SIGKILL (launchers/torchrun.py)


class SpanOrder(msgspec.Struct, frozen=True):
    """The home asks a member to run its ranks of a job's trainer (peer API body)."""

    job: str  # the job's model id; also the rendezvous id
    home: str  # the home node's name
    base_model: str  # resolved by the member's own catalog
    devices: int  # this member's ranks, one per device
    nodes: int  # torchrun agents in the group, one per node
    endpoint: str  # the home's rendezvous, "host:port"


class SpanStarted(msgspec.Struct, frozen=True):
    node: str
    devices: list[str]  # the member's devices that hold the ranks, in rank order


class SpanStop(msgspec.Struct, frozen=True):
    job: str


class SpanEnded(msgspec.Struct, frozen=True):
    """A member tells the home that its ranks of `job` have ended."""

    job: str
    node: str
    detail: str


class Ranks(Protocol):
    """A member's running torchrun (`launchers.LaunchedWorker`'s part that this module uses)."""

    def poll(self) -> int | None: ...
    def stop(self, timeout: float) -> None: ...
    def kill(self) -> None: ...
    def describe(self) -> str: ...


class _Running(msgspec.Struct):
    order: SpanOrder
    ranks: Ranks
    is_stopping: bool = False


class SpanMembers:
    """This node's ranks of other nodes' jobs; see the module docstring."""

    def __init__(
        self, *, name: str, pool: DevicePool, nursery: trio.Nursery,
        launch: Callable[[SpanOrder, tuple[str, ...]], Ranks],
        is_alive: Callable[[str], bool],
        tell_home: Callable[[str, SpanEnded], Awaitable[None]],
    ) -> None:
        self._name = name  # this node's
        self._pool = pool
        self._nursery = nursery  # the watchers'
        self._launch = launch  # starts this node's torchrun for an order, on the devices held for it
        self._is_alive = is_alive  # a member's liveness, by name, from the cluster view
        self._tell_home = tell_home
        self._running: dict[str, _Running] = {}

    def start(self, order: SpanOrder) -> SpanStarted:
        """Hold this node's devices for `order.job` and start its ranks.

        Raises:
            NoCapacity: too few free devices now (key openrl.trainer_gpus).
            Conflict: this node already runs ranks of that job.
        """
        if order.job in self._running:
            raise Conflict(f"node {self._name} already runs ranks of job {order.job}")
        key = _key(order.job)
        placement = self._pool.hold(key, order.devices, label=f"job {order.job} (ranks for node {order.home})")
        try:
            ranks = self._launch(order, placement.trainer_ranks)
        except BaseException:
            self._pool.release(key)
            raise
        self._running[order.job] = _Running(order, ranks)
        self._nursery.start_soon(self._watch, order.job)
        logger.info("span ranks started job=%s home=%s devices=%s at=%s", order.job, order.home,
                    ",".join(placement.trainer_ranks), ranks.describe())
        return SpanStarted(self._name, list(placement.trainer_ranks))

    async def stop(self, job: str) -> None:
        """The home ended the job: stop its ranks here and free their devices (nothing if none run)."""
        running = self._running.get(job)
        if running is None:
            return
        running.is_stopping = True
        await trio.to_thread.run_sync(running.ranks.stop, STOP_GRACE_S)

    def jobs(self) -> list[str]:
        return sorted(self._running)

    async def _watch(self, job: str) -> None:
        running = self._running[job]
        home = running.order.home
        try:
            while (status := running.ranks.poll()) is None:
                if not running.is_stopping and not self._is_alive(home):
                    running.is_stopping = True
                    logger.warning("span ranks job=%s: home node %s is dead; killing them", job, home)
                    await trio.to_thread.run_sync(running.ranks.kill)
                    continue
                await trio.sleep(WATCH_S)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(running.ranks.stop, 0.0)  # reaped, every rank gone
            del self._running[job]
            self._pool.release(_key(job))
            logger.info("span ranks ended job=%s status=%s; devices freed", job, running.ranks.poll())
        if not running.is_stopping:
            detail = f"its ranks on node {self._name} exited (status {status})"
            await self._tell_home(home, SpanEnded(job, self._name, detail))


def _key(job: str) -> str:
    return f"span:{job}"
