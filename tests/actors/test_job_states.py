"""The job state the model status API reports, from its group's statistics (pure)."""

from __future__ import annotations

import msgspec

from openrld.actors.device_pool import Placement
from openrld.actors.model_status import (
    AdoptedFrom,
    GroupView,
    JobFacts,
    JobState,
    adopted_from,
    build_status,
    lost_status,
)
from openrld.actors.sampler import SamplerStatistics
from openrld.actors.timeslicer import LeaseState, WorkerLeaseStatistics
from openrld.actors.trainer import JobProgress, JobQueueStats, TrainerStatistics
from openrld.batches import SyncStats
from openrld.cluster.membership.messages import JobNote
from openrld.store.job_claims import Claim

MODEL_ID = "s-1:train:0"
JOB = JobFacts(MODEL_ID, "tiny-llama", "lora", False, True, None)
PLACED = Placement("/m/tiny", "cpu:0", "cpu:0", False)


def lease(state: LeaseState, parks: int = 0) -> WorkerLeaseStatistics:
    return WorkerLeaseStatistics("tiny-llama trainer", "tiny-llama", state, 1.5, 3, parks, 0)


def trainer(*, waiting: int = 0, running: str | None = None, state: LeaseState = LeaseState.RESIDENT,
            progress: tuple[JobProgress, ...] = ()) -> TrainerStatistics:
    return TrainerStatistics(
        jobs=[JobQueueStats(MODEL_ID, 3, waiting)], ops_done=3, ops_failed=0, ops_combined=0, busy=running is not None,
        device="cpu:0", lease=lease(state), progress=list(progress), running_job=running,
    )


def sampler(*, waiting: int = 0, running: int = 0) -> SamplerStatistics:
    return SamplerStatistics(
        queue_depth=waiting + running, waiting=waiting, running=running, replicas=1, loaded_versions=0,
        host_versions=0, samples_done=0, samples_failed=0, samples_cancelled=0, samples_refused=0, busy=running > 0,
    )


def state_of(job: JobFacts, group: GroupView) -> tuple[JobState, str | None]:
    status = build_status(job, group)
    return status.state, status.waiting_for


def test_a_loading_group_says_which_model_it_loads_and_where():
    group = GroupView(True, None, PLACED, None, None)
    assert state_of(JOB, group) == (JobState.LOADING_WEIGHTS, "base model tiny-llama to load onto cpu:0")
    assert [(w.role, w.state, w.device) for w in build_status(JOB, group).workers] == [
        ("trainer", "loading_weights", "cpu:0"), ("sampler", "loading_weights", "cpu:0"),
    ]


def test_a_job_not_yet_placed_waits_for_a_device():
    assert state_of(JOB, GroupView(False, None, None, None, None)) == (
        JobState.WAITING_FOR_PLACEMENT, "a device for its trainer and sampler",
    )


def test_a_failed_group_start_is_failed_with_its_error():
    status = build_status(JOB, GroupView(False, "OSError: no config.json", PLACED, None, None))
    assert (status.state, status.last_error) == (JobState.FAILED, "OSError: no config.json")


def test_a_job_gone_with_a_restart_is_lost_and_names_its_last_checkpoint():
    job = JobFacts(MODEL_ID, "tiny-llama", "lora", False, False, f"tinker://{MODEL_ID}/weights/step-4")
    status = build_status(job, GroupView(False, None, None, None, None))
    assert (status.state, status.waiting_for, status.workers) == (
        JobState.LOST,
        f"a restore with create_training_client_from_state (last checkpoint: tinker://{MODEL_ID}/weights/step-4)",
        [],
    )


def test_a_job_whose_home_node_is_lost_is_lost_with_what_its_home_gossiped():
    status = lost_status(MODEL_ID, JobNote("alice", "tiny-llama", "full", True, f"tinker://{MODEL_ID}/weights/step-4"))
    assert (status.base_model, status.fine_tuning_type, status.is_exclusive, status.state, status.last_checkpoint) == (
        "tiny-llama", "full", True, JobState.LOST, f"tinker://{MODEL_ID}/weights/step-4",
    )
    assert lost_status(MODEL_ID, JobNote("alice", "tiny-llama", "lora", False)).last_checkpoint is None


def test_a_lost_job_that_auto_saves_waits_for_its_adopter():
    status = lost_status(MODEL_ID, JobNote("alice", "tiny-llama", "lora", False, "", autosave_steps=1))
    assert (status.state, status.waiting_for) == (
        JobState.LOST, "a surviving node to adopt it from its auto-save on the shared checkpoint root"
    )


def test_an_adopted_job_says_where_it_came_from():
    claim = Claim(
        format=1, model_id=MODEL_ID, generation=1, adopter="node-c", previous_home="node-b", step=4, seq_id=8,
        claimed_at=0.0,
    )
    job = msgspec.structs.replace(JOB, adopted_from=adopted_from(claim))
    status = build_status(job, GroupView(False, None, PLACED, trainer(), sampler()))
    assert status.adopted_from == AdoptedFrom("node-b", 4, 1, "adopted from node node-b at step 4")


def test_queued_ops_of_a_parked_trainer_wait_for_a_turn():
    group = GroupView(False, None, PLACED, trainer(waiting=2, state=LeaseState.WAITING), sampler(running=1))
    assert state_of(JOB, group) == (JobState.PARKED, "a turn on cpu:0, which another worker holds")


def test_running_ops_are_training_and_running_samples_are_sampling():
    training = GroupView(False, None, PLACED, trainer(running=MODEL_ID, state=LeaseState.RUNNING), sampler())
    sampling = GroupView(False, None, PLACED, trainer(), sampler(running=2))
    assert (state_of(JOB, training)[0], state_of(JOB, sampling)[0]) == (JobState.TRAINING, JobState.SAMPLING)


def test_an_idle_job_is_ready_with_its_step_version_and_error():
    progress = JobProgress(MODEL_ID, 7, "tinker://s-1:train:0/sampler_weights/v7", "target_tokens: too long")
    status = build_status(JOB, GroupView(False, None, PLACED, trainer(progress=(progress,)), sampler()))
    assert (status.state, status.step, status.sampler_weight_version, status.last_error, status.last_sync) == (
        JobState.READY, 7, "tinker://s-1:train:0/sampler_weights/v7", "target_tokens: too long", None,
    )


def test_the_samplers_record_of_the_last_sync_wins_for_its_apply_time():
    trainer_side = SyncStats("delta", 0.12, 4096, 65536, 0, 0.5)
    sampler_side = SyncStats("delta", 0.12, 4096, 65536, 0, 0.5, apply_s=0.25)
    group = GroupView(
        False, None, PLACED,
        msgspec.structs.replace(trainer(), last_sync=trainer_side),
        msgspec.structs.replace(sampler(), last_sync=sampler_side),
    )
    assert build_status(JOB, group).last_sync == sampler_side


def test_a_trainer_on_several_devices_is_listed_once_per_rank_in_rank_order():
    spread = Placement("s-1:train:0", "cpu:0", "cpu:2", True, ("cpu:0", "cpu:1"))
    status = build_status(JOB, GroupView(False, None, spread, trainer(), sampler()))
    assert [(w.role, w.rank, w.device, w.state) for w in status.workers] == [
        ("trainer", 0, "cpu:0", "resident"), ("trainer", 1, "cpu:1", "resident"), ("sampler", 0, "cpu:2", "resident"),
    ]
