"""Ids and tinker:// paths: how they are made, and how they are read back.

This module owns the shape of every id openrld hands out (sessions, models,
sampling sessions, requests) and of the `tinker://<run>/<kind>/<name>` paths
that name checkpoints. It guarantees that anything it parses
or validates is safe to use as a single path component under the data dir:
parsing refuses anything malformed with a `BadRequest` that says what was
wrong and what was received. It never touches the filesystem and keeps no
state; the store joins validated components into paths.
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets

import msgspec

from openrld.errors import BadRequest

TINKER_SCHEME = "tinker://"

# Names reach the filesystem as one directory component each. 128 characters
# leaves room under NAME_MAX (255 bytes) for the "#old" suffix a replace uses.
MAX_NAME_CHARS = 128

# ':' is allowed because run ids are model ids ("<session>:train:<n>"); it is
# an ordinary character in a POSIX file name.
_NAME_CHARS = re.compile(r"[A-Za-z0-9._:-]+")

# How much of a received value an error message quotes: enough to recognise
# it, never a megabyte of it echoed back.
_SHOWN_CHARS = 80


def _shown(value: object) -> str:
    """The received value as an error message quotes it (repr, truncated)."""
    text = repr(value)
    if len(text) > _SHOWN_CHARS:
        return text[:_SHOWN_CHARS] + "..."
    return text


NODE_TAG_CHARS = 8


def node_tag(node_name: str) -> str:
    """The 8 hex characters a clustered node puts at the front of the ids it mints.

    Any node can then tell which member minted a session or request id, and
    relay a call for it there, without asking around: the id carries the home node as a hint; the job
    directory (`cluster/directory.py`) is the truth.
    """
    return hashlib.sha256(node_name.encode()).hexdigest()[:NODE_TAG_CHARS]


def new_session_id(tag: str = "") -> str:
    """A fresh session id: "s-" and 16 random hex characters (64 bits), after the minting node's `tag`.

    It is url- and filename-safe and contains no '/' or ':', so the ids built
    from it split unambiguously on ':'.
    """
    return "s-" + tag + secrets.token_hex(8)


def new_request_id(tag: str = "") -> str:
    """A fresh future id: "r-" and 32 hex characters, the first of them the minting node's `tag`.

    With a tag, 96 of the 128 bits stay random: still no collision in any
    node's lifetime.
    """
    return "r-" + tag + secrets.token_hex(16 - len(tag) // 2)


def tag_of(minted_id: str) -> str | None:
    """The node tag a session id, request id, or id built on a session id may carry; None if it has none.

    A request id's first 8 hex characters are returned whether it was minted
    with a tag or not (the two look alike); callers look the tag up among the
    cluster's members, where a random match is a 1 in 4 billion chance per member.
    """
    head = minted_id.split(":", 1)[0]
    if head.startswith("s-") and len(head) == 2 + NODE_TAG_CHARS + 16:
        return head[2 : 2 + NODE_TAG_CHARS]
    if head.startswith("r-") and len(head) == 2 + 32:
        return head[2 : 2 + NODE_TAG_CHARS]
    return None


def model_id(session_id: str, model_seq_id: int) -> str:
    """The training client's model id, which is also its training run id.

    The SDK assumes exactly this form for create-via-load.
    """
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, n: int) -> str:
    """The n-th sampling session of a session (the form the SDK's docs use)."""
    return f"{session_id}:sample:{n}"


class CheckpointKind(enum.Enum):
    """The middle part of a tinker:// path; the value is the directory name too."""

    WEIGHTS = "weights"
    SAMPLER_WEIGHTS = "sampler_weights"
    EXTERNAL_WEIGHTS = "external_weights"

    @property
    def checkpoint_type(self) -> str:
        """The `checkpoint_type` the SDK's Checkpoint carries for this kind."""
        return _CHECKPOINT_TYPES[self]


_CHECKPOINT_TYPES: dict[CheckpointKind, str] = {
    CheckpointKind.WEIGHTS: "training",
    CheckpointKind.SAMPLER_WEIGHTS: "sampler",
    CheckpointKind.EXTERNAL_WEIGHTS: "external",
}

_KIND_CHOICES = "'weights', 'sampler_weights' or 'external_weights'"


def validate_name(name: object, what: str) -> str:
    """Check that `name` is safe as one path component under the data dir.

    Checkpoint names and run ids reach the filesystem, so each must be a plain
    file name: non-empty, at most 128 characters of `[A-Za-z0-9._:-]`, not
    starting with '.' (which also rules out "." and ".."), and so never
    containing '/', '\\', NUL or an absolute path.

    Args:
        name: the received value.
        what: what it is, for the message ("checkpoint name", "run id").

    Returns:
        `name`, unchanged.

    Raises:
        BadRequest: naming `what`, the rule broken, and the value received.
    """
    if not isinstance(name, str):
        raise BadRequest(f"{what}: expected a string, got {_shown(name)}")
    if not name:
        raise BadRequest(f"{what}: must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise BadRequest(f"{what}: must be at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if "\x00" in name:
        raise BadRequest(f"{what}: must not contain NUL, got {_shown(name)}")
    if "/" in name or "\\" in name:
        raise BadRequest(f"{what}: must not contain '/' or '\\', got {_shown(name)}")
    if name.startswith("."):
        raise BadRequest(f"{what}: must not start with '.', got {_shown(name)}")
    if _NAME_CHARS.fullmatch(name) is None:
        raise BadRequest(f"{what}: may contain only letters, digits and '.', '_', ':', '-'; got {_shown(name)}")
    return name


def parse_checkpoint_kind(kind: object) -> CheckpointKind:
    """The CheckpointKind named by `kind` ("weights", ...), or BadRequest."""
    if isinstance(kind, CheckpointKind):
        return kind
    for member in CheckpointKind:
        if kind == member.value:
            return member
    raise BadRequest(f"checkpoint kind: expected {_KIND_CHOICES}, got {_shown(kind)}")


class TinkerPath(msgspec.Struct, frozen=True):
    """A checkpoint's address: `tinker://<run_id>/<kind>/<name>`.

    Build one with `TinkerPath.of` or `parse_tinker_path`, which validate;
    the plain constructor trusts its arguments.
    """

    run_id: str
    kind: CheckpointKind
    name: str

    @classmethod
    def of(cls, run_id: str, kind: CheckpointKind | str, name: str) -> TinkerPath:
        """A validated path from its parts; BadRequest if any part is unsafe."""
        return cls(
            run_id=validate_name(run_id, "run id"),
            kind=parse_checkpoint_kind(kind),
            name=validate_name(name, "checkpoint name"),
        )

    @property
    def uri(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.kind.value}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """"<kind>/<name>", the Checkpoint's `checkpoint_id` (it contains a '/')."""
        return f"{self.kind.value}/{self.name}"


def parse_tinker_path(path: object) -> TinkerPath:
    """Read `tinker://<run_id>/<kind>/<name>`, refusing anything else.

    Exactly three '/'-separated parts follow the scheme, as the SDK's own
    parser requires; the kind is one of the three CheckpointKind values; the
    run id and name pass `validate_name`.

    Raises:
        BadRequest: saying what was expected and what was received.
    """
    expected = f"expected 'tinker://<run_id>/<kind>/<name>' with kind {_KIND_CHOICES}"
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise BadRequest(f"tinker path: {expected}, got {_shown(path)}")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3:
        raise BadRequest(f"tinker path: {expected}, got {_shown(path)} with {len(parts)} parts")
    run_id, kind, name = parts
    return TinkerPath(
        run_id=validate_name(run_id, "tinker path run id"),
        kind=parse_checkpoint_kind(kind),
        name=validate_name(name, "tinker path checkpoint name"),
    )


def parse_checkpoint_id(checkpoint_id: object) -> tuple[CheckpointKind, str]:
    """Read a `checkpoint_id` ("<kind>/<name>") as the REST routes carry it.

    Raises:
        BadRequest: saying what was expected and what was received.
    """
    if not isinstance(checkpoint_id, str) or checkpoint_id.count("/") != 1:
        raise BadRequest(f"checkpoint id: expected '<kind>/<name>', got {_shown(checkpoint_id)}")
    kind, name = checkpoint_id.split("/")
    return parse_checkpoint_kind(kind), validate_name(name, "checkpoint name")
