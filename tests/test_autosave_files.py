"""Auto-saves on a shared checkpoint root (openrld/autosave.py): commit, prune, the sweep of ended jobs, and
the adopter's reader.

A real Store on a shared root stands for the node; the files are what the engine's
`save_state` would have written (their content does not matter here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import numpy as np
import pytest

from openrld.actors.autosaves import AutosaveStore
from openrld.autosave import (
    AUTOSAVE_DIR,
    AUTOSAVE_FORMAT,
    AUTOSAVE_MANIFEST,
    AutosaveManifest,
    commit_autosave,
    commit_snapshot,
    job_dir,
    job_ids,
    latest_autosave,
    prune,
    remove_job,
    step_dir_name,
    write_snapshot,
)
from openrld.engine_types import SnapshotFile, StateSnapshot
from openrld.errors import BadRequest, ServerError
from openrld.ids import CheckpointKind
from openrld.store import Store
from tests.test_store import RUN, Clock, add_run

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    return shared


@pytest.fixture
def store(tmp_path: Path, root: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "node", checkpoint_root=root, now=Clock()) as opened:
        add_run(opened)
        yield opened


def manifest(store: Store, step: int, seq_id: int) -> AutosaveManifest:
    run = store.adoption.manifest_for(
        RUN, CheckpointKind.WEIGHTS, step_dir_name(step), size_bytes=None, user_metadata={}, expires_at=None
    )
    return AutosaveManifest(
        format=AUTOSAVE_FORMAT, model_id=RUN, step=step, seq_id=seq_id, run=run,
        sampler_paths=[f"tinker://{RUN}/sampler_weights/s{step}"], created_at=NOW,
    )


def autosave(store: Store, step: int, seq_id: int | None = None) -> Path:
    """What the trainer does: save_state's files in staging, then the commit."""
    staging = store.files.staging_dir()
    (staging / "adapter.safetensors").write_bytes(b"a" * (100 + step))
    (staging / "optimizer.safetensors").write_bytes(b"o" * 300)
    (staging / "state.json").write_bytes(b"{}")
    return commit_autosave(store.files, staging, manifest(store, step, seq_id if seq_id is not None else 2 * step))


def steps_on_disk(root: Path) -> list[str]:
    return sorted(os.listdir(root / AUTOSAVE_DIR / RUN))


def test_a_committed_auto_save_is_read_back_with_what_an_adopter_needs(store: Store, root: Path):
    directory = autosave(store, 3, seq_id=7)
    latest = latest_autosave(root, RUN)
    assert latest is not None
    assert latest.directory == directory == root / AUTOSAVE_DIR / RUN / "step-000000003"
    assert (latest.manifest.model_id, latest.manifest.step, latest.manifest.seq_id) == (RUN, 3, 7)
    assert (latest.manifest.base_model, latest.manifest.lora) == (store.runs.get(RUN).base_model, store.runs.get(RUN).lora)
    assert latest.manifest.sampler_paths == [f"tinker://{RUN}/sampler_weights/s3"]
    assert latest.manifest.files == {"adapter.safetensors": 103, "optimizer.safetensors": 300, "state.json": 2}


def test_a_commit_prunes_every_older_auto_save_of_the_job(store: Store, root: Path):
    for step in (1, 2, 3):
        autosave(store, step)
    assert steps_on_disk(root) == ["step-000000003"]
    assert os.listdir(store.files.checkpoint_files[1]) == []  # the removed ones passed through staging


def test_prune_keeps_the_step_it_is_given_and_newer_ones(store: Store, root: Path):
    autosave(store, 5)
    job = root / AUTOSAVE_DIR / RUN
    (job / step_dir_name(2)).mkdir()  # left by a node that died mid-prune
    (job / step_dir_name(9)).mkdir()  # being renamed into place by a later commit
    assert prune(store.files, RUN, keep=5) == [2]
    assert steps_on_disk(root) == ["step-000000005", "step-000000009"]


