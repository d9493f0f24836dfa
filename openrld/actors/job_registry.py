"""The job registry: the training jobs resident on this node, and how a new job's settings shape it.

It owns, per job: who owns it, which group serves it (the base model's shared
LoRA group, or a group of its own), and the `seq_id -> request_id` memory that
makes a retried submission answer with its first future (the last
`SEQ_MEMORY` seq_ids per job). It also owns the hand-off from parsed
`openrl.*` settings (settings.py) to a job's shape: its weight sync, its
images, and the optimizer a new or restored job trains with.

It is pure: sync, no trio, no store, no I/O; time is passed in (`now`). The job
table (actors/jobs.py) submits ops to groups, `JobOpening` (actors/job_opening.py)
records runs in the store, `GoneJobs` (actors/gone_jobs.py) explains a missing
job (404 or 410); this module only answers what it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from openrld import settings as job_settings
from openrld.batches import LoraSpec
from openrld.errors import BadRequest
from openrld.model_catalog import ModelEntry
from openrld.worker.images import check_image_allowed

if TYPE_CHECKING:
    from openrld.store.job_claims import Claim

SEQ_MEMORY = 4096  # how many past seq_ids per job still answer a retry with their first future
TOUCH_EVERY_S = 1.0  # how stale a run's last_request_time may be; spares the store a write per request


class Images(msgspec.Struct, frozen=True):
    """The container images a job's own group runs its workers from (openrl.*_backend); None: built in."""

    trainer: str | None = None
    sampler: str | None = None

    @property
    def any(self) -> bool:
        return self.trainer is not None or self.sampler is not None


NO_IMAGES = Images()


class Automodel(msgspec.Struct, frozen=True):
    """openrl.trainer_backend=automodel: the job's trainer is NeMo Automodel's FSDP2 trainer, a
    torchrun group of `gpus` ranks on devices of the job's own, sequences split over `cp` of them."""

    gpus: int = 1
    cp: int = 1


class Job:
    """One resident training job (a Tinker model id)."""

    __slots__ = (
        "model_id", "owner", "model", "lora", "requests", "touched_at", "sampler_replicas", "full_sync", "is_exclusive",
        "images", "automodel", "autosave_steps", "adoption",
    )

    def __init__(
        self, model_id: str, owner: str, model: ModelEntry, lora: LoraSpec | None, sampler_replicas: int = 1,
        full_sync: str | None = None, is_exclusive: bool = False, images: Images = NO_IMAGES,
        automodel: Automodel | None = None,
    ) -> None:
        self.is_exclusive = is_exclusive  # openrl.exclusive: a group of its own on devices of its own
        # openrl.trainer_backend / sampler_backend=<image>: a group of its own, running them
        self.images = images
        self.automodel = automodel  # openrl.trainer_backend=automodel: a group of its own, its trainer a torchrun group
        self.model_id = model_id
        self.owner = owner
        self.model = model
        self.lora = lora  # None: full fine-tuning
        # Full fine-tuning: its weight_sync ("delta" or "full"); the job has a group of its own.
        self.full_sync = full_sync
        self.sampler_replicas = sampler_replicas  # openrl.sampler_replicas; its group runs at least this many
        self.requests: dict[int, str] = {}  # seq_id -> request_id, the last SEQ_MEMORY of them
        self.touched_at = float("-inf")  # when the store last heard of a request (seconds, trio's clock)
        # openrl.autosave_steps on a shared checkpoint root (0: none): a survivor can adopt the job if this node dies
        self.autosave_steps = 0
        # The claim by which this node holds the job, when it adopted it from a dead node (cluster/adoption.py)
        self.adoption: Claim | None = None

    def remember(self, seq_id: int, request_id: str) -> None:
        """`seq_id` was answered with `request_id`; the oldest seq_id past SEQ_MEMORY is forgotten."""
        self.requests[seq_id] = request_id
        if len(self.requests) > SEQ_MEMORY:
            del self.requests[min(self.requests)]

    def first_request(self, seq_id: int) -> str | None:
        """The request that first answered `seq_id`, if it is still remembered."""
        return self.requests.get(seq_id)

    @property
    def claim_generation(self) -> int:
        """The claim by which this node holds the job: 0 when it created it here."""
        return self.adoption.generation if self.adoption is not None else 0

    def is_due_for_touch(self, now: float) -> bool:
        """Whether the run's last_request_time should be written at `now`; if so, it counts as written."""
        if now - self.touched_at < TOUCH_EVERY_S:
            return False
        self.touched_at = now
        return True

    @property
    def group_job(self) -> str | None:
        """The key of the job's own group (full fine-tuning, exclusive, an image or Automodel), else None (its
        base model's LoRA group)."""
        has_own = self.full_sync is not None or self.is_exclusive or self.images.any or self.automodel is not None
        return self.model_id if has_own else None


