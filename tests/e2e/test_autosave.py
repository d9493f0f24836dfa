"""Auto-saves on a shared checkpoint root (issue 41, "state that survives the step").

A real daemon with a shared `checkpoint_root`, driven by the real tinker SDK: after each
optim_step of a LoRA job (unless it sets `openrl.autosave_steps`), its state is written under
<root>/.autosave/<model_id>/, the older ones pruned, none listed as the user's checkpoint; a
full fine-tuning job writes at its `openrl.autosave_steps` interval (tests/e2e/test_training_loop.py:
a node without a shared root writes none); a closed session's jobs lose theirs at the next
maintenance sweep; a daemon killed with SIGKILL leaves the newest auto-save and the user's checkpoints whole.
`openrld.autosave.latest_autosave` is the reader an adopter will call.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, write_config
from tinker import types
from waits import wait_for

from openrld.autosave import AUTOSAVE_DIR, latest_autosave, step_dir_name

API_KEY = "tml-test"
ADAM = types.AdamParams(learning_rate=1e-2)
COMMIT_WAIT_S = 30.0  # a commit is a rename and a few fsyncs of a tiny model's files
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(list(range(40, 59))), loss_fn_inputs={"target_tokens": list(range(41, 60))}
    )
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("autosave")


@pytest.fixture(scope="module")
def shared(root: Path) -> Path:
    path = root / "shared"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def node(root: Path, shared: Path, tiny_llama: Path):
    # A maintenance sweep every 0.2 s: a finished session's auto-saves go at the next one.
    extra = f'longpoll_s = 3.0\nmaintenance_interval_s = 0.2\ncheckpoint_root = "{shared}"'
    daemon = Daemon(root / "node", write_config(root / "node.toml", root / "node", {"tiny-llama": tiny_llama}, extra), root / "node.log")
    yield daemon.start()
    daemon.stop()


def _job(node: Daemon, **user_metadata: str) -> tinker.TrainingClient:
    """A LoRA job in a session of its own, auto-saved every step unless `user_metadata` says otherwise."""
    service = tinker.ServiceClient(base_url=node.url, api_key=API_KEY)
    return service.create_lora_training_client(
        base_model="tiny-llama", rank=4, seed=0, user_metadata=user_metadata
    ).result()


def _steps(training: tinker.TrainingClient, count: int) -> None:
    for _ in range(count):
        training.forward_backward(DATA, "cross_entropy").result()
        training.optim_step(ADAM).result()


def _step_dirs(shared: Path, model_id: str) -> list[str]:
    try:
        return sorted(os.listdir(shared / AUTOSAVE_DIR / model_id))
    except FileNotFoundError:
        return []


def _wait_for_step(shared: Path, model_id: str, step: int) -> None:
    """Until the job's auto-save at `step` is complete and the older ones pruned (the end of its commit)."""
    def landed() -> bool:
        latest = latest_autosave(shared, model_id)
        return latest is not None and latest.manifest.step == step and _step_dirs(shared, model_id) == [step_dir_name(step)]

    wait_for(landed, COMMIT_WAIT_S)


@pytest.fixture(scope="module")
def lora_job(node: Daemon, shared: Path):
    """A LoRA job that took 4 steps, then saved its state as "mine"."""
    training = _job(node)
    _steps(training, 4)
    saved = training.save_state("mine").result().path
    _wait_for_step(shared, training.model_id, 4)
    return training, saved


def test_lora_job_has_a_complete_auto_save_at_its_last_step_with_its_last_seq_id(lora_job, shared: Path):
    training, _ = lora_job
    latest = latest_autosave(shared, training.model_id)
    assert latest is not None
    manifest = latest.manifest
    # seq_ids: create_model 0, then each step's forward_backward and optim_step: step 4's optim_step is 8.
    assert (manifest.model_id, manifest.step, manifest.seq_id) == (training.model_id, 4, 8)
    assert (manifest.base_model, manifest.run.owner, manifest.run.run_id) == ("tiny-llama", "local", training.model_id)
    assert manifest.lora is not None and manifest.lora["rank"] == 4
    assert latest.directory == shared / AUTOSAVE_DIR / training.model_id / step_dir_name(4)


def test_the_auto_save_holds_the_state_save_state_writes_at_that_step(lora_job, shared: Path):
    """The same engine call writes both, so the files are the same bytes: what an adopter loads is the job."""
    training, _ = lora_job
    latest = latest_autosave(shared, training.model_id)
    assert latest is not None
    users = shared / training.model_id / "weights" / "mine"
    written = sorted(latest.manifest.files)
    assert written == sorted(name for name in os.listdir(users) if name != "checkpoint.json")
    assert "optimizer.safetensors" in written
    for name in written:
        assert (latest.directory / name).read_bytes() == (users / name).read_bytes(), name


