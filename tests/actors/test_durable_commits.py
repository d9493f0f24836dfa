"""DurableCommits: a caller returns only after a sync that started after its call, and one sync
covers every caller that queued while another ran."""

from __future__ import annotations

import threading

import trio

from openrld.actors.durable_commits import DurableCommits


class GatedSync:
    """A `Database.sync` stand-in that counts its calls and holds each until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def __call__(self) -> None:
        self.calls += 1
        self.started.release()
        self.release.acquire()


async def test_one_caller_waits_for_one_sync():
    sync = GatedSync()
    commits = DurableCommits(sync)
    sync.release.release()
    await commits.durable()
    assert sync.calls == 1


async def test_callers_queued_behind_a_running_sync_share_the_next_one():
    sync = GatedSync()
    commits = DurableCommits(sync)
    returned: list[int] = []

    async def caller(n: int) -> None:
        await commits.durable()
        returned.append(n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller, 0)
        await trio.to_thread.run_sync(sync.started.acquire)  # sync 1 runs for caller 0
        for n in (1, 2, 3):
            nursery.start_soon(caller, n)
        await trio.testing.wait_all_tasks_blocked()
        sync.release.release()  # sync 1 ends; caller 0 returns, and one sync starts for 1-3
        await trio.to_thread.run_sync(sync.started.acquire)
        sync.release.release()
    assert (sync.calls, returned[0], sorted(returned[1:])) == (2, 0, [1, 2, 3])


async def test_a_caller_arriving_during_a_sync_is_not_covered_by_it():
    sync = GatedSync()
    commits = DurableCommits(sync)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(commits.durable)
        await trio.to_thread.run_sync(sync.started.acquire)
        late = trio.Event()

        async def late_caller() -> None:
            await commits.durable()
            late.set()

        nursery.start_soon(late_caller)
        sync.release.release()
        await trio.to_thread.run_sync(sync.started.acquire)  # a second sync, for the late caller
        assert not late.is_set()
        sync.release.release()
    assert sync.calls == 2
