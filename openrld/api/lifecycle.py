"""Checkpoint lifecycle and session REST routes (`/api/v1/...`), and the signed downloads.

Routes: publish / unpublish / TTL of a checkpoint, `copy_weights`, the
external-weights URLs and the download they point at, session project
assignment, session search and the session trace export.

Who may do what: only a checkpoint's owner may publish, unpublish, change the
TTL of, or delete it; anyone may read (load, sample, copy, download) a
published one; anything else answers 404 exactly as a missing thing does, so
ids leak nothing. A signed URL is its own credential: the route that signs it
has already checked the caller, and the download route checks only the
signature and expiry, then serves regular files from inside the checkpoint
directory (never a symlink, never a path with '/' or '..').

It never writes checkpoint files itself except by copying a whole checkpoint
through the store's staging and commit (atomic), in a worker thread.
"""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio

from openrld import ids
from openrld.actors.checkpoints import check_ttl
from openrld.api import wire
from openrld.api.app import Services, caller, json_response
from openrld.checkpoint_manifest import MANIFEST_NAME
from openrld.errors import BadRequest, NotFound, ServerError
from openrld.store import CheckpointRow, SessionRow, Store, utc_now

DOWNLOAD_URL_TTL_S = 3600  # the SDK re-signs within 5 minutes of expiry; an hour as Tinker does
TRACE_FILE = "trace.json"
MAX_COPY_FILES = 64  # a checkpoint holds a handful of files; more means something is wrong


async def readable_checkpoint(services: Services, user: str, path: ids.TinkerPath) -> CheckpointRow:
    """The checkpoint if `user` owns it or it is published; else NotFound.

    On a shared checkpoint root, one that another node wrote is adopted first.
    """
    store = services.store
    row = store.get_checkpoint(path.run_id, path.kind, path.name) or await services.checkpoints.adopt_checkpoint(path)
    if row is None or (row.owner != user and not row.public):
        raise NotFound(f"no checkpoint {path.uri}")
    return row


def owned_checkpoint(store: Store, user: str, path: ids.TinkerPath) -> CheckpointRow:
    """The checkpoint if `user` owns it; a published one of someone else's is still NotFound here."""
    row = store.get_checkpoint(path.run_id, path.kind, path.name)
    if row is None or row.owner != user:
        raise NotFound(f"no checkpoint {path.uri}")
    return row


