"""The rows of every run's training curves: the `run_history` and `run_sampling` tables.

This module owns how a run's history (actors/run_history.py) is kept in the
node's SQLite database, beside the run it belongs to. It guarantees:
- bounded rows: after each write a run keeps at most `max_points` training
  points (the newest, by `seq`) and its sampling buckets of the last
  `max_buckets` bucket widths; older rows are deleted in the same transaction;
- one transaction per write, so a kill leaves whole batches or none.

It has its own connection (made by database.py, which syncs it with the
rest: a curve that lags by its last batch after a power loss is harmless),
because its writes and reads run in a worker thread, off the event loop,
while the store's own connection serves the loop. A lock makes its calls one at a time
whichever thread makes them (the one read the event loop makes, `counters`, is
a single indexed row). It never imports trio or torch and decides nothing
about who may read what.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence

import msgspec

# Tables added after schema version 1; the store creates them at open (store._ADDITIVE_SCHEMA).
HISTORY_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_history (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, step INTEGER NOT NULL,
    at_s REAL NOT NULL, metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS run_sampling (
    run_id TEXT NOT NULL, start_s REAL NOT NULL, tokens INTEGER NOT NULL, sequences INTEGER NOT NULL,
    PRIMARY KEY (run_id, start_s)
);
"""



class TrainPoint(msgspec.Struct, frozen=True):
    """One optim_step of a run, with the metrics of the forward_backward calls before it."""

    seq: int  # the point's number in its run, from 0; never reused, so a reader can ask for what is newer
    step: int  # optim_steps the run had done after this one (1 for the first)
    at_s: float  # wall-clock time it settled, seconds since the epoch
    metrics: dict[str, float]  # "name:reduction" -> value, as forward_backward and optim_step returned them


class SamplingBucket(msgspec.Struct, frozen=True):
    """The sequences a run's sampling sessions delivered in one bucket of wall-clock time."""

    start_s: float  # the bucket's start, seconds since the epoch, a multiple of its width
    tokens: int  # sampled tokens
    sequences: int


class HistoryRows(msgspec.Struct, frozen=True):
    """What one write adds: new points, and buckets (new, or with higher counts than last written)."""

    points: list[tuple[str, TrainPoint]]  # (run_id, point)
    buckets: list[tuple[str, SamplingBucket]]  # (run_id, bucket): replaces the row with its start


_metrics = msgspec.json.Decoder(dict[str, float])


class HistoryTable:
    """`run_history` and `run_sampling` on a connection of their own. One caller at a time."""

    def __init__(self, conn: sqlite3.Connection, *, max_points: int, max_buckets: int, bucket_s: float) -> None:
        self.max_points = max_points
        self.max_buckets = max_buckets
        self.bucket_s = bucket_s
        self._conn = conn
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def write(self, rows: HistoryRows) -> None:
        """Add `rows` in one transaction, then trim each run they touch to the bounds."""
        with self._lock:
            self._write(rows)

    def _write(self, rows: HistoryRows) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT OR REPLACE INTO run_history (run_id, seq, step, at_s, metrics) VALUES (?, ?, ?, ?, ?)",
                [(run_id, p.seq, p.step, p.at_s, msgspec.json.encode(p.metrics)) for run_id, p in rows.points],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO run_sampling (run_id, start_s, tokens, sequences) VALUES (?, ?, ?, ?)",
                [(run_id, b.start_s, b.tokens, b.sequences) for run_id, b in rows.buckets],
            )
            newest_seq: dict[str, int] = {}
            for run_id, point in rows.points:
                newest_seq[run_id] = max(newest_seq.get(run_id, -1), point.seq)
            conn.executemany(
                "DELETE FROM run_history WHERE run_id = ? AND seq <= ?",
                [(run_id, seq - self.max_points) for run_id, seq in newest_seq.items()],
            )
            newest_start: dict[str, float] = {}
            for run_id, bucket in rows.buckets:
                newest_start[run_id] = max(newest_start.get(run_id, 0.0), bucket.start_s)
            conn.executemany(
                "DELETE FROM run_sampling WHERE run_id = ? AND start_s <= ?",
                [(run_id, start - self.max_buckets * self.bucket_s) for run_id, start in newest_start.items()],
            )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def points(self, run_id: str, after_seq: int = -1) -> list[TrainPoint]:
        """The run's points with `seq` over `after_seq`, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, step, at_s, metrics FROM run_history WHERE run_id = ? AND seq > ? ORDER BY seq",
                (run_id, after_seq),
            ).fetchall()
        return [TrainPoint(seq, step, at_s, _metrics.decode(metrics)) for seq, step, at_s, metrics in rows]

    def buckets(self, run_id: str) -> list[SamplingBucket]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT start_s, tokens, sequences FROM run_sampling WHERE run_id = ? ORDER BY start_s", (run_id,)
            ).fetchall()
        return [SamplingBucket(start, tokens, sequences) for start, tokens, sequences in rows]

    def counters(self, run_id: str) -> tuple[int, int]:
        """(the next seq, the last step) of a run, from its newest row; (0, 0) for a run with none."""
        with self._lock:
            row = self._conn.execute(
                "SELECT seq, step FROM run_history WHERE run_id = ? ORDER BY seq DESC LIMIT 1", (run_id,)
            ).fetchone()
        return (0, 0) if row is None else (int(row[0]) + 1, int(row[1]))

    def row_counts(self, run_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """run_id -> (points, buckets) held for it; for checks of the bounds."""
        counts: dict[str, tuple[int, int]] = {}
        with self._lock:
            for run_id in run_ids:
                (points,) = self._conn.execute("SELECT count(*) FROM run_history WHERE run_id = ?", (run_id,)).fetchone()
                (buckets,) = self._conn.execute(
                    "SELECT count(*) FROM run_sampling WHERE run_id = ?", (run_id,)
                ).fetchone()
                counts[run_id] = (int(points), int(buckets))
        return counts
