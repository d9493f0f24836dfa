"""AdminClient routes and the auth routes (`/api/v1/audit`, `/billing/...`, `/auth/...`).

Everything here is computed from real data about the caller only: the audit
log from the events the daemon recorded (checkpoint saves, reads, deletes,
publishes, TTLs, expiries, copies, project moves), billing usage from the
token counts metered per session (training, sampling prefill, sampled) plus
the checkpoints made, and checkpoint storage from the bytes each checkpoint
wrote. openrld prices nothing, so every cost field is left out.

The auth routes: `POST /auth/token` (the SDK's JWT exchange, when config
`jwt_auth` is on) and `GET|DELETE /auth/apikey/me` (the CLI's `tinker auth
login` / `logout`). They never reveal a key; keys are managed in the key file.
Every reply is a `wire` Struct, so it goes out as `wire.py`'s tests check it:
fields at their default left out, never null.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from functools import partial

from quart import request

from openrld.actors import usage
from openrld.actors.records import Records
from openrld.api import wire
from openrld.api.app import Services, caller
from openrld.api.asgi import Reply, json_reply
from openrld.api.signing import user_urn
from openrld.errors import BadRequest, NotFound

ORG_ID = "openrld"
EVENT_PREFIXES = {
    "all": ("",),
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": ("team_",),
    "organizations": ("organization_",),
}
_DEPRECATED_FIELDS = ("model_id", "tinker_path", "purpose")  # copied out of event_details for old readers
# A usage row's kind -> its billing event; no prefill is billed at a cached rate, so cached is False.
_TOKEN_EVENTS: dict[str, Callable[..., wire.BillingEventInfo]] = {
    usage.TRAINING: wire.TrainingBillingEvent,
    usage.SAMPLING_PREFILL: partial(wire.SamplingPrefillBillingEvent, cached=False),
    usage.SAMPLING_SAMPLE: wire.SamplingSampleBillingEvent,
}




# ---------------------------------------------------------------- admin routes


async def audit_log(services: Services) -> Reply:
    user = caller(services)
    event_type = request.args.get("event_type", "all")
    if event_type not in EVENT_PREFIXES:
        raise BadRequest(f"event_type: expected one of {', '.join(EVENT_PREFIXES)}, got {event_type!r}")
    day = request.args.get("day")
    if day is None:
        since, until = datetime(1970, 1, 1, tzinfo=UTC), datetime.now(UTC) + timedelta(seconds=1)
    else:
        try:
            start = date.fromisoformat(day)
        except ValueError:
            raise BadRequest(f"day: expected YYYY-MM-DD, got {day!r}") from None
        since = datetime(start.year, start.month, start.day, tzinfo=UTC)
        until = since + timedelta(days=1)
    prefixes = EVENT_PREFIXES[event_type]
    entries = [
        wire.AuditLogEntry(
            timestamp=when, event=event, event_details=details,
            **{name: details[name] for name in _DEPRECATED_FIELDS if name in details},
        )
        for when, event, details in services.records.audit_events(user, since, until)
        if event.startswith(prefixes)
    ]
    return json_reply(wire.AuditLogResponse(entries=entries))


async def billing_usage(services: Services) -> Reply:
    user = caller(services)
    records = services.records
    starting = request.args.get("starting_on")
    ending = request.args.get("ending_before")
    if starting is None or ending is None:
        raise BadRequest("starting_on and ending_before are required (RFC 3339)")
    since, until = _utc(starting, "starting_on"), _utc(ending, "ending_before")
    data: list[wire.BillingUsageEvent] = []
    sessions: dict[str, wire.BillingUsageSession] = {}
    for row in records.usage(user, since, until):  # the meter's latest counts included
        info = _TOKEN_EVENTS[row.kind](token_count=row.tokens)
        data.append(_usage_event(records, row.bucket_start, user, row.session_id, row.base_model, info, sessions))
    checkpoints: dict[tuple[datetime, str], int] = {}
    for when, event, details in records.audit_events(user, since, until):
        if event == "checkpoint_created":
            hour = when.replace(minute=0, second=0, microsecond=0)
            session_id = details.get("model_id", "").split(":", 1)[0]
            checkpoints[(hour, session_id)] = checkpoints.get((hour, session_id), 0) + 1
    for (hour, session_id), count in sorted(checkpoints.items()):
        info = wire.CheckpointBillingEvent(count=count)
        data.append(_usage_event(records, hour, user, session_id, None, info, sessions))
    return json_reply(wire.BillingUsageResponse(data=data, sessions=sessions))


async def checkpoint_storage(services: Services) -> Reply:
    user = caller(services)
    project = request.args.get("project_id")
    items = [
        wire.CurrentCheckpointStorageUsageItem(
            checkpoint_count=count, size_bytes=size, size_gigabytes=size / 1e9,
            project_id=project_id or None, org_user_urn=user_urn(user), user_name=user,
        )
        for project_id, count, size in services.records.storage_by_project(user)
        if project is None or project_id == project
    ]
    return json_reply(wire.CurrentCheckpointStorageUsageResponse(data=items))


# ---------------------------------------------------------------- auth routes


async def auth_token(services: Services) -> Reply:
    user = caller(services)
    if not services.auth.jwt_enabled:
        raise NotFound("the JWT exchange is off on this node (config jwt_auth = false)")
    jwt = services.signer.mint_jwt(user, services.config.jwt_ttl_s, org_id=ORG_ID, email=None)
    return json_reply(wire.AuthTokenResponse(jwt=jwt))


async def apikey_me(services: Services) -> Reply:
    user = caller(services)
    key_id = services.auth.key_id(request.headers.get("X-API-Key"))
    return json_reply(
        wire.SelfApiKeyResponse(
            key_id=key_id or 0,
            name=f"{user} key {key_id}" if key_id else "open mode",
            note="managed in the node's api_keys_file" if key_id else "open mode: no key file",
            details=wire.ApiKeyDetails(
                org_details=wire.ApiKeyOrgDetails(name=ORG_ID), user_details=wire.ApiKeyUserDetails(email="")
            ),
        )
    )


async def apikey_revoke(services: Services) -> Reply:
    caller(services)
    raise BadRequest("keys are managed in the node's api_keys_file; remove the key there to revoke it")


# ---------------------------------------------------------------- wire forms and arguments


def _usage_event(
    records: Records, bucket: datetime, user: str, session_id: str, base_model: str | None,
    info: wire.BillingEventInfo, sessions: dict[str, wire.BillingUsageSession],
) -> wire.BillingUsageEvent:
    """One hour of `info` for `session_id`; records the session's attributes in `sessions` on first sight."""
    project_id = None
    if session_id:
        session = records.session(session_id)
        if session is not None:
            project_id = session.project_id or None
            sessions.setdefault(session_id, wire.BillingUsageSession(user_metadata=session.user_metadata or None))
    return wire.BillingUsageEvent(
        bucket_start=bucket, bucket_end=bucket + timedelta(hours=1), event_info=info, base_model=base_model,
        user_id=user_urn(user), user_name=user, session_id=session_id or None, project_id=project_id,
    )


def _utc(value: str, name: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name}: expected an RFC 3339 date or datetime, got {value!r}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
