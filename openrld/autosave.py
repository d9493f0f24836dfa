"""Auto-saves on a shared checkpoint root: their layout, their manifest, committing, pruning and reading.

With a checkpoint root shared by the cluster's nodes, the training state of each
job that sets `openrl.autosave_steps` (LoRA: adapter and optimizer state; full
fine-tuning: weights and optimizer state) is saved at that interval, so that a survivor can adopt the job when its node dies. An auto-save
is the job's, never the user's: it lives apart from the checkpoints, where no
listing and no adoption of checkpoints looks,

    <root>/.autosave/<model_id>/step-<step:09d>/   the files of `save_state`, and autosave.json

('.autosave' starts with '.', which no run id may, so it is never a run's
directory). A directory is written in this node's staging (`write_snapshot`
writes a state the engine copied to host memory, off the engine's thread; an
engine that copies none wrote it with `save_state`) and renamed into place
whole (`CheckpointFiles.commit_dir`). Its `autosave.json` lists every
file beside it with its size, and the reader counts a directory only when its
files match that list, so a copy cut short on a filesystem whose directory
rename is not atomic (GCS FUSE copies, then deletes) is never taken for one.

After a commit, the job's older auto-saves are removed: what stays is the
newest complete one, plus the one being written (in staging, until its
rename); once the job has ended, all of them (`remove_job`). `latest_autosave`
is what an adopter calls.

It never touches SQLite, never imports trio or torch, and never decides when
to save (actors/autosaves.py and the trainer actor do).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
from datetime import datetime
from pathlib import Path
from typing import Protocol

import msgspec

from openrld.checkpoint_manifest import CheckpointManifest
from openrld.engine_types import StateSnapshot
from openrld.errors import ServerError
from openrld.ids import validate_name
from openrld.store.rows import JsonScalar

logger = logging.getLogger(__name__)

AUTOSAVE_DIR = ".autosave"  # under the checkpoint root; '.' keeps it out of every run listing
AUTOSAVE_MANIFEST = "autosave.json"
AUTOSAVE_FORMAT = 1  # bumped on any change an older reader would misread
MAX_AUTOSAVE_MANIFEST_BYTES = 1 << 20  # a few hundred bytes of metadata; anything far larger is not one
MAX_SAMPLER_NAMES = 8  # the newest published sampler names an auto-save records, of each kind
_STEP_DIR = re.compile(r"step-([0-9]{9})")


class CheckpointDirs(Protocol):
    """What committing and pruning need of the node's checkpoint files (`store.CheckpointFiles`)."""

    @property
    def root(self) -> Path: ...
    def staging_dir(self) -> Path: ...
    def commit_dir(self, staging: Path, final: Path, *, replace: bool = False) -> None: ...


class AutosaveManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What an adopter needs to take a job over from its auto-save."""

    format: int
    model_id: str  # the job's model id (its run id)
    step: int  # the job's successful optim_steps on its trainer, this one included
    seq_id: int  # the seq_id of the last op applied to this state (the optim_step): replay starts after it
    # The run's row as a checkpoint manifest carries it (`Adoption.manifest_for`): owner, session,
    # base model, LoRA config (None: full fine-tuning), settings, optimizer config. An adopter that
    # lacks the run inserts it with `RunRepository.insert_from_manifest`. Its kind and name
    # (weights, the step directory's name) name no checkpoint: never insert a checkpoint row from it.
    run: CheckpointManifest
    # The names the job last published sampler weights under, oldest first (at most
    # MAX_SAMPLER_NAMES each): tinker:// paths of named saves (files on the root), and
    # sampling session ids of unnamed ones (in the dead node's memory only).
    sampler_paths: list[str] = []
    sampling_sessions: list[str] = []
    files: dict[str, int] = {}  # every file beside the manifest -> its size in bytes; filled at commit
    created_at: datetime

    @property
    def base_model(self) -> str:
        return self.run.base_model

    @property
    def lora(self) -> dict[str, JsonScalar] | None:
        """The job's LoRA config (LoraSpec's fields); None for full fine-tuning."""
        return self.run.lora


class Autosave(msgspec.Struct, frozen=True):
    """A complete auto-save: its directory (a `load_state` source) and its manifest."""

    directory: Path
    manifest: AutosaveManifest


_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(AutosaveManifest).decode


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def job_dir(root: Path, model_id: str) -> Path:
    """<root>/.autosave/<model_id>; BadRequest for an unsafe model id."""
    return root / AUTOSAVE_DIR / validate_name(model_id, "model id")


def _steps(directory: Path) -> list[tuple[int, Path]]:
    """The step directories under a job's auto-save directory, newest first; [] when there is none."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), directory / name) for name in names if (m := _STEP_DIR.fullmatch(name))]
    return sorted(found, reverse=True)


