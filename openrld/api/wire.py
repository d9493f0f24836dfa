"""The JSON bodies of the Tinker API (SDK 0.38.0), and their conversions to engine types.

Owns: one msgspec Struct per JSON request and response body of
the Tinker HTTP API as the installed SDK speaks it (its `tinker/types/` is the
reference); `encode_json` (and `decode_json`, from `media.py`);
and the conversions of request bodies into the plain data of `batches.py`
(`sample_job_from_request`, `adam_params_from_request`, `lora_spec_from_config`,
`optimizer_family`). The protobuf half (forward_backward bodies, sample and
forward_backward results) lives in `api/proto/` and is re-exported here, so
routes import one module for the whole wire.

Guarantees:
- Requests ignore keys they do not know (the SDK adds fields, and sends a
  constant `type` discriminator that we accept and ignore), but type-check the
  ones they do; any defect is a `BadRequest` naming the JSON path.
- Responses omit fields at their default, so an optional field never goes out
  as null, no success body carries an `error` key, and the literals the SDK
  classifies on (`"type": "try_again"`, `"status": "accepted"`) are struct tags
  that are always written, as is the constant `type` the SDK's model declares
  for a reply (`"type": "create_model"`). Fields the SDK requires have no
  default. Datetimes must carry a timezone and are written as RFC 3339.
- An option openrld has not built is refused by name with `NotSupportedYet`,
  never silently ignored.

Never: imports torch or the tinker SDK, does I/O, or decides anything that
needs server state (which model exists, whose session it is): routes and actors
do that with the values decoded here.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np

# The protobuf half of the wire, re-exported so routes import one module.
from openrld.api.media import decode_json as decode_json
from openrld.api.proto.codec import (
    decode_forward_backward as decode_forward_backward,
    encode_forward_backward_output as encode_forward_backward_output,
    encode_sample_response as encode_sample_response,
    forward_backward_ids as forward_backward_ids,
)
from openrld.batches import AdamParams, DimuonParams, LoraSpec, SampleJob, SamplingSpec
from openrld.errors import BadRequest, NotSupportedYet

T = TypeVar("T")

# User metadata is opaque to openrld: stored as the client sent it and echoed back.
JsonObject = dict[str, Any]

MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 in every protobuf body
SUPPORTED_OPTIMIZERS = "adamw, dimuon"


class RequestBody(msgspec.Struct, frozen=True):
    """Base of JSON request bodies: unknown keys, `type` included, are ignored."""


class ResponseBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """Base of JSON response bodies: fields at their default are left out."""


def _require_timezone(struct: msgspec.Struct, *names: str) -> None:
    # msgspec writes a naive datetime without an offset, which is not RFC 3339
    # and which the SDK would read as local time; refuse it where it is built.
    for name in names:
        value = getattr(struct, name)
        if value is not None and value.tzinfo is None:
            raise ValueError(f"{type(struct).__name__}.{name} must carry a timezone, got {value!r}")


# ================================================================ requests: session


class ClientConfigRequest(RequestBody, frozen=True):
    sdk_version: str


class CreateSessionRequest(RequestBody, frozen=True):
    sdk_version: str
    tags: list[str] = []
    user_metadata: JsonObject | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(RequestBody, frozen=True):
    session_id: str


FinishType = Literal["success", "errored", "interrupted"]


class FinishReason(msgspec.Struct, frozen=True):
    type: FinishType


class SessionFinishRequest(RequestBody, frozen=True):
    reason: FinishReason
    detail: str | None = None  # the SDK sends an explicit null


class TelemetryEvent(RequestBody, frozen=True):
    """One telemetry event; the fields of all four SDK event kinds, the rest optional."""

    event: str
    event_id: str
    event_session_index: int
    severity: str
    timestamp: datetime
    event_name: str | None = None
    event_data: JsonObject | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    duration: str | None = None


class TelemetryRequest(RequestBody, frozen=True):
    events: list[TelemetryEvent]
    platform: str
    sdk_version: str
    session_id: str
    process_uuid: str


# ================================================================ requests: training


class LoraConfig(RequestBody, frozen=True):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


# An optimizer family as the SDK sends and reads it: `{"type": "adamw"}` or
# `{"type": "dimuon", "version": 1}`. It stays a JSON object because it is stored
# with the run and echoed back by get_info and weights_info exactly as received.
OptimizerConfigJson = dict[str, Any]


def _adamw() -> OptimizerConfigJson:
    return {"type": "adamw"}


def _check_optimizer_config(config: OptimizerConfigJson | None) -> None:
    if config is not None and not isinstance(config.get("type"), str):
        raise ValueError(f"optimizer_config: expected an object with a string 'type', got {config!r}")


class CreateModelRequest(RequestBody, frozen=True):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: JsonObject | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfigJson = msgspec.field(default_factory=_adamw)

    def __post_init__(self) -> None:
        _check_optimizer_config(self.optimizer_config)


class GetInfoRequest(RequestBody, frozen=True):
    model_id: str


class OptimizerParams(RequestBody, frozen=True):
    """Per-step hyperparameters. `type` is absent for AdamParams, set for other families."""

    type: str | None = None
    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = None
    # DimuonParams fields that SDK 0.29.1 sends and 0.38.0 forbids.
    damping: float | None = None
    rank_lr_correction_exponent: float | None = None


class OptimStepRequest(RequestBody, frozen=True):
    """Exactly one of the three params keys is expected (the SDK validates all three names)."""

    model_id: str
    seq_id: int | None = None
    adam_params: OptimizerParams | None = None
    optimizer_params: OptimizerParams | None = None
    optim_params: OptimizerParams | None = None


class TrainingOpIds(RequestBody, frozen=True):
    """A sequenced training op's model and seq_id, read alone from a body that was refused
    (api/tinker.py), so that its seq_id still takes its turn."""

    model_id: str
    seq_id: int


class SaveWeightsRequest(RequestBody, frozen=True):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerRequest(RequestBody, frozen=True):
    """Named (`path`) or unnamed (`sampling_session_seq_id`, for save_weights_and_get_sampling_client)."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("expected exactly one of path (named save) or sampling_session_seq_id")
        if self.kind == "inflight" and self.path is not None:
            raise ValueError("kind 'inflight' cannot be saved under a path; omit path")


