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

The routes reach checkpoints only through it: the owner rule (`owned`,
`readable`: another user's unpublished checkpoint is a 404, as a missing one),
publish and TTL with their audit events, copies into a run of the caller's
own, and the file names and bytes behind signed downloads, read in its threads.
"""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path

import trio

from openrld.actors.autosaves import AutosaveStore
from openrld.actors.durable_commits import DurableCommits
from openrld.checkpoint_manifest import CheckpointManifest
from openrld.errors import BadRequest, Conflict, NotFound
from openrld.ids import CheckpointKind, TinkerPath, new_request_id, parse_tinker_path
from openrld.store import CheckpointRow, RunRow, Store, utc_now
from openrld.store.checkpoint_files import copy_files, list_files, read_file

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
    def __init__(self, store: Store, commits: DurableCommits | None = None) -> None:
        # One per daemon, shared with the session and job tables, so that their syncs group.
        self._commits = commits if commits is not None else DurableCommits(store.database.sync)
        self._rows = store.checkpoints
        self._runs = store.runs
        self._files = store.files
        self._adoption = store.adoption
        self._audit_log = store.audit
        self._file_threads = trio.CapacityLimiter(FILE_THREADS)
        # Jobs' auto-saves (actors/autosaves.py): written only to a checkpoint root shared by the cluster.
        self.autosaves = AutosaveStore(store) if store.files.is_shared else None

    async def prepare(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[Path, Path]:
        """(staging, final) for a new checkpoint; refuses a bad name or an existing one up front.

        The final path is resolved (symlinks refused) and the staging dir made
        in a thread of its own: a save never queues behind slow deletes.

        Raises:
            BadRequest: an unsafe name or unknown kind.
            Conflict: the checkpoint exists and `overwrite` is false.
        """
        TinkerPath.of(model_id, kind, name)  # a bad name is refused before anything else
        if not overwrite and self._rows.get(model_id, kind, name) is not None:
            raise Conflict(f"checkpoint tinker://{model_id}/{kind}/{name} already exists; pass overwrite=True")
        files = self._files

        def make() -> tuple[Path, Path]:
            final = files.checkpoint_dir(model_id, kind, name)
            return files.staging_dir(), final

        return await trio.to_thread.run_sync(make)

    def describe(
        self, model_id: str, kind: str, name: str, *, size_bytes: int, ttl_seconds: int | None,
        user_metadata: dict[str, str],
    ) -> CheckpointManifest:
        """The manifest of a checkpoint whose files are written; on the event loop (it reads the run's row)."""
        expires_at = None if ttl_seconds is None else utc_now() + timedelta(seconds=ttl_seconds)
        return self._adoption.manifest_for(
            model_id, kind, name, size_bytes=size_bytes, user_metadata=user_metadata, expires_at=expires_at
        )

    async def commit(self, staging: Path, final: Path, overwrite: bool, manifest: CheckpointManifest) -> None:
        """`commit_files` in a thread of its own (not the limiter's: a save never queues behind slow deletes)."""
        await trio.to_thread.run_sync(self.commit_files, staging, final, overwrite, manifest)

    def commit_files(self, staging: Path, final: Path, overwrite: bool, manifest: CheckpointManifest) -> None:
        """Put the manifest beside the files and the whole into place; in a worker thread (it fsyncs)."""
        try:
            self._files.commit_dir(staging, final, replace=overwrite, manifest=manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    async def record(self, manifest: CheckpointManifest) -> str:
        """Add the committed checkpoint's row, from its manifest, and wait until it is on disk;
        returns its tinker:// path.

        The row is written whether or not one exists: the commit has put this
        directory in place (a second one would have been a Conflict there), so
        a row found now can only be this same checkpoint, adopted from its
        manifest on a shared root between the rename and this call.
        """
        row = self._rows.add(
            manifest.run_id, manifest.kind, manifest.name, manifest.owner, manifest.size_bytes,
            manifest.user_metadata, manifest.expires_at, overwrite=True, created_at=manifest.created_at,
        )
        self._audit_log.record(
            manifest.owner, "checkpoint_created",
            {
                "tinker_path": row.tinker_path, "model_id": manifest.run_id, "actor": manifest.owner,
                "size_bytes": str(manifest.size_bytes),
            },
        )
        await self._commits.durable()
        return row.tinker_path

    # ------------------------------------------------------------ checkpoints that exist

    async def _in_thread(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._file_threads)

    async def durable(self) -> None:
        """Every commit so far on disk (DurableCommits), for the maintenance loop's idle checkpointing."""
        await self._commits.durable()

    async def delete(self, run_id: str, kind: CheckpointKind | str, name: str) -> None:
        """Remove a checkpoint: its row now, its files in a thread (`Store.delete_checkpoint`'s order).

        Raises:
            NotFound: no such checkpoint.
        """
        path = self._rows.delete(run_id, kind, name)
        # The row's removal on disk first: after a power loss, no row may name removed files.
        await self._commits.durable()
        await self._in_thread(self._files.remove, path)

    async def set_public(self, run_id: str, kind: CheckpointKind | str, name: str, public: bool) -> None:
        """Publish or unpublish: the row now, the manifest (fsynced) in a thread. Raises NotFound."""
        path = self._rows.set_public(run_id, kind, name, public)
        await self._in_thread(lambda: self._files.update_manifest(path, public=public))

    async def set_expiry(
        self, run_id: str, kind: CheckpointKind | str, name: str, expires_at: datetime | None
    ) -> None:
        """Set or clear a TTL: the row now, the manifest (fsynced) in a thread. Raises NotFound."""
        path = self._rows.set_expiry(run_id, kind, name, expires_at)
        await self._in_thread(lambda: self._files.update_manifest(path, expires_at=expires_at))

    async def adopt_checkpoint(self, path: TinkerPath) -> CheckpointRow | None:
        """`Store.adopt_checkpoint`, its manifest read in a thread; None at once off a shared root."""
        if not self._files.is_shared:
            return None
        manifest = await self._in_thread(self._files.read_adoptable, path)
        return self._adoption.insert_adopted(path, manifest)

    async def adopt_to_read(self, path: str) -> None:
        """Adopt `path` from a shared root when this node holds no row for it, its manifest read in
        a thread, so that `readable_checkpoint` (which runs on the event loop and touches no file)
        then finds it. A malformed path is left for the reader to refuse."""
        try:
            tinker_path = parse_tinker_path(path)
        except BadRequest:
            return
        if self._rows.get(tinker_path.run_id, tinker_path.kind, tinker_path.name) is None:
            await self.adopt_checkpoint(tinker_path)

    async def adopt_run(self, run_id: str) -> RunRow | None:
        """`Store.adopt_run`, the run's directory listed and manifests read in a thread."""
        if not self._files.is_shared:
            return None
        for path in await self._in_thread(self._files.run_checkpoint_paths, run_id):
            if self._rows.get(path.run_id, path.kind, path.name) is None:
                await self.adopt_checkpoint(path)
        return self._runs.get(run_id)

    def written_after(self, run_id: str, since: datetime) -> set[tuple[str, str]]:
        """(kind, name) of the run's checkpoints written after `since`. For an adopter, `since` is the
        auto-save it resumed from (the dead home's clock, as are the adopted rows): those saves were of
        steps it recomputes, and the replay of each save writes it again."""
        return {(row.kind.value, row.name) for row in self._rows.of_run(run_id) if row.created_at > since}

    # ------------------------------------------------------------ what the routes ask of checkpoints

    def _audit(self, user: str, event: str, row: CheckpointRow, **extra: str) -> None:
        self._audit_log.record(
            user, event, {"tinker_path": row.tinker_path, "model_id": row.run_id, "actor": user, **extra}
        )

    def get(self, path: TinkerPath) -> CheckpointRow | None:
        return self._rows.get(path.run_id, path.kind, path.name)

    def of_run(self, run_id: str) -> list[CheckpointRow]:
        """The run's checkpoints, oldest first (the caller has checked who may see the run)."""
        return self._rows.of_run(run_id)

    def of_owner(self, owner: str, limit: int, offset: int) -> tuple[list[CheckpointRow], int]:
        """A page of `owner`'s checkpoints across runs, newest first, and how many they have in all."""
        return self._rows.of_owner(owner, limit, offset)

    def last(self, run_id: str, kind: CheckpointKind | str) -> CheckpointRow | None:
        """The run's newest checkpoint of `kind`, if any."""
        return self._rows.last(run_id, kind)

    async def delete_as(self, user: str, path: TinkerPath) -> None:
        """Delete a checkpoint of a run `user` owns (the caller's check), and audit it. Raises NotFound."""
        if self.get(path) is None:
            raise NotFound(f"no checkpoint {path.uri}")
        await self.delete(path.run_id, path.kind, path.name)
        self._audit_log.record(
            user, "checkpoint_deleted", {"tinker_path": path.uri, "model_id": path.run_id, "actor": user}
        )

    async def readable(self, user: str, path: TinkerPath) -> CheckpointRow:
        """The checkpoint if `user` owns it or it is published; else NotFound.

        On a shared checkpoint root, one that another node wrote is adopted first (its manifest read in a thread).
        """
        row = self.get(path) or await self.adopt_checkpoint(path)
        if row is None or (row.owner != user and not row.public):
            raise NotFound(f"no checkpoint {path.uri}")
        return row

    def owned(self, user: str, path: TinkerPath) -> CheckpointRow:
        """The checkpoint if `user` owns it; a published one of someone else's is still NotFound here."""
        row = self.get(path)
        if row is None or row.owner != user:
            raise NotFound(f"no checkpoint {path.uri}")
        return row

    async def publish(self, user: str, path: TinkerPath, public: bool) -> None:
        """Publish or unpublish `user`'s checkpoint, and audit it. Raises NotFound."""
        row = self.owned(user, path)
        await self.set_public(row.run_id, row.kind, row.name, public)
        self._audit(user, "checkpoint_published" if public else "checkpoint_unpublished", row)

    async def set_ttl(self, user: str, path: TinkerPath, ttl_seconds: int | None) -> None:
        """Set (None: remove) `user`'s checkpoint's TTL from now, and audit it.

        Raises:
            NotFound: no such checkpoint of `user`'s.
            BadRequest: a TTL out of range.
        """
        row = self.owned(user, path)
        check_ttl(ttl_seconds)
        expires_at = None if ttl_seconds is None else utc_now() + timedelta(seconds=ttl_seconds)
        await self.set_expiry(row.run_id, row.kind, row.name, expires_at)
        self._audit(user, "checkpoint_ttl_set", row, ttl_seconds=str(ttl_seconds))

    async def copy(
        self, user: str, source: TinkerPath, *, ttl_seconds: int | None, destination_project_id: str | None
    ) -> str:
        """Copy a checkpoint `user` may read into a new run of `user`'s own; returns the copy's tinker:// path.

        The copy is a run of the caller's own, so it lives and dies apart from
        the source. Its files are copied, committed (staging, fsync, rename)
        and its manifest written in this writer's threads.

        Raises:
            NotFound: no such checkpoint or run that `user` may read.
            BadRequest: a TTL out of range.
        """
        files = self._files
        row = await self.readable(user, source)
        check_ttl(ttl_seconds)
        run = self._runs.get(source.run_id)
        if run is None:
            raise NotFound(f"no training run {source.run_id!r}")
        source_dir = await self._in_thread(files.checkpoint_dir, source.run_id, source.kind, source.name)
        copy_run = f"copy-{new_request_id()[2:18]}"
        self._runs.create(
            copy_run, session_id="", owner=user, base_model=run.base_model, model_dir=run.model_dir,
            lora=run.lora, settings=run.settings, user_metadata={}, optimizer_config=run.optimizer_config,
        )

        def stage() -> tuple[Path, Path, int]:
            final = files.checkpoint_dir(copy_run, source.kind, source.name)
            staging = files.staging_dir()
            return staging, final, copy_files(source_dir, staging)

        staging, final, size = await self._in_thread(stage)
        metadata = dict(row.user_metadata)
        if destination_project_id is not None:
            metadata["project_id"] = destination_project_id
        expires_at = None if ttl_seconds is None else utc_now() + timedelta(seconds=ttl_seconds)
        manifest = self._adoption.manifest_for(
            copy_run, source.kind, source.name, size_bytes=size, user_metadata=metadata, expires_at=expires_at
        )
        await self._in_thread(partial(files.commit_dir, staging, final, manifest=manifest))
        copied = self._rows.add(
            copy_run, source.kind, source.name, user, size, metadata, expires_at, created_at=manifest.created_at
        )
        self._audit(user, "checkpoint_copied", copied, source=row.tinker_path)
        await self._commits.durable()
        return copied.tinker_path

    async def external_files(self, user: str, path: TinkerPath) -> list[str]:
        """The file names of a checkpoint `user` may read, listed in a thread, for signed download URLs; audited.

        Raises:
            NotFound: no such checkpoint that `user` may read.
            ServerError: the directory holds something other than regular files.
        """
        row = await self.readable(user, path)
        files = self._files

        def names() -> list[str]:
            return list_files(files.checkpoint_dir(path.run_id, path.kind, path.name))

        listed = await self._in_thread(names)
        self._audit(user, "checkpoint_read", row, purpose="external_weights_urls")
        return listed

    async def read_file(self, path: TinkerPath, filename: str) -> bytes:
        """One regular file of an existing checkpoint, read in a thread (a signed download: no owner check here).

        Raises:
            NotFound: no such checkpoint or file.
            BadRequest: an unsafe file name.
        """
        if self.get(path) is None:
            raise NotFound(f"no checkpoint {path.uri}")
        files = self._files
        return await self._in_thread(
            lambda: read_file(files.checkpoint_dir(path.run_id, path.kind, path.name), filename)
        )


def readable_checkpoint(store: Store, owner: str, path: str) -> tuple[TinkerPath, Path, RunRow]:
    """(TinkerPath, directory, run row) for a checkpoint `owner` may read: theirs, or public.

    It reads rows only: on a shared checkpoint root, the route first adopts a
    checkpoint another node wrote (a dead node's, say) with
    `CheckpointWriter.adopt_to_read`, whose file reads run in a thread.

    Raises:
        BadRequest: `path` is not a well-formed tinker:// checkpoint path.
        NotFound: no such checkpoint or run, or the checkpoint is another user's and not public.
    """
    tinker_path = parse_tinker_path(path)
    row = store.checkpoints.get(tinker_path.run_id, tinker_path.kind, tinker_path.name)
    if row is None or (row.owner != owner and not row.public):
        raise NotFound(f"no checkpoint {path}")
    run = store.runs.get(tinker_path.run_id)
    if run is None:
        raise NotFound(f"no training run {tinker_path.run_id!r}")
    directory = store.files.checkpoint_dir(tinker_path.run_id, tinker_path.kind, tinker_path.name)
    return tinker_path, directory, run
