"""The query worker: a process of its own that runs one untrusted SQL query at a time, read-only.

Started by `sandbox.QueryPool` as `python sql_worker.py` (a script, so that it
imports nothing of the recipe or the trainer: only the standard library and
msgspec). It reads length-prefixed msgpack frames from stdin, one `Query`
each, and writes one `QueryResult` frame to stdout per query. Nothing is
pickled.

What a query cannot do here:
- write, attach, or change settings: the database is opened with a
  `file:...?mode=ro` URI, and an authorizer allows only reading (SELECT,
  READ, FUNCTION, RECURSIVE); ATTACH, PRAGMA, every write and every
  transaction statement are denied before they run;
- run past its time: a progress handler interrupts it at the deadline (the
  parent also kills this process if no answer comes soon after);
- return more than `max_rows` rows (it stops fetching at `max_rows + 1`);
- use more than `MEMORY_LIMIT_BYTES` of address space (RLIMIT_AS).
"""

from __future__ import annotations

import resource
import sqlite3
import struct
import sys
import time

import msgspec

MEMORY_LIMIT_BYTES = 1 << 30  # sqlite3 and msgspec need well under 100 MiB; a runaway sort stops here
PROGRESS_EVERY_OPS = 10_000  # VM steps between deadline checks: ~1 ms of work, so the limit is kept to within it
FRAME_HEADER = struct.Struct("<I")  # each frame: its length in bytes, then the msgpack body


class Query(msgspec.Struct, frozen=True):
    db_path: str
    sql: str
    time_limit_s: float
    max_rows: int


class QueryResult(msgspec.Struct, frozen=True):
    status: str  # "ok", "refused" (the authorizer), "timeout", "too_many_rows", "error"
    rows: list[list] = []  # cells are SQLite's values: int, float, str, bytes or None
    message: str = ""


ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                             sqlite3.SQLITE_RECURSIVE})


def _authorize(action: int, _arg1, _arg2, _db_name, _trigger) -> int:
    return sqlite3.SQLITE_OK if action in ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def run_query(query: Query) -> QueryResult:
    """Run `query` against its database, read-only, under the limits; never raises for a bad query."""
    connection = sqlite3.connect(f"file:{query.db_path}?mode=ro", uri=True, isolation_level=None)
    try:
        connection.set_authorizer(_authorize)
        deadline = time.monotonic() + query.time_limit_s
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY_OPS)
        try:
            cursor = connection.execute(query.sql)
            rows = cursor.fetchmany(query.max_rows + 1)
        except sqlite3.DatabaseError as error:
            text = str(error)
            if "not authorized" in text or "authorization denied" in text:
                return QueryResult("refused", message=text)
            if "interrupted" in text:
                return QueryResult("timeout", message=text)
            return QueryResult("error", message=text)
        except (sqlite3.Warning, sqlite3.ProgrammingError, ValueError, OverflowError, MemoryError) as error:
            return QueryResult("error", message=f"{type(error).__name__}: {error}")
        if len(rows) > query.max_rows:
            return QueryResult("too_many_rows", message=f"more than {query.max_rows} rows")
        return QueryResult("ok", rows=[list(row) for row in rows])
    finally:
        connection.close()


def _read_exactly(stream, n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def serve(stdin, stdout) -> None:
    """Answer queries until stdin closes."""
    decoder = msgspec.msgpack.Decoder(Query)
    encoder = msgspec.msgpack.Encoder()
    while (header := _read_exactly(stdin, FRAME_HEADER.size)) is not None:
        body = _read_exactly(stdin, FRAME_HEADER.unpack(header)[0])
        if body is None:
            return
        result = run_query(decoder.decode(body))
        payload = encoder.encode(result)
        stdout.write(FRAME_HEADER.pack(len(payload)) + payload)
        stdout.flush()


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    serve(sys.stdin.buffer, sys.stdout.buffer)
