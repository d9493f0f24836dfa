"""The read-mostly REST routes: training runs, checkpoints and sessions (`/api/v1/...`).

A user sees their own runs and checkpoints, plus published checkpoints; any
other id answers 404, exactly as a missing one does, so ids leak nothing.
Checkpoint routes carry the checkpoint id (`<kind>/<name>`) as two segments.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from openrld import ids
from openrld.api import wire
from openrld.api.app import Services, caller, json_response
from openrld.errors import BadRequest, NotFound
from openrld.store import CheckpointRow, RunRow


def _time(value: datetime) -> str:
    return value.isoformat()


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    body: dict[str, Any] = {
        "checkpoint_id": row.checkpoint_id,
        "checkpoint_type": row.checkpoint_type,
        "time": _time(row.created_at),
        "tinker_path": row.tinker_path,
        "public": row.public,
        "user_metadata": row.user_metadata,
    }
    if row.size_bytes is not None:
        body["size_bytes"] = row.size_bytes
    if row.expires_at is not None:
        body["expires_at"] = _time(row.expires_at)
    return body


def _access_scope() -> str:
    scope = request.args.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise BadRequest(f"access_scope: expected 'owned' or 'accessible', got {scope!r}")
    return scope


def int_arg(name: str, default: int, low: int, high: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name}: expected {low}..{high}, got {value}")
    return value


def register(app: QuartTrio, services: Services) -> None:
    store = services.store

    def own_run(user: str, run_id: str) -> RunRow:
        # On a shared checkpoint root, what other nodes saved of the run (a dead node's, say) is adopted first.
        run = store.adopt_run(run_id) or store.get_run(run_id)
        if run is None or run.owner != user:
            raise NotFound(f"no training run {run_id!r}")
        return run

    def accessible_run(user: str, run_id: str) -> RunRow:
        """The caller's run, or another user's run that has a published checkpoint."""
        run = store.adopt_run(run_id) or store.get_run(run_id)
        if run is None or (run.owner != user and not store.has_public_checkpoint(run_id)):
            raise NotFound(f"no training run {run_id!r}")
        return run

    def run_json(run: RunRow, user: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "training_run_id": run.run_id,
            "base_model": run.base_model,
            "model_owner": run.owner,
            "is_lora": run.is_lora,
            "last_request_time": _time(run.last_request_at),
            "corrupted": run.corrupted,
            "user_metadata": run.user_metadata,
        }
        if run.lora_rank is not None:
            body["lora_rank"] = run.lora_rank
        for key, kind in (("last_checkpoint", "weights"), ("last_sampler_checkpoint", "sampler_weights")):
            row = store.last_checkpoint(run.run_id, kind)
            # Another user's run shows only what its owner published.
            if row is not None and (run.owner == user or row.public):
                body[key] = checkpoint_json(row)
        return body

    @app.get("/api/v1/training_runs")
    async def list_training_runs() -> Response:
        user = caller(services)
        limit = int_arg("limit", 20, 1, 1000)
        offset = int_arg("offset", 0, 0, 10**9)
        runs, total = store.list_runs(user, limit, offset, accessible=_access_scope() == "accessible")
        return json_response(
            {
                "training_runs": [run_json(r, user) for r in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total},
            }
        )

    @app.get("/api/v1/training_runs/<run_id>")
    async def get_training_run(run_id: str) -> Response:
        user = caller(services)
        run = accessible_run(user, run_id) if _access_scope() == "accessible" else own_run(user, run_id)
        return json_response(run_json(run, user))

    @app.get("/api/v1/training_runs/<run_id>/checkpoints")
    async def list_checkpoints(run_id: str) -> Response:
        own_run(caller(services), run_id)
        rows = store.list_checkpoints(run_id)
        return json_response(
            {
                "checkpoints": [checkpoint_json(r) for r in rows],
                "cursor": {"offset": 0, "limit": len(rows), "total_count": len(rows)},
            }
        )

    @app.delete("/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>")
    async def delete_checkpoint(run_id: str, kind: str, name: str) -> Response:
        own_run(caller(services), run_id)
        path = ids.TinkerPath.of(run_id, kind, name)
        if store.get_checkpoint(path.run_id, path.kind, path.name) is None:
            raise NotFound(f"no checkpoint {path.uri}")
        await services.checkpoints.delete(path.run_id, path.kind, path.name)
        store.record_audit(
            caller(services), "checkpoint_deleted", {"tinker_path": path.uri, "model_id": path.run_id, "actor": caller(services)}
        )
        return json_response({})

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints() -> Response:
        user = caller(services)
        limit = int_arg("limit", 100, 1, 10000)
        offset = int_arg("offset", 0, 0, 10**9)
        rows, total = store.list_user_checkpoints(user, limit, offset)
        return json_response(
            {
                "checkpoints": [checkpoint_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total},
            }
        )

    @app.post("/api/v1/weights_info")
    async def weights_info() -> Response:
        user = caller(services)
        req = wire.decode_json(await request.get_data(), wire.WeightsInfoRequest)
        path = ids.parse_tinker_path(req.tinker_path)
        # On a shared checkpoint root, one another node wrote is adopted first.
        row = store.get_checkpoint(path.run_id, path.kind, path.name) or store.adopt_checkpoint(path)
        if row is None or (row.owner != user and not row.public):
            raise NotFound(f"no checkpoint {path.uri}")
        run = store.get_run(path.run_id)
        assert run is not None
        lora = run.lora or {}
        return json_response(
            {
                "base_model": run.base_model,
                "is_lora": run.is_lora,
                "optimizer_config": run.optimizer_config,
                "lora_rank": run.lora_rank,
                "train_unembed": lora.get("train_unembed", True),
                "train_mlp": lora.get("train_mlp", True),
                "train_attn": lora.get("train_attn", True),
            }
        )

    @app.get("/api/v1/sessions")
    async def list_sessions() -> Response:
        user = caller(services)
        limit = int_arg("limit", 20, 1, 1000)
        offset = int_arg("offset", 0, 0, 10**9)
        return json_response({"sessions": [s.session_id for s in store.list_sessions(user, limit, offset)]})

    @app.get("/api/v1/sessions/<session_id>")
    async def get_session(session_id: str) -> Response:
        user = caller(services)
        row = store.get_session(session_id)
        if row is None or row.owner != user:
            raise NotFound(f"no session {session_id!r}")
        body: dict[str, Any] = {
            "training_run_ids": store.session_runs(session_id),
            "sampler_ids": store.session_samplers(session_id),
            "user_metadata": row.user_metadata,
        }
        if row.display_name is not None:
            body["display_name"] = row.display_name
        return json_response(body)
