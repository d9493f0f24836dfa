"""The event-loop watchdog: a step that blocks is reported with its task and where it blocked; others are not."""

from __future__ import annotations

import logging
import time

import pytest
import trio
import trio.lowlevel

from openrld.loop_watch import SLOW_STEP_PREFIX, LoopWatch


def _blocks_the_loop() -> None:
    time.sleep(0.2)  # the blocking call the report must name


async def _busy_but_polite() -> None:
    for _ in range(20):
        await trio.sleep(0.005)


def test_a_blocking_step_is_logged_with_its_task_and_stack_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    watch = LoopWatch(0.05)

    async def blocker() -> None:
        await trio.lowlevel.checkpoint()
        _blocks_the_loop()

    async def main() -> None:
        watch.start_sampler()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocker, name="the-blocker")
                nursery.start_soon(_busy_but_polite, name="polite")
        finally:
            watch.stop_sampler()

    with caplog.at_level(logging.WARNING, logger="openrld.loop_watch"):
        trio.run(main, instruments=[watch])
    slow = [r.getMessage() for r in caplog.records if r.getMessage().startswith(SLOW_STEP_PREFIX)]
    assert len(slow) == 1, slow
    assert "task=the-blocker " in slow[0]
    assert "_blocks_the_loop" in slow[0]  # the sampler caught it inside the blocking call
    stats = watch.statistics()
    assert stats.slow_steps == 1
    assert 0.2 <= stats.longest_step_s < 1.0


def test_steps_under_the_threshold_are_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    watch = LoopWatch(0.5)

    async def main() -> None:
        await _busy_but_polite()
        time.sleep(0.05)  # noqa: ASYNC251  # a step that blocks the loop, under the threshold: the point of the test

    with caplog.at_level(logging.WARNING, logger="openrld.loop_watch"):
        trio.run(main, instruments=[watch])
    assert [r for r in caplog.records if r.getMessage().startswith(SLOW_STEP_PREFIX)] == []
    assert watch.statistics().slow_steps == 0
    assert watch.statistics().longest_step_s >= 0.05


def test_a_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoopWatch(0)
