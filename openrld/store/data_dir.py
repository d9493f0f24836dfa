"""A node's data dir, opened: its lock, crash recovery, and the `Store` that composes its parts.

    <data_dir>/openrld.sqlite3     the database (database.py) and its repositories
    <data_dir>/checkpoints/...     checkpoint directories (checkpoint_files.py)
    <data_dir>/tmp/                staging for checkpoint writes; emptied at open
    <data_dir>/lock                held while a Store is open

`Store.open` takes the lock (one Store per data dir at a time), recovers the
checkpoint files, opens the database and marks the requests a dead daemon
left pending as lost. A `Store` then holds one object per concern:
`sessions`, `samplers`, `runs`, `checkpoints` (rows), `requests`, `audit`,
`usage_ledger`, `files` (the checkpoint filesystem) and `adoption`; `database`
is the connections they share. Beyond opening, it only joins a checkpoint's row
and files for callers off the event loop; callers use the parts themselves.

It never decides policy (who may see what is the API's check, using the
`owner` columns) and never imports trio or torch.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import IO

from openrld.errors import ServerError
from openrld.ids import CheckpointKind
from openrld.store.adoption import Adoption
from openrld.store.audit import AuditLog, UsageLedger
from openrld.store.checkpoint_files import CheckpointFiles
from openrld.store.checkpoint_rows import CheckpointRepository
from openrld.store.database import Database
from openrld.store.history_table import HistoryTable
from openrld.store.requests import REQUEST_LOG_KEEP, RequestLog
from openrld.store.rows import StoreStatistics, utc_now
from openrld.store.runs import RunRepository
from openrld.store.samplers import SamplerRepository
from openrld.store.sessions import SessionRepository

logger = logging.getLogger(__name__)


class Store:
    """SQLite metadata and checkpoint directories under one data dir. Use `Store.open`."""

    def __init__(self, data_dir: Path, database: Database, files: CheckpointFiles, lock_file: IO[bytes]) -> None:
        self.data_dir = data_dir
        self.database = database
        self.files = files
        self._lock_file = lock_file
        self.sessions = SessionRepository(database)
        self.samplers = SamplerRepository(database)
        self.runs = RunRepository(database)
        self.checkpoints = CheckpointRepository(database)
        self.requests = RequestLog(database)
        self.audit = AuditLog(database)
        self.usage_ledger = UsageLedger(database)
        self.adoption = Adoption(database, self.runs, self.checkpoints, files)
        self.is_shared = files.is_shared

    @classmethod
    def open(
        cls, data_dir: Path, *, checkpoint_root: Path | None = None, now: Callable[[], datetime] = utc_now
    ) -> Store:
        """Open (creating if needed) the store in `data_dir`, and recover from a crash.

        Args:
            data_dir: the node's data dir; made absolute here.
            checkpoint_root: a directory shared by the cluster's nodes to keep
                checkpoints in; None keeps them in <data_dir>/checkpoints.
            now: the wall clock (UTC); tests pass a fixed one.

        Raises:
            ServerError: another Store holds the data dir, its schema is not ours,
                or `checkpoint_root` is not an existing directory.
        """
        data_dir = data_dir.expanduser().absolute()
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_file = (data_dir / "lock").open("ab")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise ServerError(f"data dir {data_dir} is in use by another openrld process") from None
        try:
            files = CheckpointFiles.open(data_dir, checkpoint_root)
            database = Database.open(data_dir, now)
        except BaseException:
            lock_file.close()
            raise
        store = cls(data_dir, database, files, lock_file)
        pending = store.requests.pending()
        store.requests.mark_all_lost(now())
        store.requests.prune(now() - REQUEST_LOG_KEEP)
        if pending:
            logger.warning("data_dir=%s: %d requests pending at the last stop are now lost", data_dir, pending)
        return store

    def close(self) -> None:
        self.database.close()
        self._lock_file.close()  # releases the flock

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def history_table(self, *, max_points: int, max_buckets: int, bucket_s: float) -> HistoryTable:
        """The runs' curves on a connection of their own, for a worker thread (history_table.py); closed with the store."""
        return self.database.history_table(max_points=max_points, max_buckets=max_buckets, bucket_s=bucket_s)

    def statistics(self) -> StoreStatistics:
        checkpoints = self.database.one("SELECT count(*), coalesce(sum(size_bytes), 0) FROM checkpoints", ())
        assert checkpoints is not None
        return StoreStatistics(
            sessions=self.database.count("SELECT count(*) FROM sessions"),
            runs=self.database.count("SELECT count(*) FROM runs"),
            samplers=self.database.count("SELECT count(*) FROM samplers"),
            checkpoints=int(checkpoints[0]),
            checkpoint_bytes=int(checkpoints[1]),
            pending_requests=self.requests.pending(),
        )

    # --- a checkpoint's row and files together, in the caller's thread --------------------------------
    # The daemon runs the two halves apart (the row on the loop, the files in the checkpoint actor's
    # threads: actors/checkpoints.py); these keep the order (row first) for tests and tools.

    def delete_checkpoint(self, run_id: str, kind: CheckpointKind | str, name: str) -> None:
        """Remove a checkpoint's row, then its directory: a crash in between leaves an unlisted
        directory, never a listed checkpoint with no files. Raises NotFound."""
        self.files.remove(self.checkpoints.delete(run_id, kind, name))

    def set_checkpoint_public(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> None:
        """Publish or unpublish a checkpoint: its row, then its manifest. Raises NotFound."""
        self.files.update_manifest(self.checkpoints.set_public(run_id, kind, name, public), public=public)

    def set_checkpoint_expiry(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> None:
        """Set (None: remove) a checkpoint's expiry: its row, then its manifest. Raises NotFound."""
        path = self.checkpoints.set_expiry(run_id, kind, name, expires_at)
        self.files.update_manifest(path, expires_at=expires_at)
