"""The read-mostly REST routes: training runs, checkpoints and sessions (`/api/v1/...`).

A user sees their own runs and checkpoints, plus published checkpoints; any
other id answers 404, exactly as a missing one does, so ids leak nothing.
Checkpoint routes carry the checkpoint id (`<kind>/<name>`) as two segments.
Every reply is a `wire` Struct, so it goes out as `wire.py`'s tests check it:
fields at their default left out, never null.
"""

from __future__ import annotations

from typing import cast

from quart import request

from openrld import ids
from openrld.actors.checkpoints import CheckpointWriter
from openrld.api import wire
from openrld.api.app import Services, caller, request_body
from openrld.api.asgi import Reply, json_reply
from openrld.errors import BadRequest, NotFound
from openrld.store import CheckpointRow, RunRow

# ---------------------------------------------------------------- routes


async def list_training_runs(services: Services) -> Reply:
    user = caller(services)
    limit = int_arg("limit", 20, 1, 1000)
    offset = int_arg("offset", 0, 0, 10**9)
    runs, total = services.records.list_runs(user, limit, offset, accessible=_access_scope() == "accessible")
    return json_reply(
        wire.TrainingRunsResponse(
            training_runs=[training_run(services.checkpoints, r, user) for r in runs],
            cursor=wire.Cursor(offset=offset, limit=limit, total_count=total),
        )
    )


async def get_training_run(services: Services, run_id: str) -> Reply:
    user = caller(services)
    run = await (accessible_run if _access_scope() == "accessible" else own_run)(services, user, run_id)
    return json_reply(training_run(services.checkpoints, run, user))


async def list_checkpoints(services: Services, run_id: str) -> Reply:
    await own_run(services, caller(services), run_id)
    rows = services.checkpoints.of_run(run_id)
    return json_reply(
        wire.CheckpointsListResponse(
            checkpoints=[checkpoint(r) for r in rows],
            cursor=wire.Cursor(offset=0, limit=len(rows), total_count=len(rows)),
        )
    )


async def delete_checkpoint(services: Services, run_id: str, kind: str, name: str) -> Reply:
    user = caller(services)
    await own_run(services, user, run_id)
    await services.checkpoints.delete_as(user, ids.TinkerPath.of(run_id, kind, name))
    return json_reply(wire.EmptyResponse())


async def list_user_checkpoints(services: Services) -> Reply:
    user = caller(services)
    limit = int_arg("limit", 100, 1, 10000)
    offset = int_arg("offset", 0, 0, 10**9)
    rows, total = services.checkpoints.of_owner(user, limit, offset)
    return json_reply(
        wire.CheckpointsListResponse(
            checkpoints=[checkpoint(r) for r in rows],
            cursor=wire.Cursor(offset=offset, limit=limit, total_count=total),
        )
    )


async def weights_info(services: Services) -> Reply:
    user = caller(services)
    req = await request_body(services, wire.WeightsInfoRequest)
    path = ids.parse_tinker_path(req.tinker_path)
    await services.checkpoints.readable(user, path)  # on a shared root, one another node wrote is adopted first
    run = services.records.run(path.run_id)
    assert run is not None
    lora = run.lora or {}
    return json_reply(
        wire.WeightsInfoResponse(
            base_model=run.base_model,
            is_lora=run.is_lora,
            optimizer_config=run.optimizer_config,
            lora_rank=run.lora_rank,
            train_unembed=cast("bool | None", lora.get("train_unembed", True)),
            train_mlp=cast("bool | None", lora.get("train_mlp", True)),
            train_attn=cast("bool | None", lora.get("train_attn", True)),
        )
    )


async def list_sessions(services: Services) -> Reply:
    user = caller(services)
    limit = int_arg("limit", 20, 1, 1000)
    offset = int_arg("offset", 0, 0, 10**9)
    sessions = services.records.list_sessions(user, limit, offset)
    return json_reply(wire.ListSessionsResponse(sessions=[s.session_id for s in sessions]))


async def get_session(services: Services, session_id: str) -> Reply:
    row = services.records.own_session(caller(services), session_id)
    run_ids, sampler_ids = services.records.session_members(session_id)
    return json_reply(
        wire.GetSessionResponse(
            training_run_ids=run_ids,
            sampler_ids=sampler_ids,
            user_metadata=row.user_metadata,
            display_name=row.display_name,
        )
    )


# ---------------------------------------------------------------- lookups and wire forms


async def own_run(services: Services, user: str, run_id: str) -> RunRow:
    """The caller's run; anyone else's, or a missing one, is NotFound."""
    # On a shared checkpoint root, what other nodes saved of the run (a dead node's, say) is adopted first.
    run = await services.checkpoints.adopt_run(run_id) or services.records.run(run_id)
    if run is None or run.owner != user:
        raise NotFound(f"no training run {run_id!r}")
    return run


async def accessible_run(services: Services, user: str, run_id: str) -> RunRow:
    """The caller's run, or another user's run that has a published checkpoint."""
    run = await services.checkpoints.adopt_run(run_id) or services.records.run(run_id)
    if run is None or (run.owner != user and not services.records.has_public_checkpoint(run_id)):
        raise NotFound(f"no training run {run_id!r}")
    return run


def checkpoint(row: CheckpointRow) -> wire.Checkpoint:
    return wire.Checkpoint(
        checkpoint_id=row.checkpoint_id,
        checkpoint_type=cast("wire.CheckpointType", row.checkpoint_type),
        time=row.created_at,
        tinker_path=row.tinker_path,
        size_bytes=row.size_bytes,
        public=row.public,
        user_metadata=row.user_metadata,
        expires_at=row.expires_at,
    )


def training_run(checkpoints: CheckpointWriter, run: RunRow, user: str) -> wire.TrainingRun:
    """`run` as `user` may see it: another user's run shows only the checkpoints its owner published."""
    last: dict[str, wire.Checkpoint] = {}
    for kind in ("weights", "sampler_weights"):
        row = checkpoints.last(run.run_id, kind)
        if row is not None and (run.owner == user or row.public):
            last[kind] = checkpoint(row)
    return wire.TrainingRun(
        training_run_id=run.run_id,
        base_model=run.base_model,
        model_owner=run.owner,
        is_lora=run.is_lora,
        last_request_time=run.last_request_at,
        corrupted=run.corrupted,
        lora_rank=run.lora_rank,
        last_checkpoint=last.get("weights"),
        last_sampler_checkpoint=last.get("sampler_weights"),
        user_metadata=run.user_metadata,
    )


# ---------------------------------------------------------------- query arguments


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