def test_only_the_newest_auto_save_is_kept(lora_job, shared: Path):
    training, _ = lora_job  # its fixture waited for the commit of step 4, which prunes steps 1-3
    assert _step_dirs(shared, training.model_id) == [step_dir_name(4)]


def test_auto_saves_are_not_listed_as_the_users_checkpoints(lora_job, node: Daemon):
    training, saved = lora_job
    rest = tinker.RestClient(base_url=node.url, api_key=API_KEY)
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [saved]
    assert [c.tinker_path for c in rest.list_user_checkpoints(limit=100).result().checkpoints] == [saved]
    console = httpx.get(f"{node.url}/openrl/v1/runs/{training.model_id}", headers={"X-API-Key": API_KEY}, timeout=10)
    assert [c["tinker_path"] for c in console.json()["checkpoints"]] == [saved]


def test_the_reader_skips_a_half_written_auto_save(lora_job, shared: Path):
    training, _ = lora_job
    half = shared / AUTOSAVE_DIR / training.model_id / step_dir_name(5)
    half.mkdir()
    (half / "adapter.safetensors").write_bytes(b"\x00" * 10)  # cut short: no manifest
    try:
        latest = latest_autosave(shared, training.model_id)
        assert latest is not None and latest.manifest.step == 4
    finally:
        (half / "adapter.safetensors").unlink()
        half.rmdir()


def test_the_auto_save_names_the_sampler_weights_the_job_published(node: Daemon, shared: Path):
    training = _job(node)
    _steps(training, 1)
    named = training.save_weights_for_sampler("published").result().path
    sampling = training.save_weights_and_get_sampling_client().result()
    _steps(training, 1)
    _wait_for_step(shared, training.model_id, 2)
    latest = latest_autosave(shared, training.model_id)
    assert latest is not None
    assert (latest.manifest.sampler_paths, latest.manifest.sampling_sessions) == (
        [named], [sampling._sampling_session_id]
    )


def test_full_fine_tuning_job_saves_at_its_interval(node: Daemon, shared: Path):
    """Which steps are due is pinned in tests/actors/test_trainer_autosave.py; here, the full state lands."""
    training = _job(node, **{"openrl.fine_tuning_type": "full", "openrl.autosave_steps": "2"})
    _steps(training, 4)
    _wait_for_step(shared, training.model_id, 4)
    latest = latest_autosave(shared, training.model_id)
    assert latest is not None and (latest.manifest.seq_id, latest.manifest.lora) == (8, None)
    assert {"model.safetensors", "optimizer.safetensors", "state.json"} <= set(latest.manifest.files)


def test_a_job_with_autosave_steps_0_writes_none(node: Daemon, shared: Path):
    training = _job(node, **{"openrl.autosave_steps": "0"})
    _steps(training, 2)
    training.save_state("flush").result()  # runs after both steps, so any write of theirs came first
    assert _step_dirs(shared, training.model_id) == []


def test_a_closed_sessions_jobs_lose_their_auto_saves_at_the_next_sweep(node: Daemon, shared: Path):
    service = tinker.ServiceClient(base_url=node.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    _steps(training, 1)
    _wait_for_step(shared, training.model_id, 1)
    service.close("success").result()  # the session finishes: no op of its jobs is taken after
    wait_for(lambda: not (shared / AUTOSAVE_DIR / training.model_id).exists(), COMMIT_WAIT_S)


def test_a_killed_daemon_keeps_its_auto_save_and_the_users_checkpoints(node: Daemon, shared: Path):
    """Last in the module: it kills the module's node, and starts it again on the same data dir."""
    training = _job(node)
    _steps(training, 2)
    saved = training.save_state("kept").result().path
    _wait_for_step(shared, training.model_id, 2)
    _steps(training, 1)  # its auto-save may be anywhere between the engine and the rename
    node.kill()
    node.start()
    latest = latest_autosave(shared, training.model_id)
    assert latest is not None and latest.manifest.step in (2, 3)
    assert _step_dirs(shared, training.model_id) == [step_dir_name(latest.manifest.step)]
    # Whatever the kill cut short was in the node's staging (the only node on this root), emptied at the restart.
    assert [os.listdir(staging) for staging in (shared / ".staging").iterdir()] == [[]]
    rest = tinker.RestClient(base_url=node.url, api_key=API_KEY)
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [saved]