class SaveWeightsExternalRequest(RequestBody, frozen=True):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsRequest(RequestBody, frozen=True):
    """Create-via-load (`session_id` + `model_seq_id`) or legacy (`model_id` + `seq_id`)."""

    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: JsonObject | None = None
    optimizer_config: OptimizerConfigJson | None = None
    weights_access_token: str | None = None

    def __post_init__(self) -> None:
        _check_optimizer_config(self.optimizer_config)
        legacy = (self.model_id is not None, self.seq_id is not None)
        create = (self.session_id is not None, self.model_seq_id is not None)
        if legacy == (True, True) and create == (False, False):
            return
        if create == (True, True) and legacy == (False, False):
            return
        raise ValueError(
            "expected either session_id and model_seq_id (create-via-load) or model_id and "
            "seq_id (load into an existing model), and not both"
        )

    @property
    def creates_model(self) -> bool:
        return self.session_id is not None


# ================================================================ requests: sampling


class ModelInputChunk(RequestBody, frozen=True):
    """One chunk of a ModelInput, of the kind `type` names.

    One Struct rather than a tagged union: SDKs before 0.18 send only the fields
    that were set, so their encoded_text chunks come without `type`, its default.
    """

    type: Literal["encoded_text", "image", "image_asset_pointer", "dmel"] = "encoded_text"
    tokens: list[int] = []  # encoded_text
    data: bytes | None = None  # image: standard padded base64 in JSON
    format: Literal["png", "jpeg"] | None = None  # image, image_asset_pointer
    location: str | None = None  # image_asset_pointer
    expected_tokens: int | None = None  # image, image_asset_pointer
    dmel: bytes | None = None  # dmel: a serialized TensorContainer, base64 in JSON


class ModelInput(RequestBody, frozen=True):
    chunks: list[ModelInputChunk]


