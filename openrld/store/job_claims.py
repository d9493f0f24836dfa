"""Claims on a job's home, on a shared checkpoint root: who took a job over from a dead node, durably.

When a job's home node dies, a survivor that adopts it from its auto-save
(`openrld/autosave.py`) first claims it here. The claims of a job form a chain
beside its auto-saves,

    <root>/.autosave/<model_id>/claims/<generation:09d>.json

each naming the node that took the job over (`adopter`) and the node it took it
from (`previous_home`). Claim 1 takes the job from the node that created it;
claim g+1 may only be made from the adopter of claim g. A claim is made by
writing its file under a temporary name and hard-linking it to its generation's
name, which fails if that name exists: of two survivors that both decide to
adopt the same job from the same dead node (a split view of the cluster), one
links first and the other finds the name taken, so a job never has two
adopters, and a claim is never seen half written. A node that was declared
dead but lives on (a partition) finds a newer claim naming another adopter
(`is_superseded`) and stops serving the job.

The filesystem must make a hard link atomic, as POSIX filesystems and NFS do;
where links are not supported at all (some FUSE object-store mounts), an
exclusive create (O_CREAT|O_EXCL) is used instead, which gives the same
exclusivity where the filesystem honours it.

It touches no SQLite, imports no trio or torch, and decides nothing: the
adoption watcher (`cluster/adoption.py`) decides who tries to claim.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path

import msgspec

from openrld.autosave import job_dir
from openrld.store.checkpoint_files import fsync_dir

logger = logging.getLogger(__name__)

CLAIMS_DIR = "claims"
CLAIM_FORMAT = 1
MAX_CLAIM_BYTES = 64 * 1024
_CLAIM_NAME = re.compile(r"([0-9]{9})\.json")
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """One node's claim to be a job's home from now on."""

    format: int
    model_id: str
    generation: int  # 1 for the first adoption; each later one adds 1
    adopter: str  # the node that took the job over
    previous_home: str  # the node it took it from (dead, or gone)
    step: int  # the auto-save's step the adopter resumes from
    seq_id: int  # that auto-save's seq_id: replay starts after it
    claimed_at: float  # unix time

    @property
    def detail(self) -> str:
        return f"adopted from node {self.previous_home} at step {self.step}"


_decode = msgspec.json.Decoder(Claim).decode


def claims_dir(root: Path, model_id: str) -> Path:
    """<root>/.autosave/<model_id>/claims; BadRequest for an unsafe model id."""
    return job_dir(root, model_id) / CLAIMS_DIR


def _generations(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((int(m.group(1)) for name in names if (m := _CLAIM_NAME.fullmatch(name))), reverse=True)


def latest_claim(root: Path, model_id: str) -> Claim | None:
    """The newest readable claim on job `model_id`; None when it was never adopted. Blocks: a thread.

    A claim file that cannot be read (not a regular file, too large, not a claim of
    this job at its generation) is skipped, logged; the one before it counts.
    """
    directory = claims_dir(root, model_id)
    for generation in _generations(directory):
        claim = _read(directory / f"{generation:09d}.json")
        if claim is not None and (claim.model_id, claim.generation) == (model_id, generation):
            return claim
        logger.warning("checkpoint_root=%s model_id=%s: claim %d is unreadable; skipped", root, model_id, generation)
    return None


def _read(path: Path) -> Claim | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            return None
        raw = file.read(MAX_CLAIM_BYTES + 1)
    if len(raw) > MAX_CLAIM_BYTES:
        return None
    try:
        claim = _decode(raw)
    except msgspec.DecodeError:
        return None
    return claim if claim.format == CLAIM_FORMAT else None


def try_claim(
    root: Path, model_id: str, *, adopter: str, previous_home: str, step: int, seq_id: int
) -> Claim | None:
    """Claim job `model_id` for `adopter`, taking it from `previous_home`; None if it is not to be had.

    It is not to be had when a claim names another node than `previous_home` as the
    job's home now (the job was adopted from it already, or it was never its home),
    or when another node made the same claim first. Blocks: a thread.

    Raises:
        BadRequest: an unsafe model id.
        OSError: the root cannot be written.
    """
    latest = latest_claim(root, model_id)
    if latest is not None and latest.adopter != previous_home:
        return None
    generation = 1 if latest is None else latest.generation + 1
    claim = Claim(
        format=CLAIM_FORMAT, model_id=model_id, generation=generation, adopter=adopter,
        previous_home=previous_home, step=step, seq_id=seq_id, claimed_at=time.time(),
    )
    directory = claims_dir(root, model_id)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{generation:09d}.json"
    return claim if _create_exclusively(directory, final, msgspec.json.encode(claim)) else None


def _create_exclusively(directory: Path, final: Path, data: bytes) -> bool:
    """Write `data` at `final` unless the name exists: a temporary file, fsynced, hard-linked into place."""
    temporary = directory / f".{final.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, final)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            return _create_without_links(final, data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    fsync_dir(directory)
    return True


def _create_without_links(final: Path, data: bytes) -> bool:
    try:
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return True


def is_superseded(root: Path, model_id: str, *, home: str, generation: int) -> Claim | None:
    """The newer claim that took job `model_id` from `home`, which holds it by claim `generation`
    (0: it created the job); None while `home` is still the job's home. Blocks: a thread."""
    latest = latest_claim(root, model_id)
    if latest is None or latest.generation <= generation or latest.adopter == home:
        return None
    return latest