def test_auto_saves_are_no_checkpoints_of_the_run(store: Store, root: Path):
    autosave(store, 1)
    assert store.files.run_checkpoint_paths(RUN) == []
    assert store.adoption.adopt_run(RUN) is not None and store.checkpoints.of_run(RUN) == []


def test_no_auto_save_is_none(root: Path):
    assert latest_autosave(root, RUN) is None


def test_the_reader_skips_a_newer_step_without_a_manifest(store: Store, root: Path):
    autosave(store, 1)
    half = root / AUTOSAVE_DIR / RUN / step_dir_name(2)
    half.mkdir()
    (half / "adapter.safetensors").write_bytes(b"a" * 10)
    latest = latest_autosave(root, RUN)
    assert latest is not None and latest.manifest.step == 1


def _newer_copy(store: Store, root: Path) -> Path:
    """Step 1 committed, and a copy of it named step 2 with a manifest of step 2: complete until a test breaks it."""
    autosave(store, 1)
    job = root / AUTOSAVE_DIR / RUN
    newer = job / step_dir_name(2)
    newer.mkdir()
    for entry in os.scandir(job / step_dir_name(1)):
        (newer / entry.name).write_bytes(Path(entry.path).read_bytes())
    written = msgspec.json.decode((newer / AUTOSAVE_MANIFEST).read_bytes(), type=AutosaveManifest)
    (newer / AUTOSAVE_MANIFEST).write_bytes(msgspec.json.encode(msgspec.structs.replace(written, step=2)))
    return newer


def _truncate(newer: Path) -> None:
    with open(newer / "optimizer.safetensors", "r+b") as file:
        file.truncate(10)


def _extra_file(newer: Path) -> None:
    (newer / "stray.bin").write_bytes(b"x")


def _missing_file(newer: Path) -> None:
    (newer / "state.json").unlink()


def _other_job(newer: Path) -> None:
    manifest = msgspec.json.decode((newer / AUTOSAVE_MANIFEST).read_bytes(), type=AutosaveManifest)
    (newer / AUTOSAVE_MANIFEST).write_bytes(msgspec.json.encode(msgspec.structs.replace(manifest, model_id="s-x:train:9")))


def _other_format(newer: Path) -> None:
    manifest = msgspec.json.decode((newer / AUTOSAVE_MANIFEST).read_bytes(), type=AutosaveManifest)
    (newer / AUTOSAVE_MANIFEST).write_bytes(msgspec.json.encode(msgspec.structs.replace(manifest, format=2)))


