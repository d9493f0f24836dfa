"""Housekeeping: the expiry sweep deletes exactly the checkpoints whose TTL has passed, and audits
each; usage flushes; the request log forgets what finished over REQUEST_LOG_KEEP ago."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import trio

from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.maintenance import expire_checkpoints, run_maintenance
from openrld.actors.usage import UsageMeter
from openrld.ids import CheckpointKind
from openrld.store import REQUEST_LOG_KEEP, RequestFinish, Store

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _store_with_checkpoints(tmp_path: Path) -> Store:
    store = Store.open(tmp_path / "data", now=lambda: T0)
    store.sessions.create("s-1", "alice", [], {}, "0.38.0", None, None)
    store.runs.create("s-1:train:0", "s-1", "alice", "tiny", "/m", {"rank": 4}, {}, {}, {"type": "adamw"})
    for name, expires in (("old", T0 + timedelta(hours=1)), ("young", T0 + timedelta(hours=3)), ("forever", None)):
        final = store.files.checkpoint_dir("s-1:train:0", "weights", name)
        staging = store.files.staging_dir()
        (staging / "f").write_bytes(b"x")
        store.files.commit_dir(staging, final)
        store.checkpoints.add("s-1:train:0", CheckpointKind.WEIGHTS, name, "alice", 1, {}, expires)
    return store


async def test_only_checkpoints_past_their_ttl_are_deleted_with_their_files(tmp_path: Path) -> None:
    with _store_with_checkpoints(tmp_path) as store:
        gone = await expire_checkpoints(store, CheckpointWriter(store), T0 + timedelta(hours=2))
        assert gone == ["tinker://s-1:train:0/weights/old"]
        assert [c.name for c in store.checkpoints.of_run("s-1:train:0")] == ["young", "forever"]
        assert not store.files.checkpoint_dir("s-1:train:0", "weights", "old").exists()
        events = store.audit.events("alice", T0 - timedelta(days=1), T0 + timedelta(days=1))
        assert [(e, d["tinker_path"]) for _, e, d in events] == [("checkpoint_expired", "tinker://s-1:train:0/weights/old")]


def test_usage_counts_sampled_tokens_once_per_request(tmp_path: Path) -> None:
    meter = UsageMeter(now=lambda: T0.timestamp() + 90)
    meter.sample_submitted(request_id="r-1", sampler_id="s-1:sample:0", owner="alice", base_model="tiny", prompt_tokens=7)
    meter.sample_delivered("r-1", 5)
    meter.sample_delivered("r-1", 5)  # a re-read of the same result
    meter.training(model_id="s-1:train:0", owner="alice", base_model="tiny", tokens=19)
    with Store.open(tmp_path / "data", now=lambda: T0) as store:
        assert meter.flush(store) == 3
        rows = store.usage_ledger.of_owner("alice", T0, T0 + timedelta(hours=1))
    assert sorted((r.kind, r.tokens, r.session_id, r.bucket_start) for r in rows) == [
        ("sampling_prefill", 7, "s-1", T0), ("sampling_sample", 5, "s-1", T0), ("training", 19, "s-1", T0),
    ]


async def test_a_sweep_forgets_requests_finished_over_the_keep_ago(tmp_path: Path) -> None:
    with Store.open(tmp_path / "data", now=lambda: T0) as store:
        for request_id, finished in (("r-old", T0), ("r-recent", T0 + timedelta(hours=2))):
            store.requests.record(request_id, "s-1:train:0", "optim_step")
            store.requests.finish([RequestFinish(request_id, finished)])
        async with trio.open_nursery() as nursery:
            now = lambda: T0 + REQUEST_LOG_KEEP + timedelta(hours=1)  # noqa: E731
            await nursery.start(partial(run_maintenance, store, UsageMeter(), CheckpointWriter(store), interval_s=3600, now=now))
            nursery.cancel_scope.cancel()
        assert (store.requests.state("r-old"), store.requests.state("r-recent")) == (None, "done")
