"""Each run's curves: its training metrics per step and its sampling throughput, bounded, kept with the run.

This module owns the per-run history the console plots
(`GET /openrl/v1/runs/{run_id}/curves`). It is fed where requests settle:
the future table calls `HistoryRecorder.observe` with every outcome, and
the recorder keeps what it needs of three kinds:
- `forward_backward`: its metrics are combined into the step in progress by
  their reduction suffix (`:sum` adds, `:mean` averages, `:max`/`:min`);
- `optim_step`: closes the step, as one `TrainPoint` with the combined
  forward_backward metrics and the optim_step's own (these win a clash);
- `sample`: its sequences and tokens go into the wall-clock bucket of the
  run whose weights the sampling session samples (the store's sampler row,
  if the same user owns both), for a throughput curve.

What it guarantees:
- bounded memory: at most MAX_RUNS_HELD runs, each with at most
  MAX_POINTS_PER_RUN points and MAX_SAMPLING_BUCKETS buckets, and at most
  MAX_UNSAVED points waiting for the store (the oldest dropped past it,
  and counted);
- bounded rows: the store keeps the same bounds per run (history_table.py);
- the event loop never waits on a write: `run` writes every FLUSH_INTERVAL_S
  in a worker thread; a run evicted from memory was written first, and
  resumes its numbering from the store if it trains again.

`RunHistory` is the pure state (no trio, no I/O); `HistoryRecorder` is the
shell that feeds it, writes it and answers reads. Neither imports torch,
and neither decides who may read a run (the caller checks the owner).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec
import trio

from openrld.actors.futures import Completed, Outcome
from openrld.batches import ForwardBackwardResult, OptimResult, SampleResult
from openrld.store.history_table import HistoryRows, HistoryTable, SamplingBucket, TrainPoint

logger = logging.getLogger(__name__)

# A curve of 2,000 steps draws as finely as a page is wide; longer runs show their last 2,000
# steps. About 120 bytes a point with a handful of metrics: 240 kB per run at most.
MAX_POINTS_PER_RUN = 2000
SAMPLING_BUCKET_S = 10.0  # sampling throughput is plotted per 10 s: steady enough to read, fine enough to follow
MAX_SAMPLING_BUCKETS = 360  # an hour of buckets
# Runs held in memory: a node holds far fewer live jobs than this; finished runs leave as the
# least recently fed, and are read back from the store when someone looks at them.
MAX_RUNS_HELD = 256
MAX_UNSAVED = 50_000  # points waiting for the store; only a store that keeps failing fills it
FLUSH_INTERVAL_S = 2.0  # how stale the stored curve may be; the live curve is read from memory
FINAL_FLUSH_S = 5.0  # at shutdown, the last write gets this long
MAX_SAMPLERS_REMEMBERED = 4096  # sampling session -> run, looked up once per session

_REDUCTIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": lambda values: sum(values),
    "mean": lambda values: sum(values) / len(values),
    "max": max,
    "min": min,
}


def combine_metrics(calls: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several forward_backward calls of one step, as one step's.

    A name's suffix says how: `loss:sum` adds up over the calls, `:mean` averages,
    `:max` and `:min` take the extreme; any other suffix keeps the last value.
    """
    values: dict[str, list[float]] = {}
    for metrics in calls:
        for name, value in metrics.items():
            values.setdefault(name, []).append(value)
    combined: dict[str, float] = {}
    for name, seen in values.items():
        reduce = _REDUCTIONS.get(name.rsplit(":", 1)[-1])
        combined[name] = float(reduce(seen)) if reduce is not None else float(seen[-1])
    return combined


