"""The daemon's periodic housekeeping: checkpoint expiry, usage flushes, request-log pruning, and
on a shared checkpoint root the removal of ended jobs' auto-saves (`AutosaveStore.prune_ended`).

`run_maintenance` is a long-running task started from daemon.py. Every
`interval_s` it deletes the checkpoints whose TTL has passed (row first, then
files in a worker thread, through the checkpoint writer), writing a
`checkpoint_expired` audit event for each, flushes the usage meter into
the store, and forgets logged requests that finished over REQUEST_LOG_KEEP
ago: a busy node logs tens of requests a second, and before this the table
only shrank at a restart. `expire_checkpoints` is the one sweep, callable on
its own.

It never decides a TTL (the API sets them) and never touches a checkpoint
that has no expiry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

import trio

from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.usage import UsageMeter
from openrld.errors import NotFound
from openrld.store import REQUEST_LOG_KEEP, Store, utc_now

logger = logging.getLogger(__name__)


async def expire_checkpoints(store: Store, checkpoints: CheckpointWriter, now: datetime) -> list[str]:
    """Delete every checkpoint expired at `now`; returns their tinker paths."""
    gone: list[str] = []
    for row in store.checkpoints.expired(now):
        try:
            await checkpoints.delete(row.run_id, row.kind, row.name)
        except NotFound:
            continue  # deleted by its owner since the query
        store.audit.record(
            row.owner, "checkpoint_expired",
            {"tinker_path": row.tinker_path, "model_id": row.run_id, "actor": "openrld"},
        )
        logger.info("checkpoint expired tinker_path=%s owner=%s", row.tinker_path, row.owner)
        gone.append(row.tinker_path)
    return gone


async def run_maintenance(
    store: Store,
    usage: UsageMeter,
    checkpoints: CheckpointWriter,
    *,
    interval_s: float,
    now: Callable[[], datetime] = utc_now,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sweep expired checkpoints, flush usage and prune the request log every `interval_s`, until cancelled.

    A final usage flush runs on cancel, shielded and bounded, so a clean stop
    loses no counts.
    """
    task_status.started()
    try:
        while True:
            await expire_checkpoints(store, checkpoints, now())
            if checkpoints.autosaves is not None:  # a shared root: the auto-saves of jobs that have ended
                await checkpoints.autosaves.prune_ended()
            usage.flush(store)
            store.requests.prune(now() - REQUEST_LOG_KEEP)
            # On a node where nothing else waits for a sync, this one checkpoints the WAL.
            await checkpoints.durable()
            await trio.sleep(interval_s)
    finally:
        usage.flush(store)