class JobRegistry:
    """The resident jobs by model id. Lookups take the caller's user: another user's job is absent."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        self._jobs[job.model_id] = job

    def get(self, model_id: str) -> Job | None:
        return self._jobs.get(model_id)

    def owned(self, owner: str, model_id: str) -> Job | None:
        """The job `model_id` if it is resident and `owner`'s, else None."""
        job = self._jobs.get(model_id)
        return job if job is not None and job.owner == owner else None

    def is_running(self, model_id: str) -> bool:
        """Whether the job `model_id` runs on this node now."""
        return model_id in self._jobs

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def __len__(self) -> int:
        return len(self._jobs)

    def remove(self, model_id: str) -> Job | None:
        """Remove and return the job `model_id`; None when it is not resident."""
        return self._jobs.pop(model_id, None)

    def remove_jobs_of(self, session_id: str) -> list[Job]:
        """Remove and return the session's jobs (it finished)."""
        ending = [j for j in self._jobs.values() if session_of(j.model_id) == session_id]
        for job in ending:
            del self._jobs[job.model_id]
        return ending


def session_of(model_or_sampler_id: str) -> str:
    """The ServiceClient session of a model id ("<s>:train:<n>") or sampling session id ("<s>:sample:<n>")."""
    return model_or_sampler_id.split(":", 1)[0]


# ---------------------------------------------------------------- settings hand-off


def full_sync_of(settings: job_settings.JobSettings) -> str | None:
    """A full fine-tuning job's weight_sync ("delta" or "full"); None for a LoRA job."""
    if settings.fine_tuning_type is not job_settings.FineTuningType.FULL:
        return None
    return settings.weight_sync.value


def images_of(settings: job_settings.JobSettings, allowed_images: tuple[str, ...]) -> Images:
    """The job's trainer and sampler images, once the node's allow-list has let them through.

    Raises:
        BadRequest: an image matches no pattern of [workers] allowed_images (naming its key).
    """
    for key, image in (("trainer_backend", settings.trainer_image), ("sampler_backend", settings.sampler_image)):
        if image is not None:
            check_image_allowed(image, allowed_images, key=job_settings.PREFIX + key)
    return Images(settings.trainer_image, settings.sampler_image)


def automodel_of(settings: job_settings.JobSettings, *, available: bool) -> Automodel | None:
    """The job's Automodel trainer layout; None when its trainer_backend is another.

    Raises:
        BadRequest: automodel, and this node has no Automodel environment (naming the key).
    """
    if settings.trainer_backend != "automodel":
        return None
    if not available:
        raise BadRequest(
            f"{job_settings.PREFIX}trainer_backend=automodel: this node has no Automodel environment "
            "([workers] automodel_python is unset; `make automodel-env` builds one)",
            key=job_settings.PREFIX + "trainer_backend",
        )
    return Automodel(gpus=settings.trainer_gpus, cp=settings.trainer_cp)


def check_lora_rank(lora: LoraSpec, max_lora_rank: int) -> None:
    """Raises BadRequest for a rank outside 1..max_lora_rank (the node's max_lora_rank)."""
    if not 1 <= lora.rank <= max_lora_rank:
        raise BadRequest(f"lora_config.rank: expected 1..{max_lora_rank}, got {lora.rank}")


def full_group_of(run_lora: Any, run_id: str) -> str | None:
    """The group that samples a run's checkpoints: the run's own when it trained every weight (no LoRA)."""
    return run_id if run_lora is None else None


def optimizer_family(config: dict[str, Any]) -> str:
    """"adamw" or "dimuon" from a stored optimizer_config (api/wire.py validated it)."""
    return str(config.get("type", "adamw"))


def require_full_optimizer(optimizer_config: dict[str, Any]) -> None:
    """Dimuon is defined on LoRA matrices, so a full job is refused it."""
    family = optimizer_family(optimizer_config)
    if family != "adamw":
        raise BadRequest(
            f"optimizer_config.type {family!r}: dimuon needs a LoRA model (openrl.fine_tuning_type=full trains with "
            f"adamw)",
            key="optimizer_config",
        )


def resumed_optimizer_config(
    path: str, stored: dict[str, Any], requested: dict[str, Any] | None, with_optimizer: bool
) -> dict[str, Any]:
    """The optimizer of a model created from a checkpoint.

    With optimizer state it is the checkpoint's, and a request for another family is an
    error; without, it is the requested one, else AdamW, whatever the checkpoint used.

    Raises:
        BadRequest: `requested` differs from the checkpoint's family while restoring its state.
    """
    if not with_optimizer:
        return dict(requested) if requested is not None else {"type": "adamw"}
    if requested is not None and optimizer_family(requested) != optimizer_family(stored):
        raise BadRequest(
            f"{path}: cannot override restored optimizer state: the checkpoint's optimizer_config is {stored}, "
            f"the request's is {requested}",
            key="optimizer_config",
        )
    return dict(stored)
