"""Why a job is not here: the jobs that ended on this node, and what a call for one is answered.

A job leaves this node in one of four ways: its session finished, its own
group's trainer engine was lost, another node adopted it (this node had been
declared dead), or its adoption here failed. A later call for it fails with
that reason (410); a run of this node's store that is not resident, and not
ended for one of these, was left behind by a restart, and its 410 points at a
restore from its last checkpoint; a model id that is not the caller's is a
404. The job table (jobs.py), the opening of a job (job_opening.py) and its
adoption (job_adoption.py) end jobs and look them up here, so that each reason
is written in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from openrld import ids
from openrld.actors.groups import GroupTable
from openrld.actors.job_registry import Job, JobRegistry
from openrld.actors.model_status import progress_of
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.trainer import JobProgress
from openrld.errors import Gone, NotFound
from openrld.store import Store
from openrld.store.job_claims import Claim


class EndedJob(msgspec.Struct, frozen=True):
    """What a job that ended here still reports in its status: the trainer's last word on it
    (its steps, its newest sampler weights, its last error) and the adoption that brought it here."""

    progress: JobProgress | None
    adoption: Claim | None


class GoneJobs:
    """The resident job a call names, or why there is none; see the module docstring."""

    def __init__(
        self,
        *,
        store: Store,
        registry: JobRegistry,
        sessions: SessionTable,
        sampling: SamplingSessions,
        groups: GroupTable,
        changed: Callable[[], None],
    ) -> None:
        self._store = store
        self._jobs = registry
        self._sessions = sessions
        self._sampling = sampling  # an ended job's unnamed sampler weights go with it
        self._groups = groups
        self._changed = changed  # a clustered node gossips at once that the job is no longer here
        self._lost: dict[str, str] = {}  # model_id -> why: jobs that ended here other than with their session
        self._ended: dict[str, EndedJob] = {}  # model_id -> what its status still says, for every job ended here

    def resident(self, owner: str, model_id: str) -> Job:
        """`owner`'s resident job `model_id`.

        Raises:
            Gone: the run is `owner`'s but its job is not resident (the reason it ended).
            NotFound: no such run, or not `owner`'s.
        """
        job = self._jobs.owned(owner, model_id)
        if job is not None:
            return job
        run = self._store.runs.get(model_id)
        if run is None or run.owner != owner:
            raise NotFound(f"no model {model_id!r}")
        if model_id in self._lost:
            raise Gone(self._lost[model_id])
        if self._sessions.is_finished(run.session_id):
            raise Gone(f"model {model_id} has stopped: its session {run.session_id} has finished")
        raise Gone(
            f"model {model_id} is not resident (the daemon restarted); resume it with "
            f"create_training_client_from_state from its last checkpoint"
        )

    def detail(self, model_id: str) -> str | None:
        """Why job `model_id` ended here, if it did (its status says so); None for one that did not."""
        return self._lost.get(model_id)

    def forget(self, model_id: str) -> None:
        """Job `model_id` is resident here again (adopted back): its old reason no longer holds."""
        self._lost.pop(model_id, None)

    def ended(self, model_id: str) -> EndedJob | None:
        """What job `model_id`, ended here, still reports; None for one that did not end here."""
        return self._ended.get(model_id)

    def own_group_lost(self, job: Job, detail: str) -> None:
        """The trainer engine of `job`'s own group was lost (its process, or a rank of it, died):
        the job is over, its group ends (freeing its devices), and its later calls fail with `detail`
        and the job's last checkpoint, what it resumes from (as a job lost with its node is told)."""
        if self._jobs.remove(job.model_id) is None:
            return  # already ended (its session finished)
        checkpoint = self._store.checkpoints.last(job.model_id, ids.CheckpointKind.WEIGHTS)
        restore = f"its last checkpoint is {checkpoint.tinker_path}" if checkpoint is not None else "it saved no checkpoint"
        self._lost[job.model_id] = f"{detail}; {restore}"
        self.end(job, detail)

    def drop(self, job: Job, detail: str) -> None:
        """`job` ends here: its later calls fail with `detail`, and it leaves its group (`end`)."""
        if self._jobs.remove(job.model_id) is None:
            return
        self._lost[job.model_id] = detail
        self.end(job, detail)
        self._changed()

    def end(self, job: Job, detail: str) -> None:
        """`job`, no longer resident, ends: what its status still says is kept (`ended`), its queued ops
        fail with `detail`, and its group lets it go. Its own group stops, freeing its devices, and its
        unnamed sampler weights go with it; on its base model's shared group, the group drops its adapter
        and the versions only it published."""
        group = self._groups.get_nowait(job.model, job.group_job)
        progress = progress_of(group.trainer.statistics(), job.model_id) if group is not None else None
        self._ended[job.model_id] = EndedJob(progress, job.adoption)
        if job.group_job is None:
            self._groups.end_shared_job(job.model, job.model_id, detail, self._sampling.drop_saved_by(job.model_id))
        else:
            self._sampling.drop_group(job.model_id)
            self._groups.end(job.model, job.model_id, detail)
