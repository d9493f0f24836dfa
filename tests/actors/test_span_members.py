"""A member node's ranks of another node's trainer: devices held while they run, freed when they end,
and the home told only when they ended by themselves."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from openrld.actors.device_pool import DevicePool
from openrld.actors.span_members import SpanEnded, SpanMembers, SpanOrder, SpanStarted
from openrld.errors import BadRequest


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """pytest-trio's, but jumping only once every task has been blocked 50 ms of real time: the
    watcher stops and frees the ranks in a thread, which the clock does not count as work, so with
    no threshold the test's sleep could end before that thread has run (flaky on a loaded machine)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


ORDER = SpanOrder(job="s-1:train:0", home="node-a", base_model="tiny-llama", devices=2, nodes=2, endpoint="10.0.0.5:29400")


class FakeRanks:
    """A torchrun that runs until `exit` (a rank died), `stop` or `kill`."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.stops: list[float | str] = []  # each stop's grace, or "kill"

    def poll(self) -> int | None:
        return self.status

    def stop(self, timeout: float) -> None:
        self.stops.append(timeout)
        if self.status is None:
            self.status = -15

    def kill(self) -> None:
        self.stops.append("kill")
        if self.status is None:
            self.status = -9

    def describe(self) -> str:
        return "torchrun pid 1, 2 ranks"


class Node:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.pool = DevicePool(["cpu:0", "cpu:1", "cpu:2"])
        self.ranks = FakeRanks()
        self.alive = {"node-a": True}
        self.told: list[tuple[str, SpanEnded]] = []
        self.members = SpanMembers(
            name="node-b", pool=self.pool, nursery=nursery, launch=lambda order, devices: self.ranks,
            is_alive=lambda name: self.alive.get(name, False), tell_home=self.tell,
        )

    async def tell(self, home: str, ended: SpanEnded) -> None:
        self.told.append((home, ended))

    def held(self) -> list[str]:
        return [use.device for use in self.pool.statistics() if use.groups]


async def test_a_member_holds_free_devices_for_the_span_and_answers_which(autojump_clock):
    async with trio.open_nursery() as nursery:
        node = Node(nursery)
        assert node.members.start(ORDER) == SpanStarted("node-b", ["cpu:0", "cpu:1"])
        assert node.held() == ["cpu:0", "cpu:1"]
        nursery.cancel_scope.cancel()


async def test_ranks_that_exit_free_the_devices_and_tell_the_home(autojump_clock):
    async with trio.open_nursery() as nursery:
        node = Node(nursery)
        node.members.start(ORDER)
        node.ranks.status = 1  # a rank died; torchrun stopped the other and exited
        await trio.sleep(1.0)
        assert node.held() == [] and node.members.jobs() == []
        assert node.told == [("node-a", SpanEnded(ORDER.job, "node-b", "its ranks on node node-b exited (status 1)"))]


async def test_a_dead_home_kills_the_ranks_at_once_without_telling_it(autojump_clock):
    # Cut off from the home (a partition), torchrun's own stop waits on its rendezvous: no grace.
    async with trio.open_nursery() as nursery:
        node = Node(nursery)
        node.members.start(ORDER)
        node.alive["node-a"] = False
        await trio.sleep(1.0)
        assert (node.held(), node.told, node.ranks.stops[0]) == ([], [], "kill")


async def test_the_homes_stop_frees_the_devices_without_telling_it(autojump_clock):
    async with trio.open_nursery() as nursery:
        node = Node(nursery)
        node.members.start(ORDER)
        await node.members.stop(ORDER.job)
        await trio.sleep(1.0)
        assert (node.held(), node.told, node.ranks.stops[0]) == ([], [], 10.0)


async def test_too_few_free_devices_are_refused_naming_the_setting_and_nothing_starts(autojump_clock):
    async with trio.open_nursery() as nursery:
        node = Node(nursery)
        with pytest.raises(BadRequest) as refused:
            node.members.start(SpanOrder(ORDER.job, ORDER.home, ORDER.base_model, 4, 2, ORDER.endpoint))
        assert (refused.value.key, node.held(), node.members.jobs()) == ("openrl.trainer_gpus", [], [])