class RunCurves(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/runs/{run_id}/curves."""

    run_id: str
    points: list[TrainPoint]  # those with seq over the request's `after`, oldest first
    sampling: list[SamplingBucket]  # every bucket held, oldest first
    bucket_s: float  # the width of a sampling bucket
    max_points: int  # how many points a run keeps; older ones are gone


class HistoryStatistics(msgspec.Struct, frozen=True):
    runs_held: int
    points_held: int
    unsaved_points: int
    dropped_unsaved: int  # points lost because the store did not take them in time
    writes_failed: int


class _Run:
    __slots__ = ("points", "calls", "step", "next_seq", "buckets")

    def __init__(self, next_seq: int, step: int) -> None:
        self.points: deque[TrainPoint] = deque(maxlen=MAX_POINTS_PER_RUN)
        self.calls: list[dict[str, float]] = []  # forward_backward metrics of the step in progress
        self.step = step
        self.next_seq = next_seq
        self.buckets: deque[SamplingBucket] = deque(maxlen=MAX_SAMPLING_BUCKETS)


class RunHistory:
    """The curves of the runs fed lately, and what the store has not got yet. Pure: no I/O, no trio.

    Args:
        counters: (next seq, last step) of a run not held, from the store; a new run answers (0, 0).
    """

    def __init__(self, counters: Callable[[str], tuple[int, int]]) -> None:
        self._counters = counters
        self._runs: OrderedDict[str, _Run] = OrderedDict()  # least recently fed first
        self._unsaved_points: deque[tuple[str, TrainPoint]] = deque()
        self._unsaved_buckets: dict[tuple[str, float], SamplingBucket] = {}
        self._dropped = 0

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(*self._counters(run_id))
        self._runs.move_to_end(run_id)
        return run

    def forward_backward(self, run_id: str, metrics: dict[str, float]) -> None:
        self._run(run_id).calls.append(dict(metrics))

    def optim_step(self, run_id: str, metrics: dict[str, float], now_s: float) -> TrainPoint:
        run = self._run(run_id)
        run.step += 1
        point = TrainPoint(
            seq=run.next_seq, step=run.step, at_s=now_s, metrics={**combine_metrics(run.calls), **metrics}
        )
        run.next_seq += 1
        run.calls = []
        run.points.append(point)
        self._unsaved_points.append((run_id, point))
        if len(self._unsaved_points) > MAX_UNSAVED:
            self._unsaved_points.popleft()
            self._dropped += 1
        return point

    def resume(self, run_id: str, step: int) -> None:
        """Run `run_id` goes on here after `step` optim_steps made elsewhere (an adopted job,
        cluster/adoption.py): its next point is step + 1, whatever this node held of it."""
        self._run(run_id).step = step

    def sampled(self, run_id: str, tokens: int, sequences: int, now_s: float) -> SamplingBucket:
        run = self._run(run_id)
        start = now_s // SAMPLING_BUCKET_S * SAMPLING_BUCKET_S
        last = run.buckets[-1] if run.buckets else None
        if last is not None and last.start_s == start:
            bucket = SamplingBucket(start, last.tokens + tokens, last.sequences + sequences)
            run.buckets[-1] = bucket
        else:
            bucket = SamplingBucket(start, tokens, sequences)
            run.buckets.append(bucket)
        self._unsaved_buckets[(run_id, start)] = bucket
        return bucket

    def held(self, run_id: str) -> bool:
        return run_id in self._runs

    def curves(self, run_id: str, after_seq: int) -> RunCurves:
        """A held run's curves (the caller checks `held` first)."""
        run = self._runs[run_id]
        return RunCurves(
            run_id=run_id, points=[p for p in run.points if p.seq > after_seq], sampling=list(run.buckets),
            bucket_s=SAMPLING_BUCKET_S, max_points=MAX_POINTS_PER_RUN,
        )

    def take_unsaved(self) -> HistoryRows:
        """What the store has not got yet; afterwards nothing is unsaved."""
        points, self._unsaved_points = list(self._unsaved_points), deque()
        buckets, self._unsaved_buckets = self._unsaved_buckets, {}
        return HistoryRows(points=points, buckets=[(run_id, b) for (run_id, _), b in buckets.items()])

    def evict(self) -> list[str]:
        """Forget the least recently fed runs past MAX_RUNS_HELD; call it only once they are written."""
        gone = []
        while len(self._runs) > MAX_RUNS_HELD:
            run_id, _ = self._runs.popitem(last=False)
            gone.append(run_id)
        return gone

    def statistics(self, writes_failed: int = 0) -> HistoryStatistics:
        return HistoryStatistics(
            runs_held=len(self._runs), points_held=sum(len(r.points) for r in self._runs.values()),
            unsaved_points=len(self._unsaved_points), dropped_unsaved=self._dropped, writes_failed=writes_failed,
        )


class HistoryRecorder:
    """The shell: takes outcomes from the future table, writes to the store in a thread, answers reads.

    Args:
        table: the store's history table.
        sampler_run: the run a sampling session samples, if its owner owns that run too;
            None for a session on a bare base model (looked up once per session).
        now: the wall clock, seconds since the epoch.
    """

    def __init__(
        self, table: HistoryTable, *, sampler_run: Callable[[str], str | None], now: Callable[[], float] = time.time
    ) -> None:
        self._table = table
        self._sampler_run = sampler_run
        self._now = now
        self.history = RunHistory(table.counters)
        self._sampler_runs: OrderedDict[str, str | None] = OrderedDict()
        self._io = trio.CapacityLimiter(1)  # one table call at a time, off the event loop
        self._writes_failed = 0

    def observe(self, model_id: str, kind: str, outcome: Outcome) -> None:
        """The future table's hook: every settled request passes here, on the event loop."""
        if not isinstance(outcome, Completed):
            return
        value = outcome.value
        if kind == "forward_backward" and isinstance(value, ForwardBackwardResult):
            self.history.forward_backward(model_id, value.metrics)
        elif kind == "optim_step" and isinstance(value, OptimResult):
            self.history.optim_step(model_id, value.metrics, self._now())
        elif kind == "sample" and isinstance(value, SampleResult):
            run_id = self._run_of_sampler(model_id)
            if run_id is not None:
                tokens = sum(len(s.tokens) for s in value.sequences)
                self.history.sampled(run_id, tokens, len(value.sequences), self._now())

    def resume(self, run_id: str, step: int) -> None:
        """A job adopted here at `step` (actors/job_adoption.py): its points go on numbered by the job's own steps.
        Those it made on the dead node lived in that node's store and are not here."""
        self.history.resume(run_id, step)

    def _run_of_sampler(self, sampler_id: str) -> str | None:
        if sampler_id not in self._sampler_runs:
            self._sampler_runs[sampler_id] = self._sampler_run(sampler_id)
            if len(self._sampler_runs) > MAX_SAMPLERS_REMEMBERED:
                self._sampler_runs.popitem(last=False)
        return self._sampler_runs[sampler_id]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write what is new every FLUSH_INTERVAL_S until cancelled, then once more (shielded, bounded)."""
        task_status.started()
        try:
            while True:
                await trio.sleep(FLUSH_INTERVAL_S)
                await self.flush()
        finally:
            with trio.move_on_after(FINAL_FLUSH_S, shield=True):
                await self.flush()

    async def flush(self) -> None:
        """Write what the store has not got, then forget the runs past the memory bound."""
        rows = self.history.take_unsaved()
        if rows.points or rows.buckets:
            try:
                await trio.to_thread.run_sync(self._table.write, rows, limiter=self._io)
            except Exception:  # the curves are bookkeeping: a failed write must not stop training
                self._writes_failed += 1
                logger.exception("run history write failed; %d points not stored", len(rows.points))
                return  # nothing is evicted that the store may lack
        self.history.evict()

    async def curves(self, run_id: str, after_seq: int = -1) -> RunCurves:
        """A run's curves: from memory while it is held, else from the store (in a thread)."""
        if self.history.held(run_id):
            return self.history.curves(run_id, after_seq)
        points = await trio.to_thread.run_sync(self._table.points, run_id, after_seq, limiter=self._io)
        buckets = await trio.to_thread.run_sync(self._table.buckets, run_id, limiter=self._io)
        return RunCurves(
            run_id=run_id, points=points, sampling=buckets, bucket_s=SAMPLING_BUCKET_S, max_points=MAX_POINTS_PER_RUN
        )

    def statistics(self) -> HistoryStatistics:
        return self.history.statistics(self._writes_failed)
