"""Checkpoint lifecycle and session REST routes (`/api/v1/...`), and the signed downloads.

Routes: publish / unpublish / TTL of a checkpoint, `copy_weights`, the
external-weights URLs and the download they point at, session project
assignment, session search and the session trace export.

Who may do what: only a checkpoint's owner may publish, unpublish, change the
TTL of, or delete it; anyone may read (load, sample, copy, download) a
published one; anything else answers 404 exactly as a missing thing does, so
ids leak nothing. A signed URL is its own credential: the route that signs it
has already checked the caller, and the download route checks only the
signature and expiry, then the checkpoint actor serves regular files from
inside the checkpoint directory (never a symlink, never a path with '/' or '..').

The handlers decode, authenticate and reply through `wire` Structs; the rows
and files are the checkpoint actor's (actors/checkpoints.py, whose threads do
every filesystem call) and the records service's (actors/records.py).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, cast

import msgspec
from quart import request

from openrld import ids
from openrld.api import wire
from openrld.api.app import Services, caller, request_body
from openrld.api.asgi import Reply, json_reply
from openrld.errors import BadRequest, NotFound
from openrld.store import SessionRow

DOWNLOAD_URL_TTL_S = 3600  # the SDK re-signs within 5 minutes of expiry; an hour as Tinker does
TRACE_FILE = "trace.json"
CHECKPOINT_ARCHIVE_REFUSAL = (
    "checkpoint archives (RestClient.get_checkpoint_archive_url) are not served by openrld; it serves a "
    "checkpoint's files as signed URLs: TrainingClient.save_weights_external, then "
    "RestClient.get_external_weights_urls, in tinker 0.28.0 and later (pip install 'tinker>=0.28.0')"
)




# ---------------------------------------------------------------- publish, unpublish, TTL


async def publish(services: Services, run_id: str, kind: str, name: str) -> Reply:
    await services.checkpoints.publish(caller(services), ids.TinkerPath.of(run_id, kind, name), True)
    return json_reply(wire.EmptyResponse())


async def unpublish(services: Services, run_id: str, kind: str, name: str) -> Reply:
    await services.checkpoints.publish(caller(services), ids.TinkerPath.of(run_id, kind, name), False)
    return json_reply(wire.EmptyResponse())


async def set_ttl(services: Services, run_id: str, kind: str, name: str) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.TtlRequest)
    await services.checkpoints.set_ttl(user, ids.TinkerPath.of(run_id, kind, name), req.ttl_seconds)
    return json_reply(wire.EmptyResponse())


# ---------------------------------------------------------------- copies and downloads


async def copy_weights(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.CopyWeightsRequest)
    tinker_path = await services.checkpoints.copy(
        user, ids.parse_tinker_path(req.source_path), ttl_seconds=req.ttl_seconds,
        destination_project_id=req.destination_project_id,
    )
    return json_reply(wire.CopyWeightsResponse(tinker_path=tinker_path))


async def checkpoint_archive(services: Services, run_id: str, kind: str, name: str) -> Reply:
    # RestClient.get_checkpoint_archive_url (SDKs before 0.36) wants a 302 to one tar.gz of the
    # checkpoint; openrld hands out each file under its own signed URL instead, which SDKs from
    # 0.28.0 fetch. Refused by name, so the old SDK's user is told what to upgrade to.
    caller(services)
    ids.TinkerPath.of(run_id, kind, name)  # a malformed path is refused as such first
    raise BadRequest(CHECKPOINT_ARCHIVE_REFUSAL, key="get_checkpoint_archive_url")


async def external_weights_urls(services: Services, run_id: str, kind: str, name: str) -> Reply:
    user = caller(services)
    path = ids.TinkerPath.of(run_id, kind, name)
    if path.kind is not ids.CheckpointKind.EXTERNAL_WEIGHTS:
        raise BadRequest(f"external weights URLs are for external_weights/ checkpoints, got {path.checkpoint_id!r}")
    urls: dict[str, str] = {}
    expires = 0
    for filename in await services.checkpoints.external_files(user, path):
        signed, expires = services.signer.sign_path(
            f"/api/v1/download/{path.run_id}/{path.kind.value}/{path.name}/{filename}", DOWNLOAD_URL_TTL_S
        )
        urls[filename] = request.host_url.rstrip("/") + signed
    return json_reply(wire.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, UTC)))


async def download(services: Services, run_id: str, kind: str, name: str, filename: str) -> Reply:
    services.signer.check_path(
        f"/api/v1/download/{run_id}/{kind}/{name}/{filename}", request.args.get("expires"), request.args.get("sig")
    )
    data = await services.checkpoints.read_file(ids.TinkerPath.of(run_id, kind, name), filename)
    return Reply(data, content_type="application/octet-stream")


# ---------------------------------------------------------------- sessions


async def assign_project(services: Services, session_id: str) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.ProjectRequest)
    services.records.assign_project(user, session_id, req.project_id)
    return json_reply(wire.EmptyResponse())


async def search_sessions(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.SessionSearchRequest)
    if isinstance(req.owner, wire.UserSearchOwner) and req.owner.owner_urns != [f"tml:user:{user}"]:
        return json_reply(wire.SessionSearchResponse(sessions=[]))  # only one's own sessions are visible
    before = None if req.cursor is None else (req.cursor.last_created_at, req.cursor.last_session_id)
    found = services.records.search_sessions(user, partial(_matches, req=req), before=before, limit=req.limit)
    sessions = [
        wire.SessionSummary(
            session_id=row.session_id, created_at=row.created_at, owner=user, project_id=row.project_id or "",
            checkpoints_count=count, status=_session_status(row), display_name=row.display_name,
            user_metadata=row.user_metadata, checkpoint_storage_bytes=size,
        )
        for row, count, size in found[: req.limit]
    ]
    next_cursor = None
    if len(found) > req.limit:
        last = found[req.limit - 1][0]
        next_cursor = wire.SessionSearchCursor(last_created_at=last.created_at, last_session_id=last.session_id)
    return json_reply(wire.SessionSearchResponse(sessions=sessions, next_cursor=next_cursor))


async def trace_export(services: Services, session_id: str) -> Reply:
    services.records.own_session(caller(services), session_id)
    signed, _ = services.signer.sign_path(f"/api/v1/trace/{session_id}/{TRACE_FILE}", DOWNLOAD_URL_TTL_S)
    return json_reply(wire.TraceExportResponse(status="ready", url=request.host_url.rstrip("/") + signed))


async def trace(services: Services, session_id: str, filename: str) -> Reply:
    services.signer.check_path(
        f"/api/v1/trace/{session_id}/{filename}", request.args.get("expires"), request.args.get("sig")
    )
    row = services.records.session(session_id)
    if row is None:
        raise NotFound(f"no session {session_id!r}")
    requests = services.records.session_requests(session_id)
    return Reply(msgspec.json.encode(session_trace(row, requests)))


# ---------------------------------------------------------------- helpers


def _session_status(row: SessionRow) -> wire.SessionStatus:
    if row.finish_reason is None:
        return wire.SessionActive()
    return wire.ClientSessionFinished(reason=wire.FinishReason(type=cast("wire.FinishType", row.finish_reason)), detail=row.finish_detail)


def _matches(row: SessionRow, req: wire.SessionSearchRequest) -> bool:
    if req.session_id is not None and row.session_id != req.session_id:
        return False
    if req.project_ids is not None and row.project_id not in req.project_ids:
        return False
    if req.display_name is not None and req.display_name.lower() not in (row.display_name or "").lower():
        return False
    if any(row.user_metadata.get(k) != v for k, v in req.user_metadata.items()):
        return False
    if req.statuses is not None:
        kind = "active" if row.finish_reason is None else "client_finished"
        wanted = False
        for query in req.statuses:
            if isinstance(query, wire.ActiveStatusQuery) and kind == "active":
                wanted = True
            if isinstance(query, wire.ClientFinishedStatusQuery) and kind == "client_finished":
                wanted = wanted or query.reasons is None or row.finish_reason in query.reasons
        if not wanted:
            return False
    return True


def session_trace(
    session: SessionRow, requests: list[tuple[str, str, str, datetime, datetime | None]]
) -> dict[str, Any]:
    """The session's requests as a Chrome/Perfetto JSON trace: one track per model or sampler."""
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    origin = session.created_at
    for request_id, model_id, kind, created, finished in requests:
        tid = tracks.setdefault(model_id, len(tracks) + 1)
        start_us = (created - origin) // timedelta(microseconds=1)
        end = finished if finished is not None else created
        events.append(
            {
                "name": kind, "cat": "request", "ph": "X", "pid": 1, "tid": tid, "ts": start_us,
                "dur": max(0, (end - created) // timedelta(microseconds=1)),
                "args": {"request_id": request_id, "model_id": model_id},
            }
        )
    for model_id, tid in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": model_id}})
    events.append({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": session.session_id}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
