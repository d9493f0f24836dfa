"""The Tinker API routes the SDK's training and sampling loop uses (`/api/v1/...`).

Each route decodes its body by what its Content-Type and Content-Encoding say
(`media.py`: JSON with msgspec, or protobuf for forward_backward, which SDKs
before 0.25 may also send as JSON), authenticates the caller, hands the request
to the job table and answers a future or a small JSON body. Results are read
back by `retrieve_future`, which long-polls and answers forward, forward_backward
and sample results in the form the client's Accept prefers (protobuf, or JSON for
SDKs before 0.25), JSON for the rest. Every JSON reply is a
`wire` Struct, so it goes out as `wire.py`'s tests check it: fields at their
default left out, never null.

`routes.py` declares each of them; the loop's hot POSTs are served by
`fastpath` without quart, under the same decoding and auth rules.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import cast

import msgspec

from openrld import __version__, sdk_support
from openrld.actors.futures import Completed, Failed
from openrld.actors.trainer import Created, Loaded, Saved
from openrld.api import forward_json, media, result_json, wire
from openrld.api.app import Services, caller, request_body
from openrld.api.asgi import Reply, json_reply
from openrld.api.fastpath import Call
from openrld.batches import ForwardBackwardResult, OptimResult, SampleResult
from openrld.errors import BadRequest, NotSupportedYet, OpenrldError, UnsupportedMediaType, UserError

logger = logging.getLogger(__name__)

PROTOBUF = media.PROTOBUF
MAX_TOPK_LOGPROBS = 20  # top-k logprobs per position; vLLM caps at 20 too
SERVER_SIDE_CUSTOM_LOSS_REFUSAL = (
    "server-side custom losses are not supported by this server (create_custom_loss); use "
    "TrainingClient.forward_backward_custom with custom_loss_server_side=false: the SDK runs the loss "
    "client-side in two cross_entropy passes, with the same gradient"
)
# The statuses on which the SDK sends a request again under the same seq_id: deferred, not refused.
RETRIED_STATUSES = frozenset({408, 409, 429})





# ---------------------------------------------------------------- bootstrap


async def client_config(services: Services) -> Reply:
    caller(services)
    req = await request_body(services, wire.ClientConfigRequest)
    # SDKs 0.21 to 0.24 are told to send forward_backward as protobuf, and forward as a
    # forward_backward with forward_only (the flags left their config in 0.25, and 0.16 to 0.20
    # know only JSON). Every other flag stays at the SDK's default, which is what openrld
    # serves: chunks in parallel and uncompressed, custom losses client-side, no join_sampling_session.
    legacy_proto = sdk_support.wants_proto_write_flag(req.sdk_version)
    return json_reply(
        wire.ClientConfigResponse(
            pjwt_auth_enabled=services.auth.jwt_enabled, proto_write_fwdbwd=legacy_proto, fwd_via_fwdbwd=legacy_proto
        )
    )


async def dynamic_config(services: Services) -> Reply:
    caller(services)
    return json_reply(wire.ClientDynamicConfigResponse(sample_cancel_enabled=True))


async def create_session(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.CreateSessionRequest)
    session_id = await services.sessions.create(
        user, tags=list(req.tags), user_metadata=_str_dict(req.user_metadata, "user_metadata"),
        sdk_version=req.sdk_version or "", project_id=req.project_id, display_name=req.display_name,
    )
    logger.info("session created session_id=%s sdk_version=%s", session_id, req.sdk_version)
    return json_reply(wire.CreateSessionResponse(session_id=session_id))


async def session_heartbeat(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.SessionHeartbeatRequest)
    services.sessions.heartbeat(user, req.session_id)
    return json_reply(wire.SessionHeartbeatResponse())


async def finish_session(services: Services, session_id: str) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.SessionFinishRequest)
    services.jobs.finish_session(user, session_id, req.reason.type, req.detail)
    return json_reply(wire.EmptyResponse())


async def telemetry(services: Services) -> Reply:
    caller(services)
    await request_body(services, wire.TelemetryRequest)
    return json_reply(wire.TelemetryResponse())


async def healthz(services: Services) -> Reply:
    return json_reply(wire.HealthResponse(version=__version__))


async def get_server_capabilities(services: Services) -> Reply:
    caller(services)
    models = [
        wire.SupportedModel(
            model_name=m.entry.name, max_context_length=m.entry.max_context, trainable=True, sampleable=True,
            ready=m.is_ready,
        )
        for m in services.catalog.listed()
    ]
    return json_reply(wire.GetServerCapabilitiesResponse(supported_models=models))


# ---------------------------------------------------------------- training


async def create_model(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.CreateModelRequest)
    wire.optimizer_family(req.optimizer_config)
    request_id, model_id = services.jobs.create_model(
        user, session_id=req.session_id, model_seq_id=req.model_seq_id, base_model=req.base_model,
        # None is allowed only for openrl.fine_tuning_type=full; the job table says so otherwise.
        lora=wire.lora_spec_from_config(req.lora_config) if req.lora_config is not None else None,
        user_metadata=_str_dict(req.user_metadata, "user_metadata"),
        optimizer_config=dict(req.optimizer_config),
    )
    return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=model_id))


async def get_info(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.GetInfoRequest)
    info = services.jobs.job_info(user, req.model_id)
    return json_reply(
        wire.GetInfoResponse(
            model_id=info.model_id,
            model_data=wire.ModelData(arch=info.arch, model_name=info.base_model, tokenizer_id=info.tokenizer_id),
            optimizer_config=info.optimizer_config,
            is_lora=info.lora is not None,
            lora_rank=info.lora.rank if info.lora is not None else None,
            model_name=info.base_model,
        )
    )


async def save_weights(services: Services) -> Reply:
    user = caller(services)
    async with _refusal_takes_its_turn(services, user, "save_weights"):
        req = await request_body(services, wire.SaveWeightsRequest)
        if req.path is None:
            raise BadRequest("save_weights: path (the checkpoint name) is required")
        request_id = services.jobs.save_weights(
            user, req.model_id, _seq_id(req.seq_id), name=req.path, overwrite=bool(req.overwrite),
            ttl_seconds=req.ttl_seconds, user_metadata=_str_dict(req.user_metadata, "user_metadata"),
        )
    return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=req.model_id))


async def save_weights_for_sampler(services: Services) -> Reply:
    user = caller(services)
    async with _refusal_takes_its_turn(services, user, "save_weights_for_sampler"):
        req = await request_body(services, wire.SaveWeightsForSamplerRequest)
        request_id = services.jobs.save_weights_for_sampler(
            user, req.model_id, _seq_id(req.seq_id), name=req.path,
            sampling_session_seq_id=req.sampling_session_seq_id, kind=req.kind, ttl_seconds=req.ttl_seconds,
            user_metadata=_str_dict(req.user_metadata, "user_metadata"),
        )
    return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=req.model_id))


async def save_weights_external(services: Services) -> Reply:
    user = caller(services)
    async with _refusal_takes_its_turn(services, user, "save_weights_external"):
        req = await request_body(services, wire.SaveWeightsExternalRequest)
        if req.age_encryption_recipients:
            raise NotSupportedYet("save_weights_external with age_encryption_recipients is not supported yet")
        request_id = services.jobs.save_weights_external(
            user, req.model_id, _seq_id(req.seq_id), name=req.path, ttl_seconds=req.ttl_seconds
        )
    return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=req.model_id))


async def load_weights(services: Services) -> Reply:
    user = caller(services)
    async with _refusal_takes_its_turn(services, user, "load_weights"):
        return await _load_weights(services, user)


async def _load_weights(services: Services, user: str) -> Reply:
    req = await request_body(services, wire.LoadWeightsRequest)
    with_optimizer = bool(req.optimizer)
    if req.optimizer_config is not None:
        wire.optimizer_family(req.optimizer_config)
    await services.checkpoints.adopt_to_read(req.path)
    if req.model_id is None:
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequest("load_weights needs model_id and seq_id, or session_id and model_seq_id")
        request_id, model_id = services.jobs.load_into_new_model(
            user, session_id=req.session_id, model_seq_id=req.model_seq_id, path=req.path,
            with_optimizer=with_optimizer, optimizer_config=req.optimizer_config,
        )
        return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=model_id))
    if req.seq_id is None:
        raise BadRequest("load_weights with model_id needs seq_id")
    request_id = services.jobs.load_weights(user, req.model_id, req.seq_id, path=req.path, with_optimizer=with_optimizer)
    return json_reply(wire.UntypedAPIFuture(request_id=request_id, model_id=req.model_id))


# ---------------------------------------------------------------- sampling


async def create_sampling_session(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.CreateSamplingSessionRequest)
    if req.model_path is not None:
        await services.checkpoints.adopt_to_read(req.model_path)
    sampler_id = services.sampling.create(
        user, session_id=req.session_id, sampling_session_seq_id=req.sampling_session_seq_id,
        base_model=req.base_model, model_path=req.model_path,
    )
    return json_reply(wire.CreateSamplingSessionResponse(sampling_session_id=sampler_id))


async def get_sampler(services: Services, sampler_id: str) -> Reply:
    user = caller(services)
    info = services.sampling.info(user, sampler_id)
    return json_reply(
        wire.GetSamplerResponse(sampler_id=info.sampler_id, base_model=info.base_model, model_path=info.model_path)
    )


async def cancel_future(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.CancelFutureRequest)
    services.sampling.cancel(user, req.request_id)
    return json_reply(wire.EmptyResponse())


async def create_custom_loss(services: Services) -> Reply:
    # refused, not run. The SDK uploads only when the client config says
    # custom_loss_server_side=true, which this server never does; a client that uploads
    # anyway is told what works instead.
    caller(services)
    raise BadRequest(SERVER_SIDE_CUSTOM_LOSS_REFUSAL, key="create_custom_loss")


# ---------------------------------------------------------------- the hot POSTs (fastpath)


async def forward_backward(services: Services, call: Call) -> Reply:
    return _forward_backward(services, call, forward_only=False)


async def forward(services: Services, call: Call) -> Reply:
    # SDKs before 0.25 call this route for TrainingClient.forward, in JSON; later ones send
    # forward_backward with forward_only, and so do 0.21 to 0.24 told fwd_via_fwdbwd.
    return _forward_backward(services, call, forward_only=True)


def _forward_backward(services: Services, call: Call, *, forward_only: bool) -> Reply:
    user = _user(services, call)
    jobs = services.jobs
    route = "forward" if forward_only else "forward_backward"
    max_body_bytes = services.config.max_body_bytes
    # The body is what its Content-Type says: protobuf (the SDK's form since 0.21), or JSON
    # (0.16 to 0.24); /api/v1/forward has only ever been JSON.
    form = media.form_of(call.content_type, where=route)
    if form is media.Form.PROTOBUF and forward_only:
        raise UnsupportedMediaType(f"forward: this route takes {media.JSON}; send protobuf to forward_backward")
    try:
        if form is media.Form.JSON:
            model_id, seq_id, batch = forward_json.decode(
                call.body, call.content_encoding, forward_only=forward_only, max_body_bytes=max_body_bytes
            )
        else:
            model_id, seq_id, batch = wire.decode_forward_backward(
                call.body, call.content_encoding, max_body_bytes=max_body_bytes
            )
    except UserError as error:
        if form is media.Form.JSON:
            ids = forward_json.ids(call.body, call.content_encoding, forward_only=forward_only, max_body_bytes=max_body_bytes)
        else:
            ids = wire.forward_backward_ids(call.body, call.content_encoding, max_body_bytes=max_body_bytes)
        if ids is None:
            raise
        model_id, seq_id = ids
        return _future(jobs.reject(user, model_id, seq_id, route, error), model_id)
    return _future(jobs.forward_backward(user, model_id, seq_id, batch), model_id)


async def optim_step(services: Services, call: Call) -> Reply:
    user = _user(services, call)
    jobs = services.jobs
    req = _call_body(services, call, wire.OptimStepRequest)
    seq_id = _seq_id(req.seq_id)
    try:
        params = wire.adam_params_from_request(req)
    except UserError as error:
        return _future(jobs.reject(user, req.model_id, seq_id, "optim_step", error), req.model_id)
    return _future(jobs.optim_step(user, req.model_id, seq_id, params), req.model_id)


async def asample(services: Services, call: Call) -> Reply:
    user = _user(services, call)
    req = _call_body(services, call, wire.SampleRequest)
    if req.sampling_session_id is None:
        raise BadRequest("asample needs sampling_session_id")
    job = wire.sample_job_from_request(
        req, max_num_samples=services.config.max_num_samples, max_topk=MAX_TOPK_LOGPROBS
    )
    request_id, sequence_ids = services.sampling.sample(
        user, req.sampling_session_id, _seq_id(req.seq_id), job,
        record_stability_info=bool(req.record_stability_info),
    )
    return _future(request_id, None, sequence_ids)


async def retrieve_future(services: Services, call: Call) -> Reply:
    user = _user(services, call)
    req = _call_body(services, call, wire.FutureRetrieveRequest)
    futures = services.futures
    outcome = await futures.wait(req.request_id, owner=user, hold_s=services.config.longpoll_s)
    if isinstance(outcome, Completed) and isinstance(outcome.value, SampleResult):
        services.usage.sample_delivered(req.request_id, sum(len(s.tokens) for s in outcome.value.sequences))
    return _outcome_reply(req.request_id, outcome, futures.queue_state(req.request_id), media.reply_form(call.accept))


# ---------------------------------------------------------------- replies


@contextlib.asynccontextmanager
async def _refusal_takes_its_turn(services: Services, user: str, kind: str) -> AsyncIterator[None]:
    """A training op refused before it was queued still takes its seq_id's turn, and fails in it.

    The SDK numbered the client's later training ops after this one before sending it, so they
    would otherwise wait forever for its turn. The refusal itself is answered at once (its 4xx).
    """
    try:
        yield
    except UserError as error:
        if error.status not in RETRIED_STATUSES:
            await _take_refused_turn(services, user, kind, error)
        raise


async def _take_refused_turn(services: Services, user: str, kind: str, error: UserError) -> None:
    try:
        ids = await request_body(services, wire.TrainingOpIds)
        seq_id = _seq_id(ids.seq_id)
    except UserError:
        return  # no model_id and seq_id to read (load_weights into a new model has none): no turn is held
    try:
        services.jobs.reject(user, ids.model_id, seq_id, kind, error)
    except OpenrldError as unfilled:  # the model is not the caller's resident job, or its queue is full
        logger.info("refused %s model_id=%s seq_id=%s took no turn: %s", kind, ids.model_id, seq_id, unfilled.detail)


def _future(request_id: str, model_id: str | None = None, sequence_ids: list[str] | None = None) -> Reply:
    return json_reply(
        wire.UntypedAPIFuture(request_id=request_id, model_id=model_id, sample_sequence_ids=sequence_ids)
    )


def _outcome_reply(
    request_id: str, outcome: Completed | Failed | None, queue_state: str = "active",
    form: media.Form = media.Form.PROTOBUF,
) -> Reply:
    """What retrieve_future answers: try_again while pending, the failure, or the result.

    forward_backward and sample results go out in `form` (what the client's Accept prefers);
    every other reply has only a JSON form.
    """
    if outcome is None:
        # A 408 with the try_again body: every SDK release served (0.16.1 to 0.38.0) polls again at
        # once on either form and reads queue_state from both, but on a 200 try_again each logs a
        # warning to the user's terminal, one a pending future a long-poll.
        return json_reply(
            wire.TryAgainResponse(request_id=request_id, queue_state=cast("wire.QueueState", queue_state)), status=408
        )
    if isinstance(outcome, Failed):
        return json_reply(wire.RequestFailedResponse(error=outcome.detail, category=cast("wire.FailureCategory", outcome.category)))
    value = outcome.value
    if isinstance(value, ForwardBackwardResult):
        if form is media.Form.JSON:
            return Reply(result_json.encode_forward_backward_output(value), content_type=media.JSON)
        return Reply(wire.encode_forward_backward_output(value), content_type=PROTOBUF)
    if isinstance(value, SampleResult):
        if form is media.Form.JSON:
            return Reply(result_json.encode_sample_response(value), content_type=media.JSON)
        return Reply(wire.encode_sample_response(value), content_type=PROTOBUF)
    if isinstance(value, OptimResult):
        return json_reply(wire.OptimStepResponse(metrics=value.metrics))
    if isinstance(value, Created):
        return json_reply(wire.CreateModelResponse(model_id=value.model_id))
    if isinstance(value, Loaded):
        return json_reply(wire.LoadWeightsResponse(path=value.path, model_id=value.model_id))
    if isinstance(value, Saved):
        # One shape for the three saves: `path` for a named save, `sampling_session_id` for an unnamed one.
        return json_reply(wire.SaveWeightsForSamplerResponse(path=value.path, sampling_session_id=value.sampling_session_id))
    raise AssertionError(f"no wire form for result {type(value).__name__}")


# ---------------------------------------------------------------- request fields


def _user(services: Services, call: Call) -> str:
    return call.user if call.user is not None else services.auth.user_for(call.api_key)


def _call_body(services: Services, call: Call, type_: type[wire.T]) -> wire.T:
    return media.read_json(
        call.body, type_, content_type=call.content_type, content_encoding=call.content_encoding,
        max_body_bytes=services.config.max_body_bytes,
    )


def _seq_id(seq_id: int | None) -> int:
    if seq_id is None or seq_id < 0:
        raise BadRequest(f"seq_id: expected an integer >= 0, got {seq_id!r}")
    return seq_id


def _str_dict(value: object, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{field}: expected an object of strings")
    return {str(k): v if isinstance(v, str) else msgspec.json.encode(v).decode() for k, v in value.items()}
