"""Manifests and adoption: the rows a checkpoint's manifest stands for, written and read back.

Every checkpoint directory holds a manifest (checkpoint_manifest.py) with its
run's and its own facts. This module builds a new checkpoint's manifest from
the run's row (`manifest_for`) and, on a checkpoint root shared by the
cluster's nodes, turns a checkpoint another node wrote into local rows
(`insert_adopted`, from the manifest that `CheckpointFiles.read_adoptable`
read). Who may read an adopted checkpoint is the caller's check on the row's
owner, exactly as for one written here.

The row halves here touch no file; the file halves live in checkpoint_files.py
and run in the checkpoint actor's worker threads (actors/checkpoints.py). The
sync `adopt_checkpoint`/`adopt_run` join both for callers off the event loop and tests.
"""

from __future__ import annotations

import logging
from datetime import datetime

import msgspec

from openrld.checkpoint_manifest import MANIFEST_FORMAT, CheckpointManifest
from openrld.errors import NotFound
from openrld.ids import CheckpointKind, TinkerPath
from openrld.store.checkpoint_files import CheckpointFiles
from openrld.store.checkpoint_rows import CheckpointRepository
from openrld.store.database import Database, transaction
from openrld.store.rows import CheckpointRow, RunRow
from openrld.store.runs import RunRepository

logger = logging.getLogger(__name__)


class Adoption:
    def __init__(
        self, database: Database, runs: RunRepository, checkpoints: CheckpointRepository, files: CheckpointFiles
    ) -> None:
        self._db = database
        self._runs = runs
        self._checkpoints = checkpoints
        self._files = files

    def manifest_for(
        self, run_id: str, kind: CheckpointKind | str, name: str, *, size_bytes: int | None,
        user_metadata: dict[str, str], expires_at: datetime | None,
    ) -> CheckpointManifest:
        """The manifest of a new checkpoint of `run_id`, from the run's row; created now.

        Raises:
            BadRequest: an unsafe name or unknown kind.
            NotFound: no such run.
        """
        path = TinkerPath.of(run_id, kind, name)
        run = self._runs.get(path.run_id)
        if run is None:
            raise NotFound(f"training run {path.run_id!r} not found")
        return CheckpointManifest(
            format=MANIFEST_FORMAT, run_id=run.run_id, kind=path.kind, name=path.name, owner=run.owner,
            session_id=run.session_id, base_model=run.base_model, model_dir=run.model_dir, lora=run.lora,
            settings=run.settings, optimizer_config=run.optimizer_config,
            run_user_metadata=run.user_metadata, run_created_at=run.created_at,
            user_metadata=msgspec.convert(user_metadata, dict[str, str]), size_bytes=size_bytes,
            created_at=self._db.now(), expires_at=expires_at, public=False,
        )

    def insert_adopted(self, path: TinkerPath, manifest: CheckpointManifest | None) -> CheckpointRow | None:
        """The rows of `path` from the manifest `CheckpointFiles.read_adoptable` returned; touches no file.

        The run's row is inserted too if this node lacks it.

        Returns:
            The new checkpoint row; None when `manifest` is None or this node
            has a run of that id with another owner (logged).
        """
        if manifest is None:
            return None
        with transaction(self._db.conn):
            if not self._has_run_of(manifest, f"tinker_path={path.uri}", "its manifest's"):
                return None
            self._checkpoints.insert_from_manifest(manifest)
        logger.info("checkpoint_root=%s tinker_path=%s owner=%s: adopted", self._files.root, path.uri, manifest.owner)
        return self._checkpoints.get(path.run_id, path.kind, path.name)

    def insert_job_run(self, run: CheckpointManifest) -> RunRow | None:
        """The row of a job's run as its auto-save's manifest carries it (`AutosaveManifest.run`), inserted
        when this node lacks it: a survivor adopting the job (cluster/adoption.py). Touches no file.

        Returns:
            The run's row; None when this node has a run of that id with another owner (logged).
        """
        with transaction(self._db.conn):
            if not self._has_run_of(run, f"model_id={run.run_id}", "its auto-save's"):
                return None
        return self._runs.get(run.run_id)

    def _has_run_of(self, manifest: CheckpointManifest, what: str, whose: str) -> bool:
        """Whether this node has `manifest`'s run under its owner, inserting the run's row if it has none;
        False (logged: `what` is not adopted, `whose` owner differs) when a run of that id here has
        another owner. In the caller's transaction."""
        row = self._runs.get(manifest.run_id)
        if row is None:
            self._runs.insert_from_manifest(manifest)
        elif row.owner != manifest.owner:
            logger.warning(
                "checkpoint_root=%s %s: not adopted: %s owner differs from run %s's here",
                self._files.root, what, whose, manifest.run_id,
            )
            return False
        return True

    def adopt_checkpoint(self, path: TinkerPath) -> CheckpointRow | None:
        """On a shared root, the rows of a checkpoint another node wrote, inserted from its manifest.

        Called when `path` has no row here. Both halves in the caller's thread.

        Returns:
            The new checkpoint row; None when the root is not shared, there is
            no such directory or manifest, the manifest is refused (logged: it
            is malformed or names another checkpoint), or this node has a run
            of that id with another owner.

        Raises:
            ServerError: the directory resolves outside the root (a planted symlink).
        """
        return self.insert_adopted(path, self._files.read_adoptable(path))

    def adopt_run(self, run_id: str) -> RunRow | None:
        """On a shared root, a run's row with each of its checkpoints under the root that this node lacks.

        Each checkpoint is adopted as `adopt_checkpoint` does, manifest checks included.

        Returns:
            The run's row; None when the root is not shared or nothing of the run could be adopted.

        Raises:
            BadRequest: an unsafe run id.
            ServerError: the run's directory resolves outside the root.
        """
        if not self._files.is_shared:
            return None
        for path in self._files.run_checkpoint_paths(run_id):
            if self._checkpoints.get(path.run_id, path.kind, path.name) is None:
                self.adopt_checkpoint(path)
        return self._runs.get(run_id)
