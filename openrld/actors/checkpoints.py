"""Publishing checkpoints atomically: staging directory, fsync, rename, then the row.

The trainer actor writes a checkpoint's files into a fresh staging directory
(in its worker thread); `describe` builds its manifest (the run's and the
checkpoint's facts, checkpoint_manifest.py) from the store, `commit_files`
writes the manifest beside the files and renames the whole into place, and
`record` adds its row from the same manifest. A daemon killed at any point
leaves either the whole checkpoint, listed, or nothing visible: the store
removes leftover staging directories when it opens. On a shared checkpoint
root the manifest is what lets another node adopt the checkpoint.

It also owns the filesystem work on checkpoints that exist: deleting one,
rewriting its manifest (publish, TTL), and adopting another node's from a
shared root. Each is a row half, on the event loop (SQLite, as every other
row), and a file half (rename, rmtree, fsync, directory listings, manifest
reads), in a worker thread under this writer's limiter: on a slow or shared
filesystem (NFS, GCS FUSE) those take seconds, and on the loop they would
stall every client of the node.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta
from pathlib import Path

import trio

from openrld.checkpoint_manifest import CheckpointManifest
from openrld.errors import BadRequest, Conflict
from openrld.ids import CheckpointKind, TinkerPath
from openrld.store import CheckpointRow, RunRow, Store, utc_now

MIN_TTL_S = 3600  # the SDK documents 3600 s to 10 years
MAX_TTL_S = 10 * 365 * 24 * 3600


def check_ttl(ttl_seconds: int | None) -> None:
    """Checked at submission, before any file is written."""
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise BadRequest(f"ttl_seconds: expected {MIN_TTL_S}..{MAX_TTL_S}, got {ttl_seconds}")


# Worker threads for deletes, manifest rewrites and adoption at once: a slow disk queues them here
# rather than taking a thread per request (saves commit in the trainer's own threads).
FILE_THREADS = 4


class CheckpointWriter:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._files = trio.CapacityLimiter(FILE_THREADS)

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

    # ------------------------------------------------------------ checkpoints that exist

    async def _in_thread(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._files)

    async def delete(self, run_id: str, kind: CheckpointKind | str, name: str) -> None:
        """Remove a checkpoint: its row now, its files in a thread (`Store.delete_checkpoint`'s order).

        Raises:
            NotFound: no such checkpoint.
        """
        path = self._store.delete_checkpoint_row(run_id, kind, name)
        await self._in_thread(self._store.remove_checkpoint_files, path)

    async def set_public(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> None:
        """Publish or unpublish: the row now, the manifest (fsynced) in a thread. Raises NotFound."""
        path = self._store.set_checkpoint_public_row(run_id, kind, name, public)
        await self._in_thread(lambda: self._store.update_manifest(path, public=public))

    async def set_expiry(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> None:
        """Set or clear a TTL: the row now, the manifest (fsynced) in a thread. Raises NotFound."""
        path = self._store.set_checkpoint_expiry_row(run_id, kind, name, expires_at)
        await self._in_thread(lambda: self._store.update_manifest(path, expires_at=expires_at))

    async def adopt_checkpoint(self, path: TinkerPath) -> CheckpointRow | None:
        """`Store.adopt_checkpoint`, its manifest read in a thread; None at once off a shared root."""
        if not self._store.is_shared:
            return None
        manifest = await self._in_thread(self._store.read_adoptable, path)
        return self._store.insert_adopted(path, manifest)

    async def adopt_run(self, run_id: str) -> RunRow | None:
        """`Store.adopt_run`, the run's directory listed and manifests read in a thread."""
        if not self._store.is_shared:
            return None
        for path in await self._in_thread(self._store.run_checkpoint_paths, run_id):
            if self._store.get_checkpoint(path.run_id, path.kind, path.name) is None:
                await self.adopt_checkpoint(path)
        return self._store.get_run(run_id)
