"""Checkpoint directories on disk: layout, staging, atomic commit, fsync, recovery and path containment.

It owns the checkpoint root and this node's staging:

    <data_dir>/checkpoints/<run_id>/<kind>/<name>/   one directory per checkpoint
    <data_dir>/tmp/                                  staging for checkpoint writes; emptied at open

With a checkpoint root shared by the cluster's nodes (NFS, a GCS FUSE mount),
the checkpoint directories live there instead, as <root>/<run_id>/<kind>/<name>/,
and staging moves to <root>/.staging/<node_id>/ so that the final rename stays
on one filesystem. <node_id> is random, made once per data dir and kept in
<data_dir>/node_id, so recovery at open empties this node's staging and
finishes this node's interrupted replaces (moved aside as
"<name>#old-<node_id>"), never another live node's.

It guarantees:
- A checkpoint directory appears under its final name only whole (written in
  staging, fsynced, renamed into place, parent fsynced); `recover` removes
  whatever staging a kill left behind and finishes or undoes an interrupted replace.
- No path it builds leaves the checkpoint root: every component passes
  `ids.validate_name`, and the resolved path is checked, symlinks included.

Every call here may block on a slow disk: the daemon makes them in the worker
threads of the actor that owns checkpoints (actors/checkpoints.py), except
`checkpoint_dir` and `staging_dir`, which only resolve a path or make one
directory. It touches no row.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

import msgspec

from openrld.checkpoint_manifest import (
    MANIFEST_NAME,
    CheckpointManifest,
    ManifestError,
    read_manifest,
    write_manifest,
)
from openrld.errors import BadRequest, Conflict, NotFound, ServerError
from openrld.ids import CheckpointKind, TinkerPath, validate_name

logger = logging.getLogger(__name__)

# A replace moves the old directory aside under this suffix. '#' can never be
# part of a checkpoint name (ids.validate_name), so it never names a real one.
_REPLACED_SUFFIX = "#old"

# On a shared checkpoint root: the directory holding each node's staging. It
# starts with '.', which no run id may (ids.validate_name), so it is never a run.
SHARED_STAGING_DIR = ".staging"
NODE_ID_FILE = "node_id"  # in the data dir: this node's name for its staging on a shared root
MAX_COPY_FILES = 64  # a checkpoint holds a handful of files; more means something is wrong


class CheckpointLayout(msgspec.Struct, frozen=True):
    """Where a store keeps checkpoints and stages them, fixed at open."""

    root: Path  # the checkpoint root as configured
    resolved_root: Path  # what every checkpoint path must resolve under
    staging: Path  # this node's own staging; on the root's filesystem
    replaced_suffix: str  # the name a replace moves the old directory aside under
    is_shared: bool


class CheckpointFiles:
    """The checkpoint directories of one data dir. Use `CheckpointFiles.open`."""

    def __init__(self, data_dir: Path, layout: CheckpointLayout) -> None:
        self._data_dir = data_dir
        self._checkpoints = layout.root
        self._checkpoints_resolved = layout.resolved_root
        self._tmp = layout.staging
        self._replaced_suffix = layout.replaced_suffix
        self.is_shared = layout.is_shared

    @classmethod
    def open(cls, data_dir: Path, checkpoint_root: Path | None) -> CheckpointFiles:
        """The layout for `data_dir` (alone, or on a shared root), recovered from a crash.

        Staging is emptied, the root made if it is the data dir's own, and
        interrupted replaces are finished or undone.

        Raises:
            ServerError: `checkpoint_root` is not an existing directory, or the node id file is malformed.
        """
        layout = _checkpoint_layout(data_dir, checkpoint_root)
        _remove_staging(layout.staging)
        layout.root.mkdir(mode=0o700, exist_ok=True)
        _recover_replaces(layout.root, layout.replaced_suffix)
        return cls(data_dir, layout)

    # --- paths --------------------------------------------------------------------------------------

    def checkpoint_dir(self, run_id: str, kind: CheckpointKind | str, name: str) -> Path:
        """<checkpoint root>/<run_id>/<kind>/<name>; it need not exist yet.

        The root is <data_dir>/checkpoints, or the shared checkpoint root.

        Raises:
            BadRequest: an unsafe run id or name ('..', '/', an absolute path...), or an unknown kind.
            ServerError: the path resolves outside the checkpoint root (a symlink planted in it).
        """
        path = TinkerPath.of(run_id, kind, name)
        directory = self._checkpoints / path.run_id / path.kind.value / path.name
        self._require_under(directory)
        return directory

    @property
    def checkpoint_files(self) -> tuple[Path, Path]:
        """(the checkpoint root, this node's staging under which checkpoints are written): what a
        worker outside this process must see, at the same paths, to read and write checkpoints."""
        return self._checkpoints, self._tmp

    def staging_dir(self) -> Path:
        """A fresh, empty directory in this node's staging (tmp/, or its own under a shared root)
        to write a checkpoint into before `commit_dir`."""
        staging = self._tmp / f"staging-{secrets.token_hex(8)}"
        staging.mkdir(mode=0o700)
        return staging

    def _uri_of(self, directory: Path) -> str:
        run_id, kind, name = directory.relative_to(self._checkpoints).parts
        return f"tinker://{run_id}/{kind}/{name}"

    def _require_under(self, path: Path) -> None:
        # The expected root was fixed at open (see _checkpoint_layout), so a
        # symlink planted later, at any level, is refused.
        expected_root = self._checkpoints_resolved
        resolved = path.resolve()
        if resolved != expected_root and not resolved.is_relative_to(expected_root):
            logger.error("data_dir=%s: path %s resolves to %s, outside %s", self._data_dir, path, resolved, expected_root)
            raise ServerError(f"{path} resolves outside {expected_root}; refusing to use it")

    # --- writing, replacing, removing ----------------------------------------------------------------

    def commit_dir(
        self, staging: Path, final: Path, *, replace: bool = False, manifest: CheckpointManifest | None = None
    ) -> None:
        """Make a staging directory the checkpoint directory `final`, durably and whole.

        `manifest`, when given, is written into `staging` first, so that it
        lands with the files. Every file and directory in `staging` is
        fsynced, then it is renamed to `final` and the parents are fsynced.
        With `replace`, an existing `final` is first moved aside to
        "<name>#old" ("<name>#old-<node_id>" on a shared root) and removed
        after; if the daemon dies in between, the next open puts back
        whichever is whole.

        Args:
            staging: a directory from `staging_dir`.
            final: a path from `checkpoint_dir`.
            replace: whether an existing checkpoint at `final` is replaced.
            manifest: the checkpoint's manifest (`Adoption.manifest_for`); every
                checkpoint of a run carries one, so that another node can adopt it.

        Raises:
            Conflict: `final` exists and `replace` is false.
            ServerError: `staging` is not a staging dir, holds something other
                than files and directories, `final` escapes the checkpoint root,
                or `manifest` names another checkpoint than `final`.
        """
        if staging.parent != self._tmp or not staging.name.startswith("staging-") or not staging.is_dir():
            raise ServerError(f"{staging} is not a staging dir of this store")
        self._require_under(final)
        if manifest is not None:
            if self.checkpoint_dir(manifest.run_id, manifest.kind, manifest.name) != final:
                raise ServerError(f"the manifest of {manifest.path.uri} does not belong in {final}")
            write_manifest(staging, manifest)
        _fsync_tree(staging)
        final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.path.lexists(final):
            if not replace:
                raise Conflict(f"checkpoint {self._uri_of(final)} already exists")
            aside = final.with_name(final.name + self._replaced_suffix)
            if os.path.lexists(aside):
                shutil.rmtree(aside)
            os.rename(final, aside)
            os.rename(staging, final)
            fsync_dir(final.parent)
            shutil.rmtree(aside)
        else:
            os.rename(staging, final)
        # The rename is durable once the parent is; parents made just now need theirs too.
        for directory in (final.parent, final.parent.parent, final.parent.parent.parent):
            fsync_dir(directory)

    def remove(self, path: TinkerPath) -> None:
        """Remove a checkpoint's directory, once its row is gone.

        The directory is renamed into staging before it is removed, so a
        half-deleted one is never visible.
        """
        directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
        if directory.exists():
            doomed = self._tmp / f"deleted-{secrets.token_hex(8)}"
            try:
                os.rename(directory, doomed)
            except FileNotFoundError:
                return  # on a shared root, another node that had its row (an expiry sweep) removed it first
            shutil.rmtree(doomed)

    # --- manifests ----------------------------------------------------------------------------------

    def update_manifest(self, path: TinkerPath, **changes: object) -> None:
        """Rewrite a checkpoint's manifest with `changes`, so that a node adopting it later sees them.

        The new manifest is written and fsynced in staging, then renamed over
        the old one: a reader sees one or the other, whole. A checkpoint with no
        valid manifest (written before manifests), or deleted meanwhile, is left
        as it is.
        """
        try:
            directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
            manifest = read_manifest(directory, path)
        except (ManifestError, ServerError) as exc:  # the row changed; a planted symlink is never written through
            logger.warning("tinker_path=%s: manifest not updated: %s", path.uri, exc)
            return
        if manifest is None:
            return
        staging = self.staging_dir()
        try:
            write_manifest(staging, msgspec.structs.replace(manifest, **changes))
            _fsync_tree(staging)
            os.replace(staging / MANIFEST_NAME, directory / MANIFEST_NAME)
            fsync_dir(directory)
        except FileNotFoundError as exc:  # a delete moved the directory away after the read
            logger.warning("tinker_path=%s: manifest not updated: %s", path.uri, exc)
            shutil.rmtree(staging, ignore_errors=True)
            return
        staging.rmdir()

    def read_adoptable(self, path: TinkerPath) -> CheckpointManifest | None:
        """On a shared root, the manifest to adopt `path` from (adoption.py), or None.

        None when the root is not shared, there is no such directory or
        manifest, or the manifest is refused (logged: malformed, or naming another checkpoint).

        Raises:
            ServerError: the directory resolves outside the root (a planted symlink).
        """
        if not self.is_shared:
            return None  # alone, a directory without a row is a checkpoint being deleted or never recorded
        directory = self.checkpoint_dir(path.run_id, path.kind, path.name)
        try:
            return read_manifest(directory, path)
        except ManifestError as exc:
            logger.warning("checkpoint_root=%s tinker_path=%s: not adopted: %s", self._checkpoints, path.uri, exc)
            return None

    def run_checkpoint_paths(self, run_id: str) -> list[TinkerPath]:
        """The checkpoints under a run's directory on a shared root ([] when not shared).

        Directory entries that are not checkpoint names (a replace's "#old" aside) are skipped.

        Raises:
            BadRequest: an unsafe run id.
            ServerError: the run's directory resolves outside the root.
        """
        if not self.is_shared:
            return []
        run_dir = self._checkpoints / validate_name(run_id, "run id")
        self._require_under(run_dir)
        paths: list[TinkerPath] = []
        for kind in CheckpointKind:
            try:
                names = sorted(os.listdir(run_dir / kind.value))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                try:
                    paths.append(TinkerPath.of(run_id, kind, name))
                except BadRequest:
                    continue
        return paths

    @property
    def root(self) -> Path:
        return self._checkpoints


# --- reading a checkpoint's files (downloads, copies) ---------------------------------------------


def list_files(directory: Path) -> list[str]:
    """The regular files directly in a checkpoint directory, sorted, less its manifest (openrld's, not the model's).

    Raises:
        ServerError: the directory holds a symlink, a device or a subdirectory;
            a checkpoint never does, so someone planted it.
    """
    names: list[str] = []
    for entry in os.scandir(directory):
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise ServerError(f"checkpoint dir {directory.name!r} holds {entry.name!r}, which is not a regular file")
        if entry.name != MANIFEST_NAME:
            names.append(entry.name)
    return sorted(names)


def read_file(directory: Path, filename: str) -> bytes:
    """One file's bytes, refusing symlinks at the last step too (O_NOFOLLOW).

    Raises:
        BadRequest: an unsafe file name.
        NotFound: no such regular file in the directory.
    """
    validate_name(filename, "file name")
    try:
        fd = os.open(directory / filename, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFound(f"no file {filename!r} in this checkpoint") from None
    except OSError as exc:  # ELOOP: the name is a symlink
        raise NotFound(f"no file {filename!r} in this checkpoint ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise NotFound(f"no file {filename!r} in this checkpoint (not a regular file)")
        return file.read()


def copy_files(source: Path, staging: Path) -> int:
    """Copy a checkpoint directory's files (`list_files`) into a staging dir; returns the bytes copied."""
    files = list_files(source)
    if len(files) > MAX_COPY_FILES:
        raise ServerError(f"checkpoint dir {source.name!r} holds {len(files)} files; at most {MAX_COPY_FILES}")
    size = 0
    for name in files:
        data = read_file(source, name)
        with open(staging / name, "xb") as out:
            out.write(data)
        size += len(data)
    return size


# --- opening and recovery -------------------------------------------------------------------------


def _checkpoint_layout(data_dir: Path, checkpoint_root: Path | None) -> CheckpointLayout:
    """The layout for `data_dir`, alone or on a shared root, or ServerError if the root is not a directory."""
    if checkpoint_root is None:
        # The resolved data dir, then "checkpoints" unresolved: a symlinked checkpoints/ is refused.
        return CheckpointLayout(
            root=data_dir / "checkpoints", resolved_root=data_dir.resolve() / "checkpoints",
            staging=data_dir / "tmp", replaced_suffix=_REPLACED_SUFFIX, is_shared=False,
        )
    root = checkpoint_root.expanduser().absolute()
    # Never created here: a missing root is an unmounted share, and checkpoints
    # written to the local disk in its place would be invisible to every other node.
    if not root.is_dir():
        raise ServerError(f"checkpoint_root {root} is not an existing directory (is the shared filesystem mounted?)")
    node_id = _node_id(data_dir)
    return CheckpointLayout(
        root=root, resolved_root=root.resolve(), staging=root / SHARED_STAGING_DIR / node_id,
        replaced_suffix=f"{_REPLACED_SUFFIX}-{node_id}", is_shared=True,
    )


def _node_id(data_dir: Path) -> str:
    """This data dir's node id (16 hex characters), made on first use and kept in <data_dir>/node_id.

    It names this node's staging on a shared root; the data dir's lock makes
    it one node's at a time, and it outlives restarts so recovery finds its own leftovers.
    """
    path = data_dir / NODE_ID_FILE
    try:
        node_id = path.read_text().strip()
    except FileNotFoundError:
        node_id = secrets.token_hex(8)
        partial = data_dir / f"{NODE_ID_FILE}.partial"
        with partial.open("w") as file:
            file.write(node_id + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.rename(partial, path)
        fsync_dir(data_dir)
        return node_id
    if len(node_id) != 16 or any(c not in "0123456789abcdef" for c in node_id):
        raise ServerError(f"{path} holds {node_id!r}; expected 16 lowercase hex characters (delete it to make a new one)")
    return node_id


def _remove_staging(tmp: Path) -> None:
    """Empty this node's staging: whatever is there was being written or deleted when the daemon died."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700, parents=True)


def _recover_replaces(checkpoints: Path, suffix: str) -> None:
    """Finish or undo replaces a crash interrupted (see `CheckpointFiles.commit_dir`).

    "<name><suffix>" next to "<name>": the new one was in place; drop the old.
    "<name><suffix>" alone: the crash came between the two renames; put it back.
    On a shared root the suffix names this node, so another node's replace in
    progress is never touched.
    """
    for aside in checkpoints.glob(f"*/*/*{suffix}"):
        final = aside.with_name(aside.name[: -len(suffix)])
        if os.path.lexists(final):
            shutil.rmtree(aside)
        else:
            os.rename(aside, final)
            fsync_dir(final.parent)
            logger.warning("restored checkpoint dir %s after an interrupted replace", final)


# --- fsync ----------------------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file and directory under `top`, refusing anything else.

    A symlink or device inside a checkpoint would be followed by whoever
    loads it later, so only plain files and directories are accepted.
    """
    for dirpath, dirnames, filenames in os.walk(top, topdown=False):
        for entry in (*filenames, *dirnames):
            mode = os.lstat(os.path.join(dirpath, entry)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ServerError(f"{os.path.join(dirpath, entry)}: a checkpoint holds only files and directories")
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
