"""The store's records as frozen Structs: what every repository returns and callers read.

It owns the shape of a session, run, sampling session, checkpoint, usage
bucket and request-log entry, and the store's statistics. Plain data: no
SQLite, no files, no trio.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

import msgspec

from openrld.ids import CheckpointKind, TinkerPath

JsonScalar = str | int | float | bool | None


def utc_now() -> datetime:
    return datetime.now(UTC)


class SessionRow(msgspec.Struct, frozen=True):
    session_id: str
    owner: str
    tags: tuple[str, ...]
    user_metadata: dict[str, str]
    sdk_version: str
    project_id: str | None
    display_name: str | None
    created_at: datetime
    last_heartbeat_at: datetime
    finished_at: datetime | None
    finish_reason: str | None  # the first reason given; later ones are ignored
    finish_detail: str | None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class RunRow(msgspec.Struct, frozen=True):
    """A training run; `run_id` is the training client's model id."""

    run_id: str
    session_id: str
    owner: str
    base_model: str
    model_dir: str
    lora: dict[str, JsonScalar] | None  # LoraConfig fields; None for full fine-tuning
    settings: dict[str, JsonScalar]  # settings.settings_to_dict form
    user_metadata: dict[str, str]
    optimizer_config: dict[str, JsonScalar]
    created_at: datetime
    last_request_at: datetime
    corrupted: bool

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    @property
    def lora_rank(self) -> int | None:
        rank = self.lora.get("rank") if self.lora is not None else None
        return rank if isinstance(rank, int) else None


class SamplerRow(msgspec.Struct, frozen=True):
    sampler_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None  # the tinker:// path it samples from; None for the base model
    run_id: str | None  # the training run that made it, for save_weights_and_get_sampling_client
    created_at: datetime


class CheckpointRow(msgspec.Struct, frozen=True):
    run_id: str
    kind: CheckpointKind
    name: str
    owner: str
    created_at: datetime
    size_bytes: int | None
    user_metadata: dict[str, str]
    expires_at: datetime | None
    public: bool

    @property
    def path(self) -> TinkerPath:
        return TinkerPath(run_id=self.run_id, kind=self.kind, name=self.name)

    @property
    def tinker_path(self) -> str:
        return self.path.uri

    @property
    def checkpoint_id(self) -> str:
        return self.path.checkpoint_id

    @property
    def checkpoint_type(self) -> str:
        return self.kind.checkpoint_type


class UsageRow(msgspec.Struct, frozen=True):
    """Tokens one session used of one kind ("training", "sampling_prefill", "sampling_sample") in one hour."""

    bucket_start: datetime
    session_id: str
    owner: str
    base_model: str
    kind: str
    tokens: int


class RequestState(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    LOST = "lost"  # pending when the daemon stopped; its result will never come


class RequestFinish(msgspec.Struct, frozen=True):
    request_id: str
    finished: datetime


class StoreStatistics(msgspec.Struct, frozen=True):
    sessions: int
    runs: int
    samplers: int
    checkpoints: int
    checkpoint_bytes: int
    pending_requests: int
