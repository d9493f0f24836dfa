"""Publishing checkpoints atomically: staging directory, fsync, rename, then the row.

The trainer actor writes a checkpoint's files into a fresh staging directory
(in its worker thread), then `commit_files` renames it into place and
`record` adds its row. A daemon killed at any point leaves either the whole
checkpoint, listed, or nothing visible: the store removes leftover staging
directories when it opens.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from openrld.errors import BadRequest, Conflict
from openrld.store import Store, utc_now

MIN_TTL_S = 3600  # the SDK documents 3600 s to 10 years
MAX_TTL_S = 10 * 365 * 24 * 3600


def check_ttl(ttl_seconds: int | None) -> None:
    """Checked at submission, before any file is written."""
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise BadRequest(f"ttl_seconds: expected {MIN_TTL_S}..{MAX_TTL_S}, got {ttl_seconds}")


class CheckpointWriter:
    def __init__(self, store: Store) -> None:
        self._store = store

    def prepare(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[Path, Path]:
        """(staging, final) for a new checkpoint; refuses a bad name or an existing one up front."""
        final = self._store.checkpoint_dir(model_id, kind, name)
        if not overwrite and self._store.get_checkpoint(model_id, kind, name) is not None:
            raise Conflict(f"checkpoint tinker://{model_id}/{kind}/{name} already exists; pass overwrite=True")
        return self._store.staging_dir(), final

    def commit_files(self, staging: Path, final: Path, overwrite: bool) -> None:
        try:
            self._store.commit_dir(staging, final, replace=overwrite)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def record(
        self, model_id: str, kind: str, name: str, *, size_bytes: int, overwrite: bool,
        ttl_seconds: int | None, user_metadata: dict[str, str],
    ) -> str:
        run = self._store.get_run(model_id)
        assert run is not None, f"checkpoint for unknown run {model_id}"
        expires_at = None if ttl_seconds is None else utc_now() + timedelta(seconds=ttl_seconds)
        row = self._store.add_checkpoint(
            model_id, kind, name, run.owner, size_bytes, user_metadata, expires_at, overwrite=overwrite
        )
        self._store.record_audit(
            run.owner, "checkpoint_created",
            {"tinker_path": row.tinker_path, "model_id": model_id, "actor": run.owner, "size_bytes": str(size_bytes)},
        )
        return row.tinker_path