# --- writing (the trainer's autosave threads) -------------------------------------------------------


def commit_autosave(files: CheckpointDirs, staging: Path, manifest: AutosaveManifest) -> Path:
    """Make `staging` (a `files.staging_dir()` that `save_state` wrote) the job's auto-save at
    `manifest.step`, then remove the job's older ones; returns its directory. Blocks: a worker thread.

    The manifest lists the files and their sizes as they are in staging; the directory is
    fsynced and renamed into place by `CheckpointFiles.commit_dir` (a kill before the rename
    leaves staging, which the next open removes). An auto-save of that step already in
    place (a step recomputed after a failure) is replaced.

    Raises:
        ServerError: `staging` is not a staging dir, or holds other than regular files.
        BadRequest: an unsafe model id.
    """
    sizes = {entry.name: entry.stat(follow_symlinks=False).st_size for entry in os.scandir(staging)}
    (staging / AUTOSAVE_MANIFEST).write_bytes(_encode(msgspec.structs.replace(manifest, files=sizes)))
    final = job_dir(files.root, manifest.model_id) / step_dir_name(manifest.step)
    files.commit_dir(staging, final, replace=True)
    prune(files, manifest.model_id, keep=manifest.step)
    return final


def commit_snapshot(files: CheckpointDirs, snapshot: StateSnapshot, manifest: AutosaveManifest) -> Path:
    """Write `snapshot` (`TrainerEngine.snapshot_state`) into a fresh staging dir, then commit it
    as `commit_autosave` does (which fsyncs what was written); returns its directory. The staging
    is removed if either fails. Blocks: a worker thread, off the engine's.

    Raises:
        ServerError: a file name that is not a plain name of its own (a worker's engine sent it).
    """
    staging = files.staging_dir()
    try:
        write_snapshot(snapshot, staging)
        return commit_autosave(files, staging, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_snapshot(snapshot: StateSnapshot, directory: Path) -> int:
    """Write each file of `snapshot` into the existing, empty `directory`: the files `save_state`
    writes, byte for byte. Returns the bytes written.

    Nothing is fsynced here: `commit_autosave` (`CheckpointFiles.commit_dir`) fsyncs every file
    of the staging dir, and the dir, before the rename that makes it an auto-save, so fsyncing
    here too would only flush them twice (on ext4 each fsync is a journal commit, or a disk
    cache flush when there is nothing to commit).

    Raises:
        ServerError: a file name with a '/', '.' or '..', the manifest's, or one named twice.
    """
    names = [file.name for file in snapshot.files]
    for name in names:
        if "/" in name or name in (".", "..", "", AUTOSAVE_MANIFEST) or names.count(name) > 1:
            raise ServerError(f"an engine's state snapshot names the file {name!r}: not a file of its own")
    for file in snapshot.files:
        with open(directory / file.name, "xb") as out:
            out.write(file.head)
            if file.body is not None:
                out.write(file.body.data)  # the host copy's bytes, as they are
    return snapshot.nbytes


def prune(files: CheckpointDirs, model_id: str, *, keep: int) -> list[int]:
    """Remove the job's auto-saves of steps before `keep`; returns the steps removed.

    Each is renamed into this node's staging first, so no half-removed one is ever seen
    under its name (a kill there leaves it in staging, which the next open empties).
    """
    removed = []
    for step, directory in _steps(job_dir(files.root, model_id)):
        if step >= keep:
            continue
        doomed = files.staging_dir()
        with contextlib.suppress(FileNotFoundError):  # another node's prune got there first
            os.rename(directory, doomed / directory.name)
        shutil.rmtree(doomed)
        removed.append(step)
    return removed


def job_ids(root: Path) -> list[str]:
    """The names of the job directories under the root's auto-saves, sorted; [] when there is none."""
    try:
        return sorted(os.listdir(root / AUTOSAVE_DIR))
    except FileNotFoundError:
        return []


def remove_job(files: CheckpointDirs, model_id: str) -> bool:
    """Remove every auto-save of job `model_id` (it has ended); False when it had none. Renamed into
    this node's staging first, as `prune` does, so no half-removed job is seen under its name.

    Raises:
        BadRequest: an unsafe model id.
    """
    directory = job_dir(files.root, model_id)
    doomed = files.staging_dir()
    try:
        os.rename(directory, doomed / directory.name)
    except FileNotFoundError:  # none, or another node's removal got there first
        return False
    finally:
        shutil.rmtree(doomed)
    return True


# --- reading (what an adopter calls) ------------------------------------------------------------------


def latest_autosave(root: Path, model_id: str) -> Autosave | None:
    """The newest complete auto-save of job `model_id` under the checkpoint root `root`, or None.

    A step directory counts only when its manifest is a regular file that decodes,
    is of this format, names this job and this step, and lists exactly the files
    beside it, each a regular file of the listed size. Others (a write cut short on
    a filesystem whose rename is not atomic, a planted symlink) are skipped, logged.

    Raises:
        BadRequest: an unsafe model id.
    """
    directory = job_dir(root, model_id)
    resolved_root = root.resolve()
    for step, step_dir in _steps(directory):
        resolved = step_dir.resolve()
        if not resolved.is_relative_to(resolved_root):
            logger.warning("checkpoint_root=%s model_id=%s: %s resolves outside the root; skipped", root, model_id, step_dir)
            continue
        try:
            return Autosave(step_dir, _read_complete(step_dir, model_id, step))
        except _Incomplete as why:
            logger.warning("checkpoint_root=%s model_id=%s step=%d: not a complete auto-save: %s", root, model_id, step, why)
    return None


class _Incomplete(Exception):
    """A step directory that is not a complete auto-save, and why."""


def _read_complete(step_dir: Path, model_id: str, step: int) -> AutosaveManifest:
    manifest = _read_manifest(step_dir)
    if manifest.format != AUTOSAVE_FORMAT:
        raise _Incomplete(f"format {manifest.format}; this openrld reads {AUTOSAVE_FORMAT}")
    if (manifest.model_id, manifest.step) != (model_id, step):
        raise _Incomplete(f"its manifest names {manifest.model_id} step {manifest.step}")
    on_disk = {}
    try:
        for entry in os.scandir(step_dir):
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                raise _Incomplete(f"{entry.name} is not a regular file")
            on_disk[entry.name] = info.st_size
    except FileNotFoundError:  # the home's next commit pruned it between the manifest and the listing
        raise _Incomplete("it went while it was being read") from None
    if on_disk.pop(AUTOSAVE_MANIFEST, None) is None:
        raise _Incomplete(f"its {AUTOSAVE_MANIFEST} went while it was being read")
    if on_disk != manifest.files:
        raise _Incomplete(f"it holds {sorted(on_disk.items())}; its manifest lists {sorted(manifest.files.items())}")
    return manifest


def _read_manifest(step_dir: Path) -> AutosaveManifest:
    try:
        fd = os.open(step_dir / AUTOSAVE_MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise _Incomplete(f"no {AUTOSAVE_MANIFEST}") from None
    except OSError as exc:  # ELOOP: a symlink where the manifest should be
        raise _Incomplete(f"{AUTOSAVE_MANIFEST} cannot be opened safely: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise _Incomplete(f"{AUTOSAVE_MANIFEST} is not a regular file")
        raw = file.read(MAX_AUTOSAVE_MANIFEST_BYTES + 1)
    if len(raw) > MAX_AUTOSAVE_MANIFEST_BYTES:
        raise _Incomplete(f"{AUTOSAVE_MANIFEST} is over {MAX_AUTOSAVE_MANIFEST_BYTES} bytes")
    try:
        return _decode(raw)
    except msgspec.DecodeError as exc:
        raise _Incomplete(f"{AUTOSAVE_MANIFEST} does not decode: {exc}") from None