class SamplingParams(RequestBody, frozen=True):
    max_tokens: int | None = None
    seed: int | None = None
    # str | list[str] | list[int] on the SDK side; msgspec allows one array type in
    # a union, so a list is decoded item-wise and a mix is refused on conversion.
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class TensorDataJson(RequestBody, frozen=True):
    """TensorData in JSON: flat `data`, dense or CSR."""

    data: list[int | float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SampleRequest(RequestBody, frozen=True):
    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: int = 1
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None  # never set by the SDK
    model_path: str | None = None  # never set by the SDK
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorDataJson | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class CreateSamplingSessionRequest(RequestBody, frozen=True):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None

    def __post_init__(self) -> None:
        if self.base_model is None and self.model_path is None:
            raise ValueError("one of base_model or model_path is required")


class JoinSamplingSessionRequest(RequestBody, frozen=True):
    sampling_session_id: str


# ================================================================ requests: futures


class FutureRetrieveRequest(RequestBody, frozen=True):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionTarget(RequestBody, frozen=True):
    sampling_session_id: str
    cloned_sampler_id: int = 0


class FuturesRetrieveRequest(RequestBody, frozen=True):
    target: SamplingSessionTarget
    prev_cursor: int = 0
    timeout: float | None = None  # absent: long-poll; 0: ack-only, answer at once
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(RequestBody, frozen=True):
    request_id: str


# ================================================================ requests: REST


class WeightsInfoRequest(RequestBody, frozen=True):
    tinker_path: str


class CopyWeightsRequest(RequestBody, frozen=True):
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None  # the SDK sends it as a header instead


class TtlRequest(RequestBody, frozen=True):
    ttl_seconds: int | None = None  # null removes the expiry


class ProjectRequest(RequestBody, frozen=True):
    project_id: str


class OwnSearchOwner(RequestBody, tag_field="type", tag="own", frozen=True):
    pass


class AccessibleSearchOwner(RequestBody, tag_field="type", tag="accessible", frozen=True):
    pass


class UserSearchOwner(RequestBody, tag_field="type", tag="user", frozen=True):
    owner_urns: Annotated[list[str], msgspec.Meta(min_length=1, max_length=10)]


class ActiveStatusQuery(RequestBody, tag_field="type", tag="active", frozen=True):
    pass


class CancelledStatusQuery(RequestBody, tag_field="type", tag="cancelled", frozen=True):
    pass


class FailedStatusQuery(RequestBody, tag_field="type", tag="failed", frozen=True):
    pass


class ClientFinishedStatusQuery(RequestBody, tag_field="type", tag="client_finished", frozen=True):
    reasons: (
        Annotated[list[Literal["success", "errored", "interrupted"]], msgspec.Meta(min_length=1)]
        | None
    ) = None


SessionStatusQuery = ActiveStatusQuery | CancelledStatusQuery | FailedStatusQuery | ClientFinishedStatusQuery


class SessionSearchCursor(ResponseBody, frozen=True):
    """A page boundary; sent in responses and echoed back in requests."""

    last_created_at: Annotated[datetime, msgspec.Meta(tz=True)]
    last_session_id: str

    def __post_init__(self) -> None:
        _require_timezone(self, "last_created_at")


class SessionSearchRequest(RequestBody, frozen=True):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    owner: OwnSearchOwner | AccessibleSearchOwner | UserSearchOwner = msgspec.field(
        default_factory=OwnSearchOwner
    )
    statuses: Annotated[list[SessionStatusQuery], msgspec.Meta(min_length=1)] | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=200)] = 50
    cursor: SessionSearchCursor | None = None


# ================================================================ responses: session


