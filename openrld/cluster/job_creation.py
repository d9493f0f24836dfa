"""Requests that create a job where the cluster places it, rather than where an id says it lives.

`create_model`, a sampling session of a base model asked of a node that takes
no jobs, and a restore from a checkpoint whose run's home is lost have no
home yet: the job they create goes to a node the placer ranks (`placement/`).
This module turns such a request into the job's needs (its settings and base
model, read the way the node that takes it will read them), refuses one that
no node could ever hold, and offers the request to the ranked nodes in turn
(`reach.py` goes there) until one takes it. Requests with a home, and the
bookkeeping of what a placed job's creation leaves behind (the directory's
record, the replay of a sampler's creation), are the relay's (`relay.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from openrld import ids, settings as job_settings
from openrld.api import wire
from openrld.api.asgi import Reply, detail_reply
from openrld.api.fastpath import NO_CAPACITY_HEADER
from openrld.cluster.body_ids import Call, Ids
from openrld.cluster.directory import Directory
from openrld.cluster.membership.table import Member
from openrld.cluster.placement import ClusterPlacer, JobNeeds, Reply as Offered, needs_of_note, needs_of_settings
from openrld.cluster.reach import Reach
from openrld.errors import UserError

if TYPE_CHECKING:
    from openrld.cluster.membership.messages import JobNote
    from openrld.cluster.relayed_session import SessionSnapshot


class JobCreation:
    """Places job-creating requests on the ranked nodes; see the module docstring."""

    def __init__(
        self,
        *,
        reach: Reach,
        directory: Directory,
        placement: ClusterPlacer[Reply],
        session_snapshot: Callable[[str], SessionSnapshot | None],
        resolve_model: Callable[[str], str],
        accept_jobs: bool,
    ) -> None:
        self._reach = reach  # to an offered node and back
        self._directory = directory
        self._placement = placement  # ranks the nodes and keeps the offer round
        self._session_snapshot = session_snapshot  # the caller's session, whose tags are the job's settings
        self._resolve_model = resolve_model
        self._accept_jobs = accept_jobs  # whether this node may take a job itself

    async def create_model(self, call: Call) -> Reply | None:
        """create_model: offer the job to the ranked nodes until one takes it."""
        try:
            req = msgspec.json.decode(call.body, type=wire.CreateModelRequest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # this node's app says what is wrong with it
        call = replace(call, session_id=req.session_id)
        session = self._session_snapshot(req.session_id)
        if session is None:
            return await self._reach.to(call, self._directory.tagged(req.session_id), req.session_id)
        try:
            settings, _ = job_settings.parse_settings(
                session.tags, session.user_metadata, {str(k): str(v) for k, v in (req.user_metadata or {}).items()}
            )
            base_model = self._resolve_model(req.base_model)
        except UserError:
            return None  # this node's app refuses it with the same message, before placing anything
        needs = needs_of_settings(settings, base_model)
        refusal = self._placement.too_large(needs)
        if refusal is not None:
            return detail_reply(400, refusal)
        return await self._offer(call, needs, ids.model_id(req.session_id, req.model_seq_id))

    async def base_model_sampler(self, call: Call, ref: Ids, sampler_id: str) -> Reply | None:
        """A sampling session of a base model: here, unless this node takes no jobs; then placed like a LoRA job."""
        if self._accept_jobs or ref.base_model is None:
            return None
        try:
            base_model = self._resolve_model(ref.base_model)
        except UserError:
            return None
        return await self._offer(call, JobNeeds(base_model=base_model, own_group=False, is_exclusive=False), sampler_id)

    async def restore(self, call: Call, session_id: str, model_seq_id: int, note: JobNote | None) -> Reply | None:
        """create_training_client_from_state whose run's home is lost: placed anew like create_model, with
        the needs the lost job's note recorded (the node that takes it reads the checkpoint from the shared root)."""
        if self._session_snapshot(session_id) is None:
            return await self._reach.to(call, self._directory.tagged(session_id), session_id)
        return await self._offer(call, needs_of_note(note), ids.model_id(session_id, model_seq_id))

    async def _offer(self, call: Call, needs: JobNeeds, created_id: str) -> Reply | None:
        """Offer a job-creating request to the ranked nodes in turn; the first that has room answers."""

        async def ask(member: Member) -> tuple[Offered, Reply]:
            if member.name == self._directory.local_name:
                answer = await self._reach.local(call.scope, call.body)
            else:
                answer = await self._reach.forward(call, member, created_id)
            if answer.header(NO_CAPACITY_HEADER) is not None:
                return Offered.NO_ROOM, answer
            return (Offered.TAKEN if answer.status == 200 else Offered.FAILED), answer

        answer = await self._placement.offer(needs, created_id, ask)
        if answer is not None or self._accept_jobs:
            return answer
        return detail_reply(
            503, f"no node of the cluster can take {created_id} ({needs.base_model}) now: none has a free or shareable device"
        )
