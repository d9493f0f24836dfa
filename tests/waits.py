"""Waiting on a condition, never on the clock alone.

A test that sleeps a fixed time and then asserts passes or fails on the machine's speed.
These poll a condition instead and fail, naming how long they waited, once a deadline
passes. `wait_until` is for trio tests (its clock is the run's, so under an autojump
clock a simulated minute costs nothing); `wait_for` is for tests that drive real
daemons from plain threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio


async def wait_until(predicate: Callable[[], bool], *, within_s: float, poll_s: float = 0.1) -> float:
    """Seconds (on the trio clock) until `predicate()` holds, checked every `poll_s`; TooSlowError past `within_s`."""
    start = trio.current_time()
    with trio.fail_after(within_s):
        while not predicate():
            await trio.sleep(poll_s)
    return trio.current_time() - start


def wait_for(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds until `predicate()` holds, checked every `poll_s`; AssertionError past `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:.2f} s")
        time.sleep(poll_s)
    return time.monotonic() - start
