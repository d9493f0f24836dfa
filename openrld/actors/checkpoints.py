"""Publishing checkpoints atomically: staging directory, fsync, rename, then the row.

The trainer actor writes a checkpoint's files into a fresh staging directory
(in its worker thread); `describe` builds its manifest (the run's and the
checkpoint's facts, checkpoint_manifest.py) from the store, `commit_files`
writes the manifest beside the files and renames the whole into place, and
`record` adds its row from the same manifest. A daemon killed at any point
leaves either the whole checkpoint, listed, or nothing visible: the store
removes leftover staging directories when it opens. On a shared checkpoint
root the manifest is what lets another node adopt the checkpoint.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from openrld.checkpoint_manifest import CheckpointManifest
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

    def describe(
        self, model_id: str, kind: str, name: str, *, size_bytes: int, ttl_seconds: int | None,
        user_metadata: dict[str, str],
    ) -> CheckpointManifest:
        """The manifest of a checkpoint whose files are written; on the event loop (it reads the run's row)."""
        expires_at = None if ttl_seconds is None else utc_now() + timedelta(seconds=ttl_seconds)
        return self._store.manifest_for(
            model_id, kind, name, size_bytes=size_bytes, user_metadata=user_metadata, expires_at=expires_at
        )

    def commit_files(self, staging: Path, final: Path, overwrite: bool, manifest: CheckpointManifest) -> None:
        """Put the manifest beside the files and the whole into place; in a worker thread (it fsyncs)."""
        try:
            self._store.commit_dir(staging, final, replace=overwrite, manifest=manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def record(self, manifest: CheckpointManifest) -> str:
        """Add the committed checkpoint's row, from its manifest; returns its tinker:// path.

        The row is written whether or not one exists: the commit has put this
        directory in place (a second one would have been a Conflict there), so
        a row found now can only be this same checkpoint, adopted from its
        manifest on a shared root between the rename and this call.
        """
        row = self._store.add_checkpoint(
            manifest.run_id, manifest.kind, manifest.name, manifest.owner, manifest.size_bytes,
            manifest.user_metadata, manifest.expires_at, overwrite=True, created_at=manifest.created_at,
        )
        self._store.record_audit(
            manifest.owner, "checkpoint_created",
            {
                "tinker_path": row.tinker_path, "model_id": manifest.run_id, "actor": manifest.owner,
                "size_bytes": str(manifest.size_bytes),
            },
        )
        return row.tinker_path
