"""Adopting a dead node's job on this node, and giving up one that another node adopted.

A survivor that has claimed a dead member's auto-saved job (cluster/adoption.py
decides which survivor and writes the claim) takes it over here: the job's run
row and checkpoints from the shared root, the dead node's session record, its
group, and its trainer loaded from the newest auto-save with its step count,
its seq_ids going on after the auto-save's. The job is shaped as a create of
its settings would be (`JobOpening.shaped`), so a node that could not create
it says why and the next candidate takes it. The claims this node holds its
jobs by are listed here for the fence: a node that finds a newer claim on one
of them (it was declared dead and lived on) drops the job, and its later calls
fail naming the new home (gone_jobs.py). This is the `JobHost` the watcher in
cluster/adoption.py drives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from openrld import settings as job_settings
from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.futures import Failed
from openrld.actors.job_opening import JobOpening, NodeTables
from openrld.actors.job_registry import Job, optimizer_family
from openrld.actors.trainer import LoadState
from openrld.autosave import Autosave, AutosaveManifest
from openrld.batches import LoraSpec
from openrld.errors import Conflict, Gone, UserError
from openrld.store.job_claims import Claim

logger = logging.getLogger(__name__)


class JobAdoption:
    """Takes over claimed jobs and gives up superseded ones; see the module docstring."""

    def __init__(
        self,
        node: NodeTables,
        *,
        opening: JobOpening,
        checkpoints: CheckpointWriter | None = None,
        on_adopted: Callable[[str, int], None] | None = None,
    ) -> None:
        self._node = node
        self._opening = opening  # shapes the job and books its own group, as a create would
        self._checkpoints = checkpoints  # adopting a run's checkpoints from a shared root, files in its threads
        self._on_adopted = on_adopted  # (model id, step) of a job adopted here: its curve goes on from its step

    def is_running(self, model_id: str) -> bool:
        """Whether the job `model_id` runs on this node now."""
        return self._node.registry.is_running(model_id)

    def refusal(self, autosave: Autosave) -> str | None:
        """Why this node cannot hold the job of `autosave` (its base model, its engines); None if it can."""
        try:
            self._adopted_job(autosave.manifest)
        except UserError as error:
            return error.detail
        return None

    def _adopted_job(self, manifest: AutosaveManifest) -> Job:
        """The job an auto-save describes, shaped here as a create of its settings would be.

        Raises:
            UserError: this node cannot hold it (its base model, an image, an engine), as a create would be refused.
        """
        run = manifest.run
        settings = job_settings.settings_from_dict(run.settings)
        lora = msgspec.convert(run.lora, LoraSpec) if run.lora is not None else None
        model = self._node.catalog.resolve(run.base_model)
        return self._opening.shaped(manifest.model_id, run.owner, model, lora, settings)

    async def adopt(self, autosave: Autosave, claim: Claim) -> None:
        """Take job `autosave.manifest.model_id` over from the dead node `claim.previous_home`, which this
        node has claimed: its run's row and checkpoints from the shared root, its group, and its trainer
        loaded from the auto-save with its step count, its seq_ids going on after the auto-save's.
        Returns once the state is loaded; the job is resident from the load on.

        Raises:
            OpenrldError: the group could not start or the load failed (the job stays lost, logged).
        """
        manifest = autosave.manifest
        model_id = manifest.model_id
        job = self._adopted_job(manifest)
        job.adoption = claim
        if self._node.store.adoption.insert_job_run(manifest.run) is None:
            raise Conflict(f"model {model_id}: this node holds a run of that id of another owner")
        self._node.sessions.mirror_adopted(manifest.run.session_id, manifest.run.owner)
        rewritten: set[tuple[str, str]] = set()
        if self._checkpoints is not None:
            await self._checkpoints.adopt_run(model_id)  # its checkpoints on the root, for its status and restores
            # Saves of the steps recomputed here: their replays write them again instead of being refused.
            rewritten = self._checkpoints.written_after(model_id, manifest.created_at)
        await self._node.commits.durable()
        own_group = job.group_job is not None
        if own_group:
            self._opening.book_own_group(job)
        try:
            group = await self._node.groups.get(job.model, job.group_job, job.full_sync or "delta")
            await group.sampler.ensure_replicas(job.sampler_replicas)
            request_id = self._node.new_request(job.owner, model_id, "load_weights")
            group.trainer.open_job(model_id, next_seq=manifest.seq_id, rewritten=rewritten)
            group.trainer.submit_nowait(
                LoadState(
                    model_id=model_id, request_id=request_id, source_dir=str(autosave.directory),
                    source_uri=f"the auto-save of step {manifest.step}", spec=job.lora, with_optimizer=True,
                    seq_id=manifest.seq_id, optimizer=optimizer_family(manifest.run.optimizer_config),
                    optim_steps=manifest.step,
                )
            )
        except BaseException:
            if own_group:
                self._node.groups.end(job.model, model_id, f"model {model_id} could not be adopted")
            raise
        # The auto-save's own seq_id is not remembered: a request of it replayed here (replay.py) is refused
        # as already applied, never answered with the load's future.
        self._node.gone.forget(model_id)
        if self._on_adopted is not None:
            self._on_adopted(model_id, manifest.step)
        self._node.registry.add(job)
        outcome = None
        while outcome is None:
            outcome = await self._node.futures.wait(request_id, owner=job.owner, hold_s=60.0)
        if isinstance(outcome, Failed):
            self._node.gone.drop(job, f"model {model_id} could not be adopted from its auto-save: {outcome.detail}")
            raise Gone(outcome.detail)
        logger.info("adopted model_id=%s %s generation=%d", model_id, claim.detail, claim.generation)

    def claimed_jobs(self) -> list[tuple[str, int]]:
        """(model id, the generation of the claim this node holds it by) of its jobs that auto-save."""
        return [(job.model_id, job.claim_generation) for job in self._node.registry if job.autosave_steps > 0]

    def superseded(self, model_id: str, claim: Claim) -> None:
        """Another node has claimed job `model_id` (this node was declared dead): it stops here; its later
        calls here fail naming its new home."""
        job = self._node.registry.get(model_id)
        if job is not None:
            self._node.gone.drop(job, f"model {model_id} moved to node {claim.adopter} ({claim.detail}): its calls go there now")
