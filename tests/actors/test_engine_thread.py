"""An engine thread on a CPU device ends once idle, and the next call starts another: calls still
run one at a time, in the order queued, and the ended thread's torch thread pool ends with it."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from openrld.actors import engine_thread
from openrld.actors.engine_thread import EngineThread, on_cpu


def _current() -> threading.Thread:
    return threading.current_thread()


@pytest.mark.parametrize(("device", "expected"), [("cpu", True), ("cpu:1", True), ("cuda:0", False), ("", False)])
def test_only_a_cpu_device_label_is_on_cpu(device, expected):
    assert on_cpu(device) is expected


async def test_an_idle_engine_thread_ends_and_the_next_call_runs_on_a_new_one():
    thread = EngineThread("test", release_when_idle=True)
    first = await thread.call(_current)
    await trio.sleep(engine_thread.IDLE_RELEASE_S * 4)
    second = await thread.call(_current)
    assert first.is_alive() is False
    assert second is not first
    thread.stop()


async def test_an_engine_thread_that_is_not_released_keeps_its_thread_when_idle():
    thread = EngineThread("test")
    first = await thread.call(_current)
    await trio.sleep(engine_thread.IDLE_RELEASE_S * 4)
    assert await thread.call(_current) is first
    thread.stop()


async def test_calls_queued_as_idle_threads_end_all_run_once_in_order_and_never_two_at_once(monkeypatch):
    monkeypatch.setattr(engine_thread, "IDLE_RELEASE_S", 0.001)  # many ends, each racing a submit
    thread = EngineThread("test", release_when_idle=True)
    ran: list[int] = []
    running = []
    overlaps = []
    threads: set[threading.Thread] = set()

    def call(n: int) -> None:
        running.append(n)
        overlaps.append(len(running))
        threads.add(threading.current_thread())
        ran.append(n)
        running.remove(n)

    pending = []
    for n in range(300):
        pending.append(thread.submit(call, n))
        if n % 3 == 0:
            await trio.sleep(0.001 * (n % 4))
    for p in pending:
        await p.wait()
    assert ran == list(range(300))
    assert max(overlaps) == 1
    assert len(threads) > 1
    thread.stop()


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch opens no thread pool on one core")
async def test_an_idle_engine_threads_torch_pool_ends_with_it():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()  # the process's count, which the call changes

    def matmul_on_two_threads() -> set[str]:
        """The threads this call started: its pool's (the process's tasks but this one)."""
        torch.set_num_threads(2)
        a = torch.ones(256, 256)
        for _ in range(5):
            a @ a
        return _tasks() - {str(threading.get_native_id())}

    once = threading.Thread(target=matmul_on_two_threads)  # what torch starts once per process, first
    once.start()
    once.join()
    before = _tasks()
    thread = EngineThread("test", release_when_idle=True)
    try:
        pool = await thread.call(matmul_on_two_threads) - before
        with trio.move_on_after(5):
            while pool & _tasks():  # the pool's threads leave a moment after the engine thread
                await trio.sleep(engine_thread.IDLE_RELEASE_S)
    finally:
        torch.set_num_threads(threads)
        thread.stop()
    assert len(pool) >= 1
    assert pool & _tasks() == set()
