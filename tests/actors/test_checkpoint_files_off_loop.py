"""The checkpoint actor keeps file work off the event loop: on a filesystem where deleting a
checkpoint and writing a manifest take SLOW_S each, the loop's steps stay short (LoopWatch
counts none over 100 ms) and another task keeps ticking, while the work still gets done."""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio

import openrld.store.checkpoint_files
from openrld.actors.checkpoints import CheckpointWriter
from openrld.checkpoint_manifest import read_manifest
from openrld.ids import CheckpointKind, TinkerPath
from openrld.loop_watch import LoopWatch
from openrld.store import Store

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "s-1:train:0"
SLOW_S = 0.5
TICK_S = 0.01


def _slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(SLOW_S)
        return fn(*args, **kwargs)

    return slow


@pytest.fixture
def store(tmp_path: Path):
    store = Store.open(tmp_path / "data", now=lambda: T0)
    store.sessions.create("s-1", "alice", [], {}, "0.38.0", None, None)
    store.runs.create(RUN, "s-1", "alice", "tiny", "/m", {"rank": 4}, {}, {}, {"type": "adamw"})
    for name in ("doomed", "kept"):
        staging = store.files.staging_dir()
        (staging / "weights.bin").write_bytes(b"x")
        manifest = store.adoption.manifest_for(RUN, "weights", name, size_bytes=1, user_metadata={}, expires_at=None)
        store.files.commit_dir(staging, store.files.checkpoint_dir(RUN, "weights", name), manifest=manifest)
        store.checkpoints.add(RUN, CheckpointKind.WEIGHTS, name, "alice", 1, {}, None)
    yield store
    store.close()


async def test_a_slow_delete_and_a_slow_publish_leave_the_loop_free(store: Store, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "rmtree", _slowed(shutil.rmtree))
    files = openrld.store.checkpoint_files
    monkeypatch.setattr(files, "write_manifest", _slowed(files.write_manifest))
    writer = CheckpointWriter(store)
    watch = LoopWatch(0.1)
    ticks = 0

    async def tick(done: trio.Event) -> None:
        nonlocal ticks
        while not done.is_set():
            await trio.sleep(TICK_S)
            ticks += 1

    trio.lowlevel.add_instrument(watch)
    try:
        done = trio.Event()
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick, done)
            async with trio.open_nursery() as work:
                work.start_soon(writer.delete, RUN, "weights", "doomed")
                work.start_soon(writer.set_public, RUN, "weights", "kept", True)
            done.set()
        took = trio.current_time() - started
    finally:
        trio.lowlevel.remove_instrument(watch)

    assert took >= SLOW_S  # the shim was in the way
    assert watch.statistics().slow_steps == 0, watch.statistics()
    assert ticks >= 0.5 * took / TICK_S  # the ticker was not held up (half its rate, for a busy machine)
    assert [c.name for c in store.checkpoints.of_run(RUN)] == ["kept"]
    assert not store.files.checkpoint_dir(RUN, "weights", "doomed").exists()
    kept = read_manifest(store.files.checkpoint_dir(RUN, "weights", "kept"), TinkerPath.of(RUN, "weights", "kept"))
    assert kept is not None and kept.public
