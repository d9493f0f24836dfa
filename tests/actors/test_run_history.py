"""Each run's curves (actors/run_history.py, history_table.py): combining, bounds, persistence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from openrld.actors import run_history
from openrld.actors.futures import Completed, Failed
from openrld.actors.run_history import (
    MAX_POINTS_PER_RUN,
    MAX_RUNS_HELD,
    MAX_SAMPLING_BUCKETS,
    SAMPLING_BUCKET_S,
    HistoryRecorder,
    RunHistory,
    combine_metrics,
)
from openrld.batches import ForwardBackwardResult, OptimResult, SampledSequence, SampleResult
from openrld.store import Store
from openrld.store.history_table import SamplingBucket, TrainPoint

RUN = "s-0123456789abcdef:train:0"
SAMPLER = "s-0123456789abcdef:sample:0"


def fresh(run_id: str) -> tuple[int, int]:
    return 0, 0


def _table(tmp_path: Path):
    store = Store.open(tmp_path / "data")
    return store, store.history_table(
        max_points=MAX_POINTS_PER_RUN, max_buckets=MAX_SAMPLING_BUCKETS, bucket_s=SAMPLING_BUCKET_S
    )


@pytest.mark.parametrize(
    ("calls", "expected"),
    [
        ([{"loss:sum": 2.0}, {"loss:sum": 3.5}], {"loss:sum": 5.5}),
        ([{"acc:mean": 0.25}, {"acc:mean": 0.75}], {"acc:mean": 0.5}),
        ([{"x:max": 1.0}, {"x:max": 4.0}, {"x:min": 2.0}, {"x:min": -1.0}], {"x:max": 4.0, "x:min": -1.0}),
        ([{"tokens:unique": 7.0}, {"tokens:unique": 9.0}], {"tokens:unique": 9.0}),  # unknown suffix: the last
        ([], {}),
    ],
    ids=["sum-adds", "mean-averages", "max-and-min", "other-keeps-last", "no-calls"],
)
def test_forward_backward_metrics_combine_by_their_reduction_suffix(calls, expected):
    assert combine_metrics(calls) == expected


def test_optim_step_closes_a_point_with_the_steps_forward_backward_metrics():
    history = RunHistory(fresh)
    history.forward_backward(RUN, {"loss:sum": 2.0})
    history.forward_backward(RUN, {"loss:sum": 1.0})
    first = history.optim_step(RUN, {"grad_norm:mean": 0.5}, now_s=100.0)
    history.forward_backward(RUN, {"loss:sum": 0.5})
    second = history.optim_step(RUN, {}, now_s=101.0)
    assert first == TrainPoint(seq=0, step=1, at_s=100.0, metrics={"loss:sum": 3.0, "grad_norm:mean": 0.5})
    assert second == TrainPoint(seq=1, step=2, at_s=101.0, metrics={"loss:sum": 0.5})
    assert history.curves(RUN, after_seq=0).points == [second]


def test_a_run_keeps_only_its_newest_points():
    history = RunHistory(fresh)
    for i in range(MAX_POINTS_PER_RUN + 5):
        history.optim_step(RUN, {"loss:sum": float(i)}, now_s=float(i))
    points = history.curves(RUN, after_seq=-1).points
    assert len(points) == MAX_POINTS_PER_RUN
    assert (points[0].seq, points[-1].seq) == (5, MAX_POINTS_PER_RUN + 4)


def test_samples_fall_into_wall_clock_buckets():
    history = RunHistory(fresh)
    history.sampled(RUN, tokens=10, sequences=2, now_s=1000.0)
    history.sampled(RUN, tokens=5, sequences=1, now_s=1009.9)  # same 10-s bucket as 1000.0
    history.sampled(RUN, tokens=7, sequences=1, now_s=1010.0)  # the next one
    assert history.curves(RUN, after_seq=-1).sampling == [
        SamplingBucket(1000.0, 15, 3), SamplingBucket(1010.0, 7, 1),
    ]


def test_memory_holds_at_most_max_runs_after_a_write():
    history = RunHistory(fresh)
    for i in range(MAX_RUNS_HELD + 3):
        history.optim_step(f"s-0123456789abcdef:train:{i}", {"loss:sum": 1.0}, now_s=0.0)
    history.take_unsaved()
    gone = history.evict()
    assert gone == [f"s-0123456789abcdef:train:{i}" for i in range(3)]  # the least recently fed
    assert history.statistics().runs_held == MAX_RUNS_HELD


def test_unsaved_points_are_bounded_when_the_store_never_takes_them(monkeypatch):
    monkeypatch.setattr(run_history, "MAX_UNSAVED", 10)
    history = RunHistory(fresh)
    for i in range(13):
        history.optim_step(RUN, {"loss:sum": 1.0}, now_s=float(i))
    stats = history.statistics()
    assert (stats.unsaved_points, stats.dropped_unsaved) == (10, 3)
    assert [p.seq for _, p in history.take_unsaved().points] == list(range(3, 13))


def test_stored_rows_stay_within_the_bounds(tmp_path: Path):
    store, table = _table(tmp_path)
    history = RunHistory(table.counters)
    for i in range(MAX_POINTS_PER_RUN + 50):
        history.optim_step(RUN, {"loss:sum": float(i)}, now_s=float(i))
    for minute in range(MAX_SAMPLING_BUCKETS + 20):
        history.sampled(RUN, tokens=1, sequences=1, now_s=minute * SAMPLING_BUCKET_S)
    table.write(history.take_unsaved())
    assert table.row_counts([RUN]) == {RUN: (MAX_POINTS_PER_RUN, MAX_SAMPLING_BUCKETS)}
    assert table.points(RUN, after_seq=MAX_POINTS_PER_RUN + 47) == [
        TrainPoint(seq=MAX_POINTS_PER_RUN + 48, step=MAX_POINTS_PER_RUN + 49, at_s=float(MAX_POINTS_PER_RUN + 48),
                   metrics={"loss:sum": float(MAX_POINTS_PER_RUN + 48)}),
        TrainPoint(seq=MAX_POINTS_PER_RUN + 49, step=MAX_POINTS_PER_RUN + 50, at_s=float(MAX_POINTS_PER_RUN + 49),
                   metrics={"loss:sum": float(MAX_POINTS_PER_RUN + 49)}),
    ]
    store.close()


def test_a_run_evicted_and_fed_again_numbers_on_from_the_store(tmp_path: Path):
    store, table = _table(tmp_path)
    history = RunHistory(table.counters)
    history.optim_step(RUN, {"loss:sum": 1.0}, now_s=1.0)
    history.optim_step(RUN, {"loss:sum": 2.0}, now_s=2.0)
    table.write(history.take_unsaved())
    again = RunHistory(table.counters)  # as after an eviction: the run is not held
    assert again.optim_step(RUN, {"loss:sum": 3.0}, now_s=3.0) == TrainPoint(2, 3, 3.0, {"loss:sum": 3.0})
    store.close()


def _recorder(tmp_path: Path, sampler_run=lambda sampler_id: RUN):
    store, table = _table(tmp_path)
    clock = iter(float(t) for t in range(1000, 2000))
    return store, table, HistoryRecorder(table, sampler_run=sampler_run, now=lambda: next(clock))


def _fb(loss: float) -> Completed:
    return Completed(ForwardBackwardResult(logprobs=[], metrics={"loss:sum": loss}))


def _sample(*lengths: int) -> Completed:
    return Completed(SampleResult(sequences=[
        SampledSequence(tokens=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32), stop_reason="length")
        for n in lengths
    ]))


async def test_recorder_takes_what_settles_and_answers_from_the_store_once_evicted(tmp_path: Path, monkeypatch):
    store, _table, recorder = _recorder(tmp_path)
    recorder.observe(RUN, "forward_backward", _fb(4.0))
    recorder.observe(RUN, "forward", _fb(99.0))  # an eval pass is no training step
    recorder.observe(RUN, "forward_backward", Failed("boom", "server"))
    recorder.observe(RUN, "optim_step", Completed(OptimResult(metrics={})))
    recorder.observe(SAMPLER, "sample", _sample(3, 4))
    live = await recorder.curves(RUN)
    assert live.points == [TrainPoint(0, 1, 1000.0, {"loss:sum": 4.0})]
    assert live.sampling == [SamplingBucket(1000.0, 7, 2)]
    monkeypatch.setattr(run_history, "MAX_RUNS_HELD", 0)
    await recorder.flush()
    assert recorder.statistics().runs_held == 0
    assert await recorder.curves(RUN) == live  # now read back from the store
    store.close()


async def test_samples_of_a_session_on_no_run_of_the_users_are_not_recorded(tmp_path: Path):
    asked: list[str] = []

    def sampler_run(sampler_id: str) -> None:
        asked.append(sampler_id)
        return None

    store, _table, recorder = _recorder(tmp_path, sampler_run)
    recorder.observe(SAMPLER, "sample", _sample(5))
    recorder.observe(SAMPLER, "sample", _sample(5))
    assert asked == [SAMPLER]  # looked up once per sampling session
    assert recorder.statistics().runs_held == 0
    store.close()


async def test_recorder_writes_what_is_left_when_cancelled(tmp_path: Path):
    store, table, recorder = _recorder(tmp_path)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            recorder.observe(RUN, "optim_step", Completed(OptimResult(metrics={"lr:mean": 0.1})))
            recorder.observe(RUN, "optim_step", Completed(OptimResult(metrics={"lr:mean": 0.1})))
            nursery.cancel_scope.cancel()
    assert table.row_counts([RUN]) == {RUN: (2, 0)}
    store.close()


def test_an_adopted_run_numbers_its_points_by_the_jobs_steps():
    history = RunHistory(lambda run_id: (2, 2))  # this node held two points of the run before it moved away
    history.resume(RUN, 7)  # adopted back at the job's step 7
    history.forward_backward(RUN, {"loss:sum": 2.0})
    point = history.optim_step(RUN, {}, now_s=100.0)
    assert (point.seq, point.step) == (2, 8)
