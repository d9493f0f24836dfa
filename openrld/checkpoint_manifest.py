"""The manifest every checkpoint directory carries, so that a node which never saw the run can adopt it.

A checkpoint's rows (its run, its owner, its metadata) live in the SQLite
database of the node that wrote it. On a checkpoint root shared by the
cluster's nodes (NFS, a GCS FUSE mount), another node finds only the
directory. `checkpoint.json` inside it holds what that node needs to insert
the rows itself: the owner, the run (base model, LoRA spec, settings,
optimizer config, user metadata) and the checkpoint (kind, name, size,
metadata, times). It is written into the staging directory before the commit,
so it appears with the tensors, atomically, or not at all.

This module owns the format (a versioned msgspec Struct), writing it, and
reading it with every check a file from a shared filesystem deserves: a
regular file (never followed through a symlink), of bounded size, decoded
strictly, and naming exactly the run, kind and name of the directory it sits
in. It never touches SQLite and never decides who may read a checkpoint.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime
from pathlib import Path

import msgspec

from openrld.errors import BadRequest
from openrld.ids import CheckpointKind, TinkerPath, validate_name

MANIFEST_NAME = "checkpoint.json"
MANIFEST_FORMAT = 1  # bumped on any change an older reader would misread
# A manifest is a few hundred bytes of metadata; anything far larger is not one.
MAX_MANIFEST_BYTES = 1 << 20

JsonScalar = str | int | float | bool | None


class ManifestError(Exception):
    """A checkpoint directory's manifest is unreadable, malformed, or names another checkpoint."""


class CheckpointManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a node needs to adopt a checkpoint: its run's row and its own, as the writer had them."""

    format: int
    run_id: str
    kind: CheckpointKind
    name: str
    owner: str
    session_id: str
    base_model: str
    model_dir: str  # the writer's path to the base model; informational, each node resolves base_model itself
    lora: dict[str, JsonScalar] | None  # LoraConfig fields; None for full fine-tuning
    settings: dict[str, JsonScalar]  # settings.settings_to_dict form (fine_tuning_type among them)
    optimizer_config: dict[str, JsonScalar]
    run_user_metadata: dict[str, str]
    run_created_at: datetime
    user_metadata: dict[str, str]  # the checkpoint's
    size_bytes: int | None
    created_at: datetime
    expires_at: datetime | None
    public: bool

    @property
    def path(self) -> TinkerPath:
        return TinkerPath(run_id=self.run_id, kind=self.kind, name=self.name)


_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(CheckpointManifest).decode


def write_manifest(directory: Path, manifest: CheckpointManifest) -> None:
    """Write (or overwrite) `directory/checkpoint.json`; the caller's commit fsyncs it."""
    (directory / MANIFEST_NAME).write_bytes(_encode(manifest))


def read_manifest(directory: Path, expected: TinkerPath) -> CheckpointManifest | None:
    """The manifest of the checkpoint directory `directory`, which should hold `expected`.

    Returns:
        The manifest, or None when there is no such directory or it holds no manifest.

    Raises:
        ManifestError: the manifest is a symlink or not a regular file, is too
            large, does not decode, is of another format, has a naive time or an
            unsafe id, or names a run, kind or name other than `expected`.
    """
    try:
        fd = os.open(directory / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # ELOOP: a symlink where the manifest should be
        raise ManifestError(f"{MANIFEST_NAME} cannot be opened safely: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ManifestError(f"{MANIFEST_NAME} is not a regular file")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{MANIFEST_NAME} is {info.st_size} bytes; at most {MAX_MANIFEST_BYTES}")
        raw = file.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = _decode(raw)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{MANIFEST_NAME} is not a valid manifest: {exc}") from None
    _check(manifest, expected)
    return manifest


def _check(manifest: CheckpointManifest, expected: TinkerPath) -> None:
    if manifest.format != MANIFEST_FORMAT:
        raise ManifestError(f"{MANIFEST_NAME} has format {manifest.format}; this openrld reads {MANIFEST_FORMAT}")
    if manifest.path != expected:
        raise ManifestError(f"{MANIFEST_NAME} names {manifest.path.uri}, but sits in the directory of {expected.uri}")
    if not manifest.owner:
        raise ManifestError(f"{MANIFEST_NAME} has an empty owner")
    try:
        validate_name(manifest.run_id, "run id")
    except BadRequest as exc:
        raise ManifestError(f"{MANIFEST_NAME}: {exc.detail}") from None
    for what, when in (
        ("run_created_at", manifest.run_created_at), ("created_at", manifest.created_at),
        ("expires_at", manifest.expires_at),
    ):
        if when is not None and when.tzinfo is None:
            raise ManifestError(f"{MANIFEST_NAME}: {what} has no time zone ({when.isoformat()})")
