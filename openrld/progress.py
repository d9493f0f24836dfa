"""Progress of long operations on this node (a GGUF conversion, a model load), for people and clients.

A long operation runs in a worker thread and calls `ProgressBoard.report`
as it passes each stage; the board logs one line per report and keeps the
latest report per key (a base model name), so the discovery and model status
APIs can show "converting: 40%, dequantizing weights" instead of a silent wait.
Reading is `board.get(name)` (one model) or `board.statistics()` (all of them).

The board is plain data behind a `threading.Lock`: it is written from worker
threads and read from the event loop, and neither side ever waits long. It
never starts work, never imports trio or torch, and forgets nothing: a
finished operation stays on the board as `ready` (or `failed`, with the error),
so a client that polls late still sees how it ended.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

import msgspec

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where an operation is. Only `ready` and `failed` are final."""

    QUEUED = "queued"
    READING = "reading"  # the source's metadata and tokenizer
    CONVERTING = "converting"  # dequantizing / building the weights in memory
    WRITING = "writing"  # safetensors, config and tokenizer files into a staging directory
    PUBLISHING = "publishing"  # the atomic rename into the cache
    READY = "ready"
    FAILED = "failed"


FINAL_STAGES = frozenset({Stage.READY, Stage.FAILED})


class Progress(msgspec.Struct, frozen=True):
    """The latest report of one long operation."""

    key: str  # what the operation is for: a base model name as clients name it
    operation: str  # what it is: "gguf_conversion"
    stage: Stage
    fraction: float  # 0.0 .. 1.0 of the whole operation, never decreasing
    message: str  # one line a person can read: what is happening, or the error
    started_at: float  # unix seconds
    updated_at: float  # unix seconds

    @property
    def is_final(self) -> bool:
        return self.stage in FINAL_STAGES


class ProgressBoard:
    """Key -> latest `Progress`; written from worker threads, read from anywhere."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall time: clients compare it with their own clocks
        self._lock = threading.Lock()
        self._latest: dict[str, Progress] = {}

    def report(self, key: str, operation: str, stage: Stage, fraction: float, message: str) -> Progress:
        """Record and log one report; a new operation on a key restarts its clock.

        The fraction is clamped to [0, 1] and never goes below the key's last
        report of the same operation, so a reader never sees progress go back.
        """
        now = self._clock()
        with self._lock:
            previous = self._latest.get(key)
            if previous is not None and not previous.is_final and previous.operation == operation:
                started_at, floor = previous.started_at, previous.fraction  # the same operation goes on
            else:
                started_at, floor = now, 0.0
            progress = Progress(
                key=key, operation=operation, stage=stage, fraction=max(floor, min(1.0, max(0.0, fraction))),
                message=message, started_at=started_at, updated_at=now,
            )
            self._latest[key] = progress
        log = logger.warning if stage is Stage.FAILED else logger.info
        log(
            "progress operation=%s key=%s stage=%s fraction=%.2f elapsed_s=%.1f %s",
            operation, key, stage.value, progress.fraction, now - started_at, message,
        )
        return progress

    def get(self, key: str) -> Progress | None:
        with self._lock:
            return self._latest.get(key)

    def statistics(self) -> tuple[Progress, ...]:
        """Every key's latest report, ordered by key."""
        with self._lock:
            return tuple(self._latest[key] for key in sorted(self._latest))