def checkpoint_files(directory: Path) -> list[str]:
    """The regular files directly in a checkpoint directory, sorted, less its manifest (openrld's, not the model's).

    Raises:
        ServerError: the directory holds a symlink, a device or a subdirectory;
            a checkpoint never does, so someone planted it.
    """
    names: list[str] = []
    for entry in os.scandir(directory):
        mode = entry.stat(follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise ServerError(f"checkpoint dir {directory.name!r} holds {entry.name!r}, which is not a regular file")
        if entry.name != MANIFEST_NAME:
            names.append(entry.name)
    return sorted(names)


def read_checkpoint_file(directory: Path, filename: str) -> bytes:
    """One file's bytes, refusing symlinks at the last step too (O_NOFOLLOW)."""
    ids.validate_name(filename, "file name")
    try:
        fd = os.open(directory / filename, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFound(f"no file {filename!r} in this checkpoint") from None
    except OSError as exc:  # ELOOP: the name is a symlink
        raise NotFound(f"no file {filename!r} in this checkpoint ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise NotFound(f"no file {filename!r} in this checkpoint (not a regular file)")
        return file.read()


def _copy_checkpoint_files(source: Path, staging: Path) -> int:
    files = checkpoint_files(source)
    if len(files) > MAX_COPY_FILES:
        raise ServerError(f"checkpoint dir {source.name!r} holds {len(files)} files; at most {MAX_COPY_FILES}")
    size = 0
    for name in files:
        data = read_checkpoint_file(source, name)
        with open(staging / name, "xb") as out:
            out.write(data)
        size += len(data)
    return size


def _session_status(row: SessionRow) -> dict[str, Any]:
    if row.finish_reason is None:
        return {"type": "active"}
    status: dict[str, Any] = {"type": "client_finished", "reason": {"type": row.finish_reason}}
    if row.finish_detail is not None:
        status["detail"] = row.finish_detail
    return status


def register(app: QuartTrio, services: Services) -> None:
    store = services.store
    signer = services.signer

    def audit(user: str, event: str, row: CheckpointRow, **extra: str) -> None:
        store.record_audit(
            user, event, {"tinker_path": row.tinker_path, "model_id": row.run_id, "actor": user, **extra}
        )

    # ------------------------------------------------------------ publish, unpublish, TTL

    async def set_public(run_id: str, kind: str, name: str, public: bool) -> Response:
        user = caller(services)
        row = owned_checkpoint(store, user, ids.TinkerPath.of(run_id, kind, name))
        await services.checkpoints.set_public(row.run_id, row.kind, row.name, public)
        audit(user, "checkpoint_published" if public else "checkpoint_unpublished", row)
        return json_response({})

    @app.post("/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>/publish")
    async def publish(run_id: str, kind: str, name: str) -> Response:
        return await set_public(run_id, kind, name, True)

    @app.delete("/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>/publish")
    async def unpublish(run_id: str, kind: str, name: str) -> Response:
        return await set_public(run_id, kind, name, False)

    @app.put("/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>/ttl")
    async def set_ttl(run_id: str, kind: str, name: str) -> Response:
        user = caller(services)
        req = wire.decode_json(await request.get_data(), wire.TtlRequest)
        row = owned_checkpoint(store, user, ids.TinkerPath.of(run_id, kind, name))
        check_ttl(req.ttl_seconds)
        expires_at = None if req.ttl_seconds is None else utc_now() + timedelta(seconds=req.ttl_seconds)
        await services.checkpoints.set_expiry(row.run_id, row.kind, row.name, expires_at)
        audit(user, "checkpoint_ttl_set", row, ttl_seconds=str(req.ttl_seconds))
        return json_response({})

    # ------------------------------------------------------------ copies and downloads

    @app.post("/api/v1/copy_weights")
    async def copy_weights() -> Response:
        user = caller(services)
        req = wire.decode_json(await request.get_data(), wire.CopyWeightsRequest)
        source = ids.parse_tinker_path(req.source_path)
        row = await readable_checkpoint(services, user, source)
        check_ttl(req.ttl_seconds)
        run = store.get_run(source.run_id)
        if run is None:
            raise NotFound(f"no training run {source.run_id!r}")
        source_dir = store.checkpoint_dir(source.run_id, source.kind, source.name)
        # The copy is a run of the caller's own, so it lives and dies apart from the source.
        copy_run = f"copy-{ids.new_request_id()[2:18]}"
        store.create_run(
            copy_run, session_id="", owner=user, base_model=run.base_model, model_dir=run.model_dir,
            lora=run.lora, settings=run.settings, user_metadata={}, optimizer_config=run.optimizer_config,
        )
        final = store.checkpoint_dir(copy_run, source.kind, source.name)
        staging = store.staging_dir()
        size = await trio.to_thread.run_sync(_copy_checkpoint_files, source_dir, staging)
        metadata = dict(row.user_metadata)
        if req.destination_project_id is not None:
            metadata["project_id"] = req.destination_project_id
        expires_at = None if req.ttl_seconds is None else utc_now() + timedelta(seconds=req.ttl_seconds)
        manifest = store.manifest_for(
            copy_run, source.kind, source.name, size_bytes=size, user_metadata=metadata, expires_at=expires_at
        )
        await trio.to_thread.run_sync(partial(store.commit_dir, staging, final, manifest=manifest))
        copied = store.add_checkpoint(
            copy_run, source.kind, source.name, user, size, metadata, expires_at, created_at=manifest.created_at
        )
        audit(user, "checkpoint_copied", copied, source=row.tinker_path)
        return json_response({"tinker_path": copied.tinker_path})

    @app.get("/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str) -> Response:
        user = caller(services)
        path = ids.TinkerPath.of(run_id, kind, name)
        if path.kind is not ids.CheckpointKind.EXTERNAL_WEIGHTS:
            raise BadRequest(f"external weights URLs are for external_weights/ checkpoints, got {path.checkpoint_id!r}")
        row = await readable_checkpoint(services, user, path)
        directory = store.checkpoint_dir(path.run_id, path.kind, path.name)
        urls: dict[str, str] = {}
        expires = 0
        for filename in await trio.to_thread.run_sync(checkpoint_files, directory):
            signed, expires = signer.sign_path(
                f"/api/v1/download/{path.run_id}/{path.kind.value}/{path.name}/{filename}", DOWNLOAD_URL_TTL_S
            )
            urls[filename] = request.host_url.rstrip("/") + signed
        audit(user, "checkpoint_read", row, purpose="external_weights_urls")
        return json_response({"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()})

    @app.get("/api/v1/download/<run_id>/<kind>/<name>/<filename>")
    async def download(run_id: str, kind: str, name: str, filename: str) -> Response:
        signer.check_path(
            f"/api/v1/download/{run_id}/{kind}/{name}/{filename}", request.args.get("expires"), request.args.get("sig")
        )
        path = ids.TinkerPath.of(run_id, kind, name)
        if store.get_checkpoint(path.run_id, path.kind, path.name) is None:
            raise NotFound(f"no checkpoint {path.uri}")
        directory = store.checkpoint_dir(path.run_id, path.kind, path.name)
        data = await trio.to_thread.run_sync(read_checkpoint_file, directory, filename)
        return Response(data, status=200, content_type="application/octet-stream")

    # ------------------------------------------------------------ sessions

    def own_session(user: str, session_id: str) -> SessionRow:
        row = store.get_session(session_id)
        if row is None or row.owner != user:
            raise NotFound(f"no session {session_id!r}")
        return row

    @app.put("/api/v1/sessions/<session_id>/project")
    async def assign_project(session_id: str) -> Response:
        user = caller(services)
        req = wire.decode_json(await request.get_data(), wire.ProjectRequest)
        own_session(user, session_id)
        if not req.project_id or len(req.project_id) > ids.MAX_NAME_CHARS:
            raise BadRequest(f"project_id: expected 1..{ids.MAX_NAME_CHARS} characters, got {len(req.project_id)}")
        store.set_session_project(session_id, req.project_id)
        store.record_audit(user, "project_session_assigned", {"session_id": session_id, "project_id": req.project_id, "actor": user})
        return json_response({})

    @app.post("/api/v1/sessions/search")
    async def search_sessions() -> Response:
        user = caller(services)
        req = wire.decode_json(await request.get_data(), wire.SessionSearchRequest)
        if isinstance(req.owner, wire.UserSearchOwner) and req.owner.owner_urns != [f"tml:user:{user}"]:
            return json_response({"sessions": []})  # only one's own sessions are visible
        summaries = []
        for row in store.all_sessions(user):
            if req.cursor is not None and (row.created_at, row.session_id) >= (
                req.cursor.last_created_at, req.cursor.last_session_id
            ):
                continue
            if not _matches(row, req):
                continue
            count, size = store.session_checkpoint_usage(row.session_id)
            summary: dict[str, Any] = {
                "session_id": row.session_id, "created_at": row.created_at.isoformat(), "owner": user,
                "project_id": row.project_id or "", "checkpoints_count": count,
                "status": _session_status(row), "user_metadata": row.user_metadata,
                "checkpoint_storage_bytes": size,
            }
            if row.display_name is not None:
                summary["display_name"] = row.display_name
            summaries.append((row, summary))
            if len(summaries) > req.limit:
                break
        body: dict[str, Any] = {"sessions": [s for _, s in summaries[: req.limit]]}
        if len(summaries) > req.limit:
            last = summaries[req.limit - 1][0]
            body["next_cursor"] = {"last_created_at": last.created_at.isoformat(), "last_session_id": last.session_id}
        return json_response(body)

    @app.get("/api/v1/sessions/<session_id>/trace_export")
    async def trace_export(session_id: str) -> Response:
        user = caller(services)
        own_session(user, session_id)
        signed, _ = signer.sign_path(f"/api/v1/trace/{session_id}/{TRACE_FILE}", DOWNLOAD_URL_TTL_S)
        return json_response({"status": "ready", "url": request.host_url.rstrip("/") + signed})

    @app.get("/api/v1/trace/<session_id>/<filename>")
    async def trace(session_id: str, filename: str) -> Response:
        signer.check_path(f"/api/v1/trace/{session_id}/{filename}", request.args.get("expires"), request.args.get("sig"))
        row = store.get_session(session_id)
        if row is None:
            raise NotFound(f"no session {session_id!r}")
        return Response(msgspec.json.encode(session_trace(store, row)), content_type="application/json")


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


def session_trace(store: Store, session: SessionRow) -> dict[str, Any]:
    """The session's requests as a Chrome/Perfetto JSON trace: one track per model or sampler."""
    tracks: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    origin = session.created_at
    for request_id, model_id, kind, created, finished in store.session_requests(session.session_id):
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
