"""The job registry: ownership, seq_id de-duplication and the settings hand-off (pure, no trio)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openrld import settings as job_settings
from openrld.actors.job_registry import (
    NO_IMAGES,
    SEQ_MEMORY,
    TOUCH_EVERY_S,
    Images,
    Job,
    JobRegistry,
    check_lora_rank,
    full_group_of,
    full_sync_of,
    images_of,
    optimizer_family,
    require_full_optimizer,
    resumed_optimizer_config,
    session_of,
)
from openrld.batches import LoraSpec
from openrld.errors import BadRequest
from openrld.model_catalog import ModelEntry

TINY = ModelEntry(name="tiny-llama", directory="/m/tiny", arch="llama", max_context=128)
LORA = LoraSpec(rank=8)


def job(model_id: str = "s-1:train:0", owner: str = "alice", **kwargs) -> Job:
    return Job(model_id, owner, TINY, LORA, **kwargs)


def settings(*tags: str) -> job_settings.JobSettings:
    parsed, _ = job_settings.parse_settings(list(tags), {}, {})
    return parsed


def test_the_registry_imports_neither_trio_nor_the_store():
    code = "import sys, openrld.actors.job_registry; print(sorted({'trio', 'openrld.store'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


# ---------------------------------------------------------------- ownership


def test_owned_returns_the_owners_job():
    registry = JobRegistry()
    alices = job()
    registry.add(alices)
    assert registry.owned("alice", "s-1:train:0") is alices


def test_another_users_job_is_absent():
    registry = JobRegistry()
    registry.add(job())
    assert registry.owned("bob", "s-1:train:0") is None


def test_an_unknown_model_is_absent_and_not_running():
    registry = JobRegistry()
    assert (registry.owned("alice", "s-1:train:9"), registry.is_running("s-1:train:9")) == (None, False)


def test_an_added_job_is_running():
    registry = JobRegistry()
    registry.add(job())
    assert registry.is_running("s-1:train:0") is True


# ---------------------------------------------------------------- seq_id de-duplication


def test_a_retried_seq_id_returns_the_first_request():
    j = job()
    j.remember(3, "req-a")
    assert j.first_request(3) == "req-a"


def test_an_unseen_seq_id_has_no_first_request():
    j = job()
    j.remember(3, "req-a")
    assert j.first_request(4) is None


def test_past_seq_memory_the_oldest_seq_id_is_forgotten():
    j = job()
    for seq_id in range(SEQ_MEMORY + 1):  # seq_ids 0..4096: one over the memory
        j.remember(seq_id, f"req-{seq_id}")
    assert (j.first_request(0), j.first_request(1), len(j.requests)) == (None, "req-1", SEQ_MEMORY)


def test_a_run_is_touched_at_most_once_per_touch_interval():
    j = job()
    # first request at t=10 writes; t=10.5 is within TOUCH_EVERY_S (1 s); t=11 is exactly 1 s later and writes.
    assert [j.is_due_for_touch(t) for t in (10.0, 10.5, 10.0 + TOUCH_EVERY_S)] == [True, False, True]


# ---------------------------------------------------------------- groups


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, None),
        ({"full_sync": "delta"}, "s-1:train:0"),
        ({"is_exclusive": True}, "s-1:train:0"),
        ({"images": Images(trainer="registry.example/t:1")}, "s-1:train:0"),
    ],
    ids=["lora-shares-its-base-models-group", "full", "exclusive", "image"],
)
def test_group_job_names_the_jobs_own_group_when_it_has_one(kwargs, expected):
    assert job(**kwargs).group_job == expected


def test_ending_a_session_removes_its_jobs_on_any_group_and_no_other_sessions():
    registry = JobRegistry()
    registry.add(job("s-1:train:0"))  # LoRA on the shared group: ends
    registry.add(job("s-1:train:1", full_sync="full"))  # ends
    registry.add(job("s-2:train:0", is_exclusive=True))  # another session's: stays
    ended = registry.remove_jobs_of("s-1")
    assert ([j.model_id for j in ended], sorted(j.model_id for j in registry)) == (
        ["s-1:train:0", "s-1:train:1"], ["s-2:train:0"],
    )


def test_session_of_is_the_id_before_the_first_colon():
    assert (session_of("s-1:train:4"), session_of("s-1:sample:2")) == ("s-1", "s-1")


def test_a_runs_checkpoints_sample_on_its_own_group_only_when_it_is_full():
    assert (full_group_of(None, "s-1:train:0"), full_group_of({"rank": 8}, "s-1:train:0")) == ("s-1:train:0", None)


# ---------------------------------------------------------------- settings hand-off


def test_a_lora_job_has_no_full_sync():
    assert full_sync_of(settings()) is None


def test_a_full_job_syncs_by_delta_unless_told():
    assert full_sync_of(settings("openrl.fine_tuning_type=full")) == "delta"


def test_a_full_job_takes_its_weight_sync():
    assert full_sync_of(settings("openrl.fine_tuning_type=full", "openrl.weight_sync=full")) == "full"


def test_no_backend_images_is_no_images():
    assert images_of(settings(), ()) == NO_IMAGES


def test_an_allowed_trainer_image_is_the_jobs():
    parsed = settings("openrl.trainer_backend=registry.example/trainer:1")
    assert images_of(parsed, ("registry.example/*",)) == Images(trainer="registry.example/trainer:1")


def test_an_image_off_the_allow_list_is_400_naming_its_key():
    parsed = settings("openrl.sampler_backend=elsewhere.example/sampler:1")
    with pytest.raises(BadRequest) as caught:
        images_of(parsed, ("registry.example/*",))
    assert caught.value.key == "openrl.sampler_backend"


def test_lora_ranks_from_1_to_the_nodes_max_pass_and_no_others():
    def refused(rank: int) -> bool:
        try:
            check_lora_rank(LoraSpec(rank=rank), 32)
        except BadRequest:
            return True
        return False

    assert [rank for rank in (0, 1, 32, 33) if refused(rank)] == [0, 33]


@pytest.mark.parametrize("rank", [0, 33], ids=["zero", "over-the-max"])
def test_a_lora_rank_outside_the_nodes_max_is_400_with_the_range(rank):
    with pytest.raises(BadRequest) as caught:
        check_lora_rank(LoraSpec(rank=rank), 32)
    assert caught.value.detail == f"lora_config.rank: expected 1..32, got {rank}"


def test_the_optimizer_family_defaults_to_adamw():
    assert (optimizer_family({}), optimizer_family({"type": "dimuon"})) == ("adamw", "dimuon")


def test_a_full_job_is_refused_dimuon_naming_optimizer_config():
    with pytest.raises(BadRequest) as caught:
        require_full_optimizer({"type": "dimuon"})
    assert caught.value.key == "optimizer_config"


def test_a_restore_without_optimizer_state_takes_the_requested_optimizer():
    assert resumed_optimizer_config("tinker://r/weights/a", {"type": "adamw"}, {"type": "dimuon"}, False) == {
        "type": "dimuon"
    }


def test_a_restore_without_optimizer_state_or_request_is_adamw():
    assert resumed_optimizer_config("tinker://r/weights/a", {"type": "dimuon"}, None, False) == {"type": "adamw"}


def test_a_restore_with_optimizer_state_keeps_the_checkpoints():
    stored = {"type": "dimuon", "lr_scale": 0.5}
    assert resumed_optimizer_config("tinker://r/weights/a", stored, None, True) == stored


def test_a_restore_with_state_refuses_another_family_naming_optimizer_config():
    with pytest.raises(BadRequest) as caught:
        resumed_optimizer_config("tinker://r/weights/a", {"type": "adamw"}, {"type": "dimuon"}, True)
    assert caught.value.key == "optimizer_config"