class ClientConfigResponse(ResponseBody, frozen=True):
    """Feature flags for the SDK. Defaults equal the SDK's, so an omitted field means the same."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    sample_dispatch_bytes_semaphore_size: int = 10 * 1024 * 1024
    inflight_response_bytes_semaphore_size: int = 50 * 1024 * 1024
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    fwdbwd_dispatch_bytes_semaphore_size: int = 50 * 1000 * 1000
    billing_exception_max_pause_duration_sec: int = 60 * 60
    sample_no_retries: bool = False
    sample_enable_stuck_detection: bool = True
    sample_max_concurrent_requests: int = 2000
    use_pyqwest_transport: bool = True
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False
    # SDKs 0.21 to 0.24 only (later ones dropped both): send forward_backward as protobuf, and
    # TrainingClient.forward as forward_backward with forward_only, instead of JSON to /forward.
    proto_write_fwdbwd: bool = False
    fwd_via_fwdbwd: bool = False


class ClientDynamicConfigResponse(ResponseBody, frozen=True):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionResponse(ResponseBody, tag_field="type", tag="create_session", frozen=True):
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(ResponseBody, tag_field="type", tag="session_heartbeat", frozen=True):
    pass


class TelemetryResponse(ResponseBody, tag_field="status", tag="accepted", frozen=True):
    """`{"status": "accepted"}`; anything else makes the SDK drop the batch."""


class ErrorResponse(ResponseBody, frozen=True):
    """The body of every 4xx/5xx answer (FastAPI style, which the CLI reads)."""

    detail: str


_error_encoder = msgspec.json.Encoder()


def error_body(detail: str) -> bytes:
    """Every error reply's body, whichever layer answers it (quart's handlers, the fast path, the gate, the relay)."""
    return _error_encoder.encode(ErrorResponse(detail=detail))


class EmptyResponse(ResponseBody, frozen=True):
    """`{}`: the answer of a route that only acknowledges (delete, publish, TTL, finish, cancel).

    The SDK reads no field of it; an empty object rather than no body keeps every answer JSON.
    """


# ================================================================ responses: futures


class UntypedAPIFuture(ResponseBody, frozen=True):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None  # asample: one per sample, in result order


QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]


class TryAgainResponse(ResponseBody, tag_field="type", tag="try_again", frozen=True):
    request_id: str
    queue_state: QueueState  # required by the SDK
    queue_state_reason: str | None = None


class MetadataOnlyResponse(ResponseBody, tag_field="status", tag="complete_metadata", frozen=True):
    response_payload_size: int


FailureCategory = Literal["unknown", "server", "user"]


class RequestFailedResponse(ResponseBody, frozen=True):
    error: str
    category: FailureCategory


class FutureFinished(ResponseBody, tag_field="state", tag="finished", frozen=True):
    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(ResponseBody, tag_field="state", tag="failed", frozen=True):
    request_id: str


class FuturesRetrieveResponse(ResponseBody, frozen=True):
    completions: list[FutureFinished | FutureFailed]
    cursor: int


# ================================================================ responses: training results


class CreateModelResponse(ResponseBody, tag_field="type", tag="create_model", frozen=True):
    model_id: str


class ModelData(ResponseBody, frozen=True):
    arch: str | None = None
    model_name: str | None = None  # needed by get_tokenizer and save_weights_and_get_sampling_client
    tokenizer_id: str | None = None


class GetInfoResponse(ResponseBody, tag_field="type", tag="get_info", frozen=True):
    model_data: ModelData
    model_id: str
    optimizer_config: OptimizerConfigJson  # no default: leaving it out would read as adamw
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class OptimStepResponse(ResponseBody, frozen=True):
    metrics: dict[str, float] | None = None


class SaveWeightsResponse(ResponseBody, frozen=True):
    path: str


class SaveWeightsForSamplerResponse(ResponseBody, frozen=True):
    """`path` for a named save; `sampling_session_id` for an unnamed one (both SDK-enforced)."""

    path: str | None = None
    sampling_session_id: str | None = None


class SaveWeightsExternalResponse(ResponseBody, frozen=True):
    path: str
    size_bytes: int | None = None


class LoadWeightsResponse(ResponseBody, tag_field="type", tag="load_weights", frozen=True):
    path: str | None = None
    model_id: str | None = None


# ================================================================ responses: sampling and REST


class CreateSamplingSessionResponse(ResponseBody, tag_field="type", tag="create_sampling_session", frozen=True):
    sampling_session_id: str


class JoinSamplingSessionResponse(ResponseBody, frozen=True):
    client_counter: int


class GetSamplerResponse(ResponseBody, frozen=True):
    sampler_id: str
    base_model: str
    model_path: str | None = None  # None for inflight sessions


class SupportedModel(ResponseBody, frozen=True):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None
    # openrld's own (the SDK ignores fields it does not know): False while the model's
    # files are still to be converted from a GGUF, which its first use does.
    ready: bool | None = None


class GetServerCapabilitiesResponse(ResponseBody, frozen=True):
    supported_models: list[SupportedModel]


class WeightsInfoResponse(ResponseBody, frozen=True):
    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfigJson  # the checkpoint's; leaving it out would read as adamw
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class CopyWeightsResponse(ResponseBody, frozen=True):
    tinker_path: str


CheckpointType = Literal["training", "sampler", "external"]


class Checkpoint(ResponseBody, frozen=True):
    checkpoint_id: str  # "<kind>/<name>", e.g. "weights/step-10"
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None

    def __post_init__(self) -> None:
        _require_timezone(self, "time", "expires_at")


class Cursor(ResponseBody, frozen=True):
    offset: int
    limit: int
    total_count: int  # the CLI pages with it


class CheckpointsListResponse(ResponseBody, frozen=True):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class ExternalWeightsUrlsResponse(ResponseBody, frozen=True):
    urls: dict[str, str]  # relative path -> signed URL
    expires: datetime

    def __post_init__(self) -> None:
        _require_timezone(self, "expires")


class TrainingRun(ResponseBody, frozen=True):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        _require_timezone(self, "last_request_time")


class TrainingRunsResponse(ResponseBody, frozen=True):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ListSessionsResponse(ResponseBody, frozen=True):
    sessions: list[str]


class GetSessionResponse(ResponseBody, frozen=True):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class SessionActive(ResponseBody, tag_field="type", tag="active", frozen=True):
    pass


class SessionCancelled(ResponseBody, tag_field="type", tag="cancelled", frozen=True):
    detail: str | None = None


class ClientSessionFinished(ResponseBody, tag_field="type", tag="client_finished", frozen=True):
    reason: FinishReason
    detail: str | None = None


class FailedRequestReason(ResponseBody, tag_field="type", tag="request", frozen=True):
    request_id: str
    request_type: str


class FailedTrainingRunReason(ResponseBody, tag_field="type", tag="training_run", frozen=True):
    training_run_id: str


class FailedSamplingSessionReason(ResponseBody, tag_field="type", tag="sampling_session", frozen=True):
    sampling_session_id: str


class SessionFailed(ResponseBody, tag_field="type", tag="failed", frozen=True):
    category: Literal["user", "internal"]
    reason: FailedRequestReason | FailedTrainingRunReason | FailedSamplingSessionReason
    message: str


SessionStatus = SessionActive | SessionCancelled | ClientSessionFinished | SessionFailed


class SessionSummary(ResponseBody, frozen=True):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    checkpoints_count: int
    status: SessionStatus | None = None
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None

    def __post_init__(self) -> None:
        _require_timezone(self, "created_at")


class SessionSearchResponse(ResponseBody, frozen=True):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


class TraceExportResponse(ResponseBody, frozen=True):
    """A poll of `/sessions/<id>/trace_export` (the SDK's private _SessionTraceExportPollResponse).

    openrld builds the trace when it is downloaded, so a poll always answers "ready" with the signed URL.
    """

    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    error: str | None = None


class HealthResponse(ResponseBody, tag_field="status", tag="ok", frozen=True):
    version: str | None = None  # openrld's own (the SDK reads only status): the daemon's version, for people and probes


# ================================================================ responses: admin and auth
# openrld prices nothing, so the SDK's cost and rate fields (all optional) have no field here.


class AuditLogEntry(ResponseBody, frozen=True):
    timestamp: datetime
    event: str  # `<resource>_<action>`, e.g. "checkpoint_created"
    event_details: dict[str, str] = {}  # who did it and what it was about, as the store recorded it
    # Deprecated copies of event_details' keys, for readers older than event_details.
    model_id: str | None = None
    tinker_path: str | None = None
    purpose: str | None = None

    def __post_init__(self) -> None:
        _require_timezone(self, "timestamp")


class AuditLogResponse(ResponseBody, frozen=True):
    entries: list[AuditLogEntry]  # oldest first


class TrainingBillingEvent(ResponseBody, tag_field="type", tag="training", frozen=True):
    token_count: int


class SamplingPrefillBillingEvent(ResponseBody, tag_field="type", tag="sampling_prefill", frozen=True):
    cached: bool  # required by the SDK; openrld bills no cached rate, so always False
    token_count: int


class SamplingSampleBillingEvent(ResponseBody, tag_field="type", tag="sampling_sample", frozen=True):
    token_count: int


class CheckpointBillingEvent(ResponseBody, tag_field="type", tag="checkpoint", frozen=True):
    count: int  # checkpoints created in the bucket


BillingEventInfo = (
    TrainingBillingEvent | SamplingPrefillBillingEvent | SamplingSampleBillingEvent | CheckpointBillingEvent
)


class BillingUsageEvent(ResponseBody, frozen=True):
    bucket_start: datetime  # inclusive start of the UTC hour
    bucket_end: datetime  # exclusive end
    event_info: BillingEventInfo
    base_model: str | None = None  # None for checkpoint counts, which are not per model
    user_id: str | None = None  # the user's urn
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None  # the session's project, where it has one

    def __post_init__(self) -> None:
        _require_timezone(self, "bucket_start", "bucket_end")


class BillingUsageSession(ResponseBody, frozen=True):
    user_metadata: dict[str, str] | None = None  # the session's, as created; None when it has none


class BillingUsageResponse(ResponseBody, frozen=True):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = {}  # every session named in `data`


class CurrentCheckpointStorageUsageItem(ResponseBody, frozen=True):
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float  # size_bytes / 1e9
    project_id: str | None = None
    org_user_urn: str | None = None
    user_name: str | None = None


class CurrentCheckpointStorageUsageResponse(ResponseBody, frozen=True):
    data: list[CurrentCheckpointStorageUsageItem]  # one per project of the caller's checkpoints


class AuthTokenResponse(ResponseBody, frozen=True):
    jwt: str


class ApiKeyOrgDetails(ResponseBody, frozen=True):
    name: str


class ApiKeyUserDetails(ResponseBody, frozen=True):
    email: str  # required by the CLI; "" where the node knows none


class ApiKeyDetails(ResponseBody, frozen=True):
    org_details: ApiKeyOrgDetails
    user_details: ApiKeyUserDetails


class SelfApiKeyResponse(ResponseBody, frozen=True):
    """`GET /auth/apikey/me`, which `tinker auth login` reads (the CLI's own model, not in `tinker.types`)."""

    key_id: int  # 0 in open mode, where no key file names keys
    name: str
    note: str
    details: ApiKeyDetails


# ================================================================ codec


def encode_json(body: msgspec.Struct) -> bytes:
    """Encode a response Struct as JSON bytes (fields at their default left out)."""
    return msgspec.json.encode(body)


# ================================================================ conversions: training


def lora_spec_from_config(config: LoraConfig) -> LoraSpec:
    """LoraSpec from a request's lora_config.

    Raises:
        BadRequest: rank < 1, or all three train_* flags false.
    """
    if config.rank < 1:
        raise BadRequest(f"lora_config.rank: expected >= 1, got {config.rank}", key="lora_config.rank")
    if not (config.train_unembed or config.train_mlp or config.train_attn):
        raise BadRequest(
            "lora_config: at least one of train_unembed, train_mlp, train_attn must be true",
            key="lora_config",
        )
    return LoraSpec(
        rank=config.rank,
        seed=config.seed,
        train_unembed=config.train_unembed,
        train_mlp=config.train_mlp,
        train_attn=config.train_attn,
    )


def optimizer_family(config: OptimizerConfigJson, *, field: str = "optimizer_config") -> str:
    """The optimizer family an `optimizer_config` selects: "adamw" or "dimuon".

    Raises:
        BadRequest: any other type, a dimuon version other than 1, or adamw with
            keys besides `type`.
    """
    family = config.get("type")
    if family == "adamw":
        extra = sorted(key for key in config if key != "type")
        if extra:
            raise BadRequest(f"{field}: type 'adamw' takes no other keys, got {extra}", key=field)
        return "adamw"
    if family == "dimuon":
        version = config.get("version", 1)
        if version != 1 or isinstance(version, bool):
            raise BadRequest(f"{field}.version: dimuon version must be 1, got {version!r}", key=field)
        return "dimuon"
    raise BadRequest(f"unsupported optimizer type {family!r}; supported: {SUPPORTED_OPTIMIZERS}", key=field)


def adam_params_from_request(req: OptimStepRequest) -> AdamParams | DimuonParams:
    """The params of one optim_step, AdamParams or DimuonParams by the `type` sent;
    omitted fields take the SDK's defaults. Whether the family matches the model's is
    the trainer's check, in seq_id order.

    Raises:
        BadRequest: no params key or more than one, a family other than adamw
            or dimuon, or a value outside torch's AdamW checks (non-finite,
            learning_rate/eps/weight_decay < 0, a beta outside [0, 1)); for dimuon,
            a missing learning_rate, an AdamW-only field, or a value out of its range.
    """
    given = [
        (key, params)
        for key, params in (
            ("adam_params", req.adam_params),
            ("optimizer_params", req.optimizer_params),
            ("optim_params", req.optim_params),
        )
        if params is not None
    ]
    if len(given) != 1:
        sent = ", ".join(key for key, _ in given) or "none"
        raise BadRequest(
            f"optim_step: expected exactly one of adam_params, optimizer_params, optim_params; got {sent}"
        )
    key, params = given[0]
    family = params.type or "adamw"  # AdamParams carries no type
    if family == "dimuon":
        return _dimuon_params(key, params)
    if family != "adamw":
        raise BadRequest(f"unsupported optimizer type {family!r}; supported: {SUPPORTED_OPTIMIZERS}", key=key)

    defaults = AdamParams()
    adam = AdamParams(
        learning_rate=_or_default(params.learning_rate, defaults.learning_rate),
        beta1=_or_default(params.beta1, defaults.beta1),
        beta2=_or_default(params.beta2, defaults.beta2),
        eps=_or_default(params.eps, defaults.eps),
        weight_decay=_or_default(params.weight_decay, defaults.weight_decay),
        grad_clip_norm=_or_default(params.grad_clip_norm, defaults.grad_clip_norm),
    )
    _check_adam(key, adam)
    return adam


def _dimuon_params(key: str, params: OptimizerParams) -> DimuonParams:
    """DimuonParams from the wire; AdamW-only fields are refused by name (the SDK forbids extras)."""
    for name in ("beta2", "eps", "weight_decay"):
        if getattr(params, name) is not None:
            raise BadRequest(
                f"{key}.{name}: not a DimuonParams field (dimuon takes learning_rate, grad_clip_norm, beta1, "
                f"damping, rank_lr_correction_exponent)",
                key=f"{key}.{name}",
            )
    if params.learning_rate is None:
        raise BadRequest(f"{key}.learning_rate: required for dimuon", key=f"{key}.learning_rate")
    defaults = DimuonParams(learning_rate=0.0)
    dimuon = DimuonParams(
        learning_rate=float(params.learning_rate),
        grad_clip_norm=_or_default(params.grad_clip_norm, defaults.grad_clip_norm),
        beta1=_or_default(params.beta1, defaults.beta1),
        damping=_or_default(params.damping, defaults.damping),
        rank_lr_correction_exponent=_or_default(
            params.rank_lr_correction_exponent, defaults.rank_lr_correction_exponent
        ),
    )
    for name in ("learning_rate", "grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent"):
        value = getattr(dimuon, name)
        if not math.isfinite(value):
            raise BadRequest(f"{key}.{name}: expected a finite number, got {value}", key=f"{key}.{name}")
    if dimuon.learning_rate < 0:
        raise BadRequest(f"{key}.learning_rate: expected >= 0, got {dimuon.learning_rate}", key=f"{key}.learning_rate")
    if not 0 <= dimuon.beta1 < 1:
        raise BadRequest(f"{key}.beta1: expected a value in [0, 1), got {dimuon.beta1}", key=f"{key}.beta1")
    if dimuon.damping <= 0:
        raise BadRequest(f"{key}.damping: expected > 0, got {dimuon.damping}", key=f"{key}.damping")
    return dimuon


def _or_default(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def _check_adam(key: str, adam: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, name)
        if not math.isfinite(value):
            raise BadRequest(f"{key}.{name}: expected a finite number, got {value}", key=f"{key}.{name}")
    for name in ("learning_rate", "eps", "weight_decay"):
        value = getattr(adam, name)
        if value < 0:
            raise BadRequest(f"{key}.{name}: expected >= 0, got {value}", key=f"{key}.{name}")
    for name in ("beta1", "beta2"):
        value = getattr(adam, name)
        if not 0 <= value < 1:
            raise BadRequest(f"{key}.{name}: expected a value in [0, 1), got {value}", key=f"{key}.{name}")
    # grad_clip_norm <= 0 means "no clipping", so any finite value passes.


# ================================================================ conversions: sampling


def sample_job_from_request(req: SampleRequest, *, max_num_samples: int, max_topk: int) -> SampleJob:
    """The engine's SampleJob for one asample body.

    Args:
        req: the decoded body.
        max_num_samples: the server's cap on num_samples.
        max_topk: the server's cap on topk_prompt_logprobs and topk_sample_logprobs.

    Raises:
        NotSupportedYet: a non-text prompt chunk, target_prompt_logprobs or
            prompt_alt_tokens_k > 0, each named. (record_stability_info is the
            sampling sessions': see `SamplingSessions.sample`.)
        BadRequest: an empty prompt or bad token id, num_samples outside
            [1, max_num_samples], a bad sampling parameter, prompt_logprobs_last_n
            without prompt_logprobs or outside [1, len(prompt) - 1], a top-k over the cap.
    """
    _refuse_unbuilt_sampling_options(req)
    prompt = _prompt_tokens(req.prompt)
    if not 1 <= req.num_samples <= max_num_samples:
        raise BadRequest(
            f"num_samples: expected 1 to {max_num_samples} (the server's max_num_samples), "
            f"got {req.num_samples}",
            key="num_samples",
        )
    prompt_logprobs = bool(req.prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not prompt_logprobs:
            raise BadRequest("prompt_logprobs_last_n requires prompt_logprobs=true", key="prompt_logprobs_last_n")
        if not 1 <= last_n <= prompt.size - 1:
            raise BadRequest(
                f"prompt_logprobs_last_n: expected 1 to {prompt.size - 1} (prompt length - 1), got {last_n}",
                key="prompt_logprobs_last_n",
            )
    for name, k in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
    ):
        if not 0 <= k <= max_topk:
            raise BadRequest(f"{name}: expected 0 to {max_topk} (the server's max_topk), got {k}", key=name)
    return SampleJob(
        prompt=prompt,
        num_samples=req.num_samples,
        params=sampling_spec_from_params(req.sampling_params),
        prompt_logprobs=prompt_logprobs,
        prompt_logprobs_last_n=last_n,
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs,
    )


def _refuse_unbuilt_sampling_options(req: SampleRequest) -> None:
    if req.target_prompt_logprobs is not None:
        raise NotSupportedYet("target_prompt_logprobs is not supported yet", key="target_prompt_logprobs")
    if req.prompt_alt_tokens_k < 0:
        raise BadRequest(
            f"prompt_alt_tokens_k: expected >= 0, got {req.prompt_alt_tokens_k}", key="prompt_alt_tokens_k"
        )
    if req.prompt_alt_tokens_k > 0:
        raise NotSupportedYet("prompt_alt_tokens_k > 0 is not supported yet", key="prompt_alt_tokens_k")


def _prompt_tokens(prompt: ModelInput) -> np.ndarray:
    tokens: list[int] = []
    for j, chunk in enumerate(prompt.chunks):
        if chunk.type != "encoded_text":
            kind = chunk.type
            raise NotSupportedYet(
                f"prompt.chunks[{j}]: {kind!r} chunks are not supported yet; only 'encoded_text'",
                key="prompt",
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise BadRequest("prompt: holds no tokens", key="prompt")
    _check_token_ids("prompt", tokens)
    return np.array(tokens, dtype=np.int64)


def _check_token_ids(where: str, tokens: list[int]) -> None:
    low, high = min(tokens), max(tokens)
    if low < 0 or high > MAX_TOKEN_ID:
        bad = low if low < 0 else high
        raise BadRequest(f"{where}: token ids must lie in [0, {MAX_TOKEN_ID}], got {bad}", key=where)


def sampling_spec_from_params(params: SamplingParams) -> SamplingSpec:
    """SamplingSpec from SamplingParams, with `stop` split into strings and token ids.

    Raises:
        BadRequest: max_tokens < 0, temperature negative or non-finite, top_p
            outside (0, 1], top_k < -1, or a stop that mixes strings and ids,
            holds an empty string or a bad token id.
    """
    where = "sampling_params"
    if params.max_tokens is not None and params.max_tokens < 0:
        raise BadRequest(f"{where}.max_tokens: expected >= 0, got {params.max_tokens}", key=f"{where}.max_tokens")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise BadRequest(
            f"{where}.temperature: expected a finite value >= 0, got {params.temperature}",
            key=f"{where}.temperature",
        )
    if not 0 < params.top_p <= 1:  # also false for NaN
        raise BadRequest(f"{where}.top_p: expected a value in (0, 1], got {params.top_p}", key=f"{where}.top_p")
    if params.top_k < -1:
        raise BadRequest(
            f"{where}.top_k: expected -1 or 0 (no limit) or k >= 1, got {params.top_k}", key=f"{where}.top_k"
        )
    stop_strings, stop_token_ids, stop_at_eos = _split_stop(params.stop)
    return SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=float(params.temperature),
        top_k=-1 if params.top_k == 0 else params.top_k,  # 0 and -1 both mean no limit
        top_p=float(params.top_p),
        seed=params.seed,
        stop_strings=stop_strings,
        stop_token_ids=stop_token_ids,
        stop_at_eos=stop_at_eos,
    )


def _split_stop(stop: str | list[str | int] | None) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """(strings, token ids, stop_at_eos). None keeps EOS; [] disables every stop, EOS included."""
    where = "sampling_params.stop"
    if stop is None:
        return (), (), True
    items = [stop] if isinstance(stop, str) else stop
    if not items:
        return (), (), False
    if all(isinstance(item, str) for item in items):
        strings = tuple(item for item in items if isinstance(item, str))
        if "" in strings:
            raise BadRequest(f"{where}: stop strings must be non-empty", key=where)
        return strings, (), True  # a non-empty stop adds to EOS, it does not replace it
    if all(isinstance(item, int) for item in items):
        token_ids = [item for item in items if isinstance(item, int)]
        _check_token_ids(where, token_ids)
        return (), tuple(token_ids), True
    raise BadRequest(
        f"{where}: expected a string, a list of strings or a list of token ids, got a mix: {items!r}",
        key=where,
    )
