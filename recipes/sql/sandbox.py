"""A pool of query worker processes: the only way the recipe runs a model's SQL.

Each worker is `sql_worker.py` in a process of its own (see its docstring for
what a query cannot do there). `QueryPool.run` takes an idle worker, sends it
one query and waits for the answer until the query's time limit plus
`KILL_GRACE_S`; past that, or if the worker died, the worker is killed and
replaced, and the query's result is a timeout (or an error). So a query that
the in-process progress handler cannot stop still ends on time, and one
query's crash never reaches another's.

Thread-safe: the training loop calls `run` from several threads at once (one
per reply being scored), and at most `size` queries run at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from recipes.sql.sql_worker import FRAME_HEADER, Query, QueryResult

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("sql_worker.py")
KILL_GRACE_S = 1.0  # past the query's own limit: the progress handler answers well within this when it can


class QueryLimits(msgspec.Struct, frozen=True):
    time_limit_s: float = 2.0  # a gold query here runs in under 5 ms; a model's join without ON is still < 1 s
    max_rows: int = 1000  # the largest gold answer is 25 rows; a cross join is refused well before it costs memory


class _Worker:
    """One worker process and its pipes."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, close_fds=True,
        )

    def ask(self, query: Query, wait_s: float) -> QueryResult | None:
        """Send `query`; the result, or None if none came within `wait_s` (or the worker died)."""
        body = msgspec.msgpack.encode(query)
        try:
            self.process.stdin.write(FRAME_HEADER.pack(len(body)) + body)
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        header = self._read(FRAME_HEADER.size, time.monotonic() + wait_s)
        if header is None:
            return None
        payload = self._read(FRAME_HEADER.unpack(header)[0], time.monotonic() + wait_s)
        return None if payload is None else msgspec.msgpack.decode(payload, type=QueryResult)

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd = self.process.stdout.fileno()
        chunks: list[bytes] = []
        remaining = n
        while remaining > 0:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, remaining)
            if not chunk:
                return None  # the worker exited
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()

    def close(self) -> None:
        """Ask the worker to exit (stdin closed), and kill it if it does not."""
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


class QueryPool:
    """`size` worker processes; `run(db_path, sql)` answers a QueryResult and never raises for the query's sake."""

    def __init__(self, size: int = 2, limits: QueryLimits = QueryLimits()) -> None:
        self.limits = limits
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(size):
            self._idle.put(_Worker())
        self._size = size
        self.killed_workers = 0  # workers that overran and were replaced

    def run(self, db_path: Path, sql: str) -> QueryResult:
        query = Query(str(db_path), sql, self.limits.time_limit_s, self.limits.max_rows)
        worker = self._idle.get()
        try:
            result = worker.ask(query, self.limits.time_limit_s + KILL_GRACE_S)
        except BaseException:
            worker.kill()
            self._idle.put(_Worker())
            raise
        if result is None:
            timed_out = worker.process.poll() is None
            worker.kill()
            self.killed_workers += 1
            logger.info("query worker pid=%d %s; replaced", worker.process.pid,
                        "overran its limit" if timed_out else "died")
            self._idle.put(_Worker())
            return QueryResult("timeout" if timed_out else "error", message="the worker was killed" if timed_out
                               else "the worker died")
        self._idle.put(worker)
        return result

    def close(self) -> None:
        for _ in range(self._size):
            self._idle.get().close()

    def __enter__(self) -> QueryPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