def _cut_manifest(newer: Path) -> None:
    raw = (newer / AUTOSAVE_MANIFEST).read_bytes()
    (newer / AUTOSAVE_MANIFEST).write_bytes(raw[: len(raw) // 2])


def _symlinked_manifest(newer: Path) -> None:
    (newer / AUTOSAVE_MANIFEST).rename(newer.parent / "elsewhere.json")
    (newer / AUTOSAVE_MANIFEST).symlink_to(newer.parent / "elsewhere.json")


def _symlinked_file(newer: Path) -> None:
    (newer / "state.json").unlink()
    (newer / "state.json").symlink_to(newer.parent / step_dir_name(1) / "state.json")


@pytest.mark.parametrize(
    "damage",
    [_truncate, _extra_file, _missing_file, _other_job, _other_format, _cut_manifest, _symlinked_manifest, _symlinked_file],
    ids=["file-cut-short", "extra-file", "missing-file", "other-job", "other-format", "manifest-cut-short",
         "symlinked-manifest", "symlinked-file"],
)
def test_the_reader_skips_a_newer_step_that_is_not_whole(store: Store, root: Path, damage):
    damage(_newer_copy(store, root))
    latest = latest_autosave(root, RUN)
    assert latest is not None and latest.manifest.step == 1


def test_the_undamaged_copy_is_read_as_the_newer_step(store: Store, root: Path):
    """The control for the test above: its damage, not the copy, is what the reader refuses."""
    _newer_copy(store, root)
    latest = latest_autosave(root, RUN)
    assert latest is not None and latest.manifest.step == 2


def test_an_unsafe_model_id_is_refused(root: Path):
    with pytest.raises(BadRequest):
        latest_autosave(root, "../etc")
    with pytest.raises(BadRequest):
        job_dir(root, ".autosave")


def test_remove_job_removes_every_auto_save_of_the_job_through_staging(store: Store, root: Path):
    autosave(store, 1)
    (root / AUTOSAVE_DIR / RUN / step_dir_name(2)).mkdir()  # being written by a commit cut short
    assert remove_job(store.files, RUN) is True
    assert job_ids(root) == [] and os.listdir(store.files.checkpoint_files[1]) == []
    assert remove_job(store.files, RUN) is False  # none left: another node's sweep got there first


async def test_the_sweep_removes_the_auto_saves_of_jobs_whose_session_finished_here(store: Store, root: Path):
    live_run, elsewhere = "s-fedcba9876543210:train:0", "s-00000000000000aa:train:0"
    add_run(store, live_run, session_id="s-fedcba9876543210")
    for session_id, finished in (("s-0123456789abcdef", True), ("s-fedcba9876543210", False)):
        store.sessions.create(session_id, "alice", [], {}, "0.38.0", None, None)
        if finished:
            store.sessions.finish(session_id, "success", None)
    for model_id in (RUN, live_run, elsewhere):  # `elsewhere` has no run here: another node's job
        (root / AUTOSAVE_DIR / model_id / step_dir_name(1)).mkdir(parents=True)
    assert await AutosaveStore(store).prune_ended() == [RUN]
    assert job_ids(root) == sorted([live_run, elsewhere])


@pytest.mark.parametrize("name", ["../state.json", "a/b", "..", AUTOSAVE_MANIFEST], ids=["up", "nested", "dotdot", "manifest"])
def test_a_snapshot_file_that_is_not_a_plain_name_of_its_own_is_refused(tmp_path: Path, name: str):
    with pytest.raises(ServerError, match="not a file of its own"):
        write_snapshot(StateSnapshot([SnapshotFile(name, b"{}")]), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_each_file_of_a_snapshot_and_its_dir_are_fsynced_once_before_the_rename_that_commits_it(
    store: Store, root: Path, monkeypatch: pytest.MonkeyPatch
):
    snapshot = StateSnapshot([SnapshotFile("state.json", b"{}"), SnapshotFile("adapter.safetensors", b"h", np.ones(4, np.uint8))])
    synced: list[str] = []
    renamed_at: list[int] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(source: str | Path, destination: str | Path) -> None:
        if Path(destination).name == step_dir_name(4):
            renamed_at.append(len(synced))
        real_rename(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    directory = commit_snapshot(store.files, snapshot, manifest(store, 4, seq_id=8))
    (before_rename,) = renamed_at
    staging_name = synced[before_rename - 1]  # the staging dir itself, last
    assert staging_name.startswith("staging-")
    assert sorted(synced[: before_rename - 1]) == sorted(os.listdir(directory))


def test_a_step_pruned_while_it_is_read_is_skipped_for_the_one_before(store: Store, root: Path, monkeypatch):
    """The home's next commit prunes older steps while an adopter reads them (seen in a cluster test as a
    FileNotFoundError): a step that goes between its manifest and its listing is skipped, not raised."""
    from openrld import autosave as module

    newer = _newer_copy(store, root)
    read_manifest = module._read_manifest

    def pruned_after_its_manifest(step_dir: Path) -> AutosaveManifest:
        manifest = read_manifest(step_dir)
        if step_dir == newer:
            for entry in os.scandir(step_dir):
                os.unlink(entry.path)
            step_dir.rmdir()
        return manifest

    monkeypatch.setattr(module, "_read_manifest", pruned_after_its_manifest)
    latest = latest_autosave(root, RUN)
    assert latest is not None and latest.manifest.step == 1
