"""A watchdog on the event loop: every task step that holds the loop longer than a threshold is reported.

Why: one trio thread serves every client of a node. A step that blocks (a
filesystem call, an fsync, a directory listing of a shared checkpoint root,
an import on first use, a long pure-Python loop) stalls every request for as
long as it runs, and nothing else shows it: latencies just get worse. The
design says nothing blocking runs on the event loop; this makes that checkable.

`LoopWatch` is a trio Instrument. It times each task step
(`before_task_step` / `after_task_step`) and, for each one that held the
loop over the threshold, logs a WARNING starting with `SLOW_STEP_PREFIX`,
naming the task, how long the step took (wall, on-CPU, and waiting for a
CPU) and where the loop thread was when it crossed the threshold (a stack
sampled by a helper thread, so the culprit is named, not just its task).
`statistics()` counts them for /metrics.

What counts is the time the step held the loop: its wall time less the time
the thread sat runnable waiting for a CPU (Linux's per-thread schedstat).
On a loaded machine the kernel can park any thread for tens of milliseconds
between two instructions; that stalls the loop too, but no code of ours can
fix it, and counting it would bury the steps that do block. The time spent
waiting for the GIL (engine threads in the daemon's process) still counts.

It is off by default (an Instrument costs a little on every step) and on in a
debug mode: `loop_watch_ms` in the node config, or `OPENRLD_LOOP_WATCH_MS`.
The test suite turns it on (50 ms) for every daemon it starts: each report is a
warning of the test during which it happened, and one over 250 ms fails that
test (tests/conftest.py says why there are two bars).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import types

import msgspec
import trio

logger = logging.getLogger(__name__)

SLOW_STEP_PREFIX = "loop_watch: slow step"  # stable: the test suite greps daemon logs for it
_TRIO_RUN_LOOP = "/trio/_core/_run.py"
STACK_FRAMES = 12  # innermost frames shown for a slow step; enough to name the blocking call and its caller


class LoopWatchStatistics(msgspec.Struct, frozen=True):
    threshold_s: float
    slow_steps: int  # steps that held the loop over the threshold since the node started
    longest_step_s: float  # the longest any step held the loop, slow or not


class LoopWatch(trio.abc.Instrument):
    """Times every task step; logs and counts those over `threshold_s`.

    Installed with `trio.lowlevel.add_instrument` (daemon.py) or passed to `trio.run`.
    `start_sampler` starts a daemon thread that, while a step runs past the
    threshold, records the loop thread's stack once, for the log line; without
    it, a slow step is reported with its task's name only.
    """

    def __init__(self, threshold_s: float) -> None:
        if threshold_s <= 0:
            raise ValueError(f"threshold_s must be positive, got {threshold_s}")
        self.threshold_s = threshold_s
        self.slow_steps = 0
        self.longest_step_s = 0.0
        # Shared with the sampler thread: plain attribute stores, read without a lock (a stale read
        # at worst samples the next step, which the serial number then discards).
        self._step_started: float | None = None
        self._step_cpu_started = 0.0
        self._step_waited_started = 0.0
        self._schedstat: int | None = None  # the loop thread's /proc schedstat, opened on its first step
        self._schedstat_opened = False
        self._step_serial = 0
        self._sampled: tuple[int, str] | None = None  # (step serial, stack text)
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    # ------------------------------------------------------------ the instrument

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_serial += 1
        self._step_cpu_started = time.thread_time()
        self._step_waited_started = self._cpu_wait_s()
        self._step_started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        started = self._step_started
        if started is None:
            return
        elapsed = time.perf_counter() - started
        self._step_started = None
        if elapsed <= self.threshold_s:  # the common case: no more clock reads
            self.longest_step_s = max(self.longest_step_s, elapsed)
            return
        waited = self._cpu_wait_s() - self._step_waited_started
        held = elapsed - waited
        self.longest_step_s = max(self.longest_step_s, held)
        if held <= self.threshold_s:
            return
        self.slow_steps += 1
        cpu = time.thread_time() - self._step_cpu_started
        sampled = self._sampled
        where = sampled[1] if sampled is not None and sampled[0] == self._step_serial else "(not sampled)\n"
        # cpu_ms near ms: the step computed; far under it: it blocked (I/O, a lock, the GIL).
        logger.warning(
            "%s task=%s held_ms=%.1f ms=%.1f cpu_ms=%.1f cpu_wait_ms=%.1f where:\n%s",
            SLOW_STEP_PREFIX, task.name, held * 1000, elapsed * 1000, cpu * 1000, waited * 1000, where,
        )

    def _cpu_wait_s(self) -> float:
        """Seconds the loop thread has spent runnable but waiting for a CPU; 0 where Linux does not say."""
        if not self._schedstat_opened:
            self._schedstat_opened = True
            try:
                self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                self._schedstat = None
        if self._schedstat is None:
            return 0.0
        # "<on-CPU ns> <waiting-on-a-run-queue ns> <timeslices>"
        return int(os.pread(self._schedstat, 64, 0).split()[1]) / 1e9

    # ------------------------------------------------------------ the stack sampler

    @property
    def is_sampling(self) -> bool:
        return self._sampler is not None and not self._stop.is_set()

    def start_sampler(self) -> None:
        """Start the sampler thread; call from the loop's thread. `stop_sampler` ends it."""
        self._loop_thread = threading.get_ident()
        self._sampler = threading.Thread(target=self._sample, name="loop-watch", daemon=True)
        self._sampler.start()

    def stop_sampler(self) -> None:
        self._stop.set()
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def _sample(self) -> None:
        # Checks twice per threshold, so a step is caught within 1.5x the threshold of its start.
        while not self._stop.wait(self.threshold_s / 2):
            started, serial = self._step_started, self._step_serial
            if started is None or time.perf_counter() - started <= self.threshold_s:
                continue
            if self._sampled is not None and self._sampled[0] == serial:
                continue  # this step is sampled already
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            stack = "".join(traceback.format_list(_task_frames(frame)[-STACK_FRAMES:]))
            self._sampled = (serial, stack)

    def statistics(self) -> LoopWatchStatistics:
        return LoopWatchStatistics(self.threshold_s, self.slow_steps, self.longest_step_s)


def _task_frames(frame: types.FrameType) -> traceback.StackSummary:
    """The stack from `frame` outwards, less trio's run loop and what called it (the same for every step)."""
    stack = traceback.extract_stack(frame)
    below_loop = [i for i, entry in enumerate(stack) if entry.filename.endswith(_TRIO_RUN_LOOP)]
    return traceback.StackSummary.from_list(stack[below_loop[-1] + 1 :] if below_loop else stack)
