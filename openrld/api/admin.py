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
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from openrld.api.app import Services, caller, json_response
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


def _utc(value: str, name: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name}: expected an RFC 3339 date or datetime, got {value!r}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def register(app: QuartTrio, services: Services) -> None:
    store = services.store
    auth = services.auth

    @app.get("/api/v1/audit")
    async def audit_log() -> Response:
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
        entries = []
        for when, event, details in store.audit_events(user, since, until):
            if not event.startswith(prefixes):
                continue
            entry: dict[str, Any] = {"timestamp": when.isoformat(), "event": event, "event_details": details}
            for name in _DEPRECATED_FIELDS:
                if name in details:
                    entry[name] = details[name]
            entries.append(entry)
        return json_response({"entries": entries})

    @app.get("/api/v1/billing/usage/events")
    async def billing_usage() -> Response:
        user = caller(services)
        starting = request.args.get("starting_on")
        ending = request.args.get("ending_before")
        if starting is None or ending is None:
            raise BadRequest("starting_on and ending_before are required (RFC 3339)")
        since, until = _utc(starting, "starting_on"), _utc(ending, "ending_before")
        services.usage.flush(store)
        data: list[dict[str, Any]] = []
        sessions: dict[str, dict[str, Any]] = {}
        for row in store.usage(user, since, until):
            info: dict[str, Any] = {"type": row.kind, "token_count": row.tokens}
            if row.kind == "sampling_prefill":
                info["cached"] = False
            data.append(_event(row.bucket_start, user, row.session_id, row.base_model, store, info, sessions))
        checkpoints: dict[tuple[datetime, str], int] = {}
        for when, event, details in store.audit_events(user, since, until):
            if event == "checkpoint_created":
                hour = when.replace(minute=0, second=0, microsecond=0)
                session_id = details.get("model_id", "").split(":", 1)[0]
                checkpoints[(hour, session_id)] = checkpoints.get((hour, session_id), 0) + 1
        for (hour, session_id), count in sorted(checkpoints.items()):
            data.append(_event(hour, user, session_id, None, store, {"type": "checkpoint", "count": count}, sessions))
        return json_response({"data": data, "sessions": sessions})

    @app.get("/api/v1/billing/usage/checkpoints/current")
    async def checkpoint_storage() -> Response:
        user = caller(services)
        project = request.args.get("project_id")
        items = []
        for project_id, count, size in store.storage_by_project(user):
            if project is not None and project_id != project:
                continue
            item: dict[str, Any] = {
                "org_user_urn": user_urn(user), "user_name": user, "checkpoint_count": count,
                "size_bytes": size, "size_gigabytes": size / 1e9,
            }
            if project_id:
                item["project_id"] = project_id
            items.append(item)
        return json_response({"data": items})

    # ------------------------------------------------------------ auth

    @app.post("/api/v1/auth/token")
    async def auth_token() -> Response:
        user = caller(services)
        if not auth.jwt_enabled:
            raise NotFound("the JWT exchange is off on this node (config jwt_auth = false)")
        jwt = services.signer.mint_jwt(user, services.config.jwt_ttl_s, org_id=ORG_ID, email=None)
        return json_response({"jwt": jwt})

    @app.get("/api/v1/auth/apikey/me")
    async def apikey_me() -> Response:
        user = caller(services)
        key_id = auth.key_id(request.headers.get("X-API-Key"))
        return json_response(
            {
                "key_id": key_id or 0,
                "name": f"{user} key {key_id}" if key_id else "open mode",
                "note": "managed in the node's api_keys_file" if key_id else "open mode: no key file",
                "details": {"org_details": {"name": ORG_ID}, "user_details": {"email": ""}},
            }
        )

    @app.delete("/api/v1/auth/apikey/me")
    async def apikey_revoke() -> Response:
        caller(services)
        raise BadRequest("keys are managed in the node's api_keys_file; remove the key there to revoke it")


def _event(
    bucket: datetime, user: str, session_id: str, base_model: str | None, store: Any,
    info: dict[str, Any], sessions: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "bucket_start": bucket.isoformat(), "bucket_end": (bucket + timedelta(hours=1)).isoformat(),
        "user_id": user_urn(user), "user_name": user, "event_info": info,
    }
    if base_model is not None:
        event["base_model"] = base_model
    if session_id:
        event["session_id"] = session_id
        session = store.get_session(session_id)
        if session is not None:
            if session.project_id:
                event["project_id"] = session.project_id
            sessions.setdefault(session_id, {"user_metadata": session.user_metadata or None})
    return event
