"""A checkpoint root shared by several nodes' stores (openrld/store/, openrld/checkpoint_manifest.py).

Two Stores with their own data dirs and one checkpoint root stand for two
nodes; what one commits, the other adopts from the manifest.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from openrld.checkpoint_manifest import MANIFEST_FORMAT, MANIFEST_NAME, CheckpointManifest, read_manifest
from openrld.errors import ServerError
from openrld.ids import TinkerPath
from openrld.store import CheckpointRow, RunRow, Store
from tests.test_store import RUN, T0, Clock, W, add_run

OTHER_RUN = "s-fedcba9876543210:train:3"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    return shared


@pytest.fixture
def node_a(tmp_path: Path, root: Path, clock: Clock) -> Iterator[Store]:
    with Store.open(tmp_path / "a", checkpoint_root=root, now=clock) as store:
        yield store


@pytest.fixture
def node_b(tmp_path: Path, root: Path, clock: Clock) -> Iterator[Store]:
    with Store.open(tmp_path / "b", checkpoint_root=root, now=clock) as store:
        yield store


def node_id(store: Store) -> str:
    return (store.data_dir / "node_id").read_text().strip()


def save(store: Store, run_id: str, name: str, text: str = "tensors", *, replace: bool = False) -> Path:
    """Commit a checkpoint with its manifest and record its row, as the trainer does."""
    staging = store.files.staging_dir()
    (staging / "adapter.safetensors").write_text(text)
    manifest = store.adoption.manifest_for(
        run_id, W, name, size_bytes=len(text), user_metadata={"step": "2"}, expires_at=T0 + timedelta(days=1)
    )
    final = store.files.checkpoint_dir(run_id, W, name)
    store.files.commit_dir(staging, final, replace=replace, manifest=manifest)
    store.checkpoints.add(
        run_id, W, name, manifest.owner, manifest.size_bytes, manifest.user_metadata, manifest.expires_at,
        overwrite=replace, created_at=manifest.created_at,
    )
    return final


# --- layout -----------------------------------------------------------------------------------------


def test_checkpoints_live_under_the_shared_root(node_a: Store, root: Path) -> None:
    assert node_a.files.checkpoint_dir(RUN, W, "s1") == root / RUN / "weights" / "s1"


def test_staging_is_this_nodes_own_directory_under_the_root(node_a: Store, root: Path) -> None:
    assert node_a.files.staging_dir().parent == root / ".staging" / node_id(node_a)


def test_node_id_is_kept_across_reopen(tmp_path: Path, root: Path, clock: Clock) -> None:
    with Store.open(tmp_path / "a", checkpoint_root=root, now=clock) as first:
        before = node_id(first)
    with Store.open(tmp_path / "a", checkpoint_root=root, now=clock) as second:
        assert node_id(second) == before


def test_two_nodes_get_distinct_staging(node_a: Store, node_b: Store) -> None:
    assert node_a.files.staging_dir().parent != node_b.files.staging_dir().parent


def test_a_missing_checkpoint_root_is_refused_at_open(tmp_path: Path, clock: Clock) -> None:
    missing = tmp_path / "not-mounted"
    with pytest.raises(ServerError) as excinfo:
        Store.open(tmp_path / "a", checkpoint_root=missing, now=clock)
    assert excinfo.value.detail == (
        f"checkpoint_root {missing} is not an existing directory (is the shared filesystem mounted?)"
    )
    assert not missing.exists()


def test_a_malformed_node_id_is_refused_at_open(tmp_path: Path, root: Path, clock: Clock) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "node_id").write_text("../escape\n")
    with pytest.raises(ServerError) as excinfo:
        Store.open(tmp_path / "a", checkpoint_root=root, now=clock)
    assert "expected 16 lowercase hex characters" in excinfo.value.detail


def test_a_single_node_store_keeps_its_layout(tmp_path: Path, clock: Clock) -> None:
    with Store.open(tmp_path / "alone", now=clock) as store:
        layout = (store.is_shared, store.files.staging_dir().parent, store.files.checkpoint_dir(RUN, W, "s1"))
    assert layout == (False, tmp_path / "alone" / "tmp", tmp_path / "alone" / "checkpoints" / RUN / "weights" / "s1")
    assert not (tmp_path / "alone" / "node_id").exists()


# --- recovery touches only this node's leftovers ------------------------------------------------------


def test_reopen_empties_this_nodes_staging_only(tmp_path: Path, node_b: Store, clock: Clock, root: Path) -> None:
    a = Store.open(tmp_path / "a", checkpoint_root=root, now=clock)
    own = a.files.staging_dir()
    (own / "half.safetensors").write_text("x")
    others = node_b.files.staging_dir()
    (others / "half.safetensors").write_text("y")
    a.close()
    Store.open(tmp_path / "a", checkpoint_root=root, now=clock).close()
    assert (own.exists(), (others / "half.safetensors").read_text()) == (False, "y")


def test_reopen_undoes_only_this_nodes_interrupted_replace(
    tmp_path: Path, node_b: Store, clock: Clock, root: Path
) -> None:
    a = Store.open(tmp_path / "a", checkpoint_root=root, now=clock)
    add_run(a)
    run_dir = root / RUN / "weights"
    run_dir.mkdir(parents=True)
    # Each node moved its old copy aside and died (or is about to rename the new one in).
    (run_dir / f"mine#old-{node_id(a)}").mkdir()
    (run_dir / f"theirs#old-{node_id(node_b)}").mkdir()
    a.close()
    Store.open(tmp_path / "a", checkpoint_root=root, now=clock).close()
    assert sorted(os.listdir(run_dir)) == ["mine", f"theirs#old-{node_id(node_b)}"]


def test_replace_moves_the_old_copy_aside_under_this_nodes_name(node_a: Store, root: Path) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1", "old")
    save(node_a, RUN, "s1", "new", replace=True)
    assert ((final / "adapter.safetensors").read_text(), sorted(os.listdir(final.parent))) == ("new", ["s1"])


# --- manifests ----------------------------------------------------------------------------------------


def test_commit_writes_the_manifest_beside_the_files(node_a: Store, clock: Clock) -> None:
    run = add_run(node_a)
    clock.advance(5)
    final = save(node_a, RUN, "s1")
    assert read_manifest(final, TinkerPath(RUN, W, "s1")) == CheckpointManifest(
        format=MANIFEST_FORMAT, run_id=RUN, kind=W, name="s1", owner="alice", session_id=run.session_id,
        base_model="org/tiny-llama", model_dir="/srv/models/tiny", lora=run.lora, settings=run.settings,
        optimizer_config={"type": "adamw"}, run_user_metadata={"purpose": "test"}, run_created_at=T0,
        user_metadata={"step": "2"}, size_bytes=7, created_at=T0 + timedelta(seconds=5),
        expires_at=T0 + timedelta(days=1), public=False,
    )


def test_a_single_node_commit_writes_the_manifest_too(tmp_path: Path, clock: Clock) -> None:
    with Store.open(tmp_path / "alone", now=clock) as store:
        add_run(store)
        final = save(store, RUN, "s1")
        assert read_manifest(final, TinkerPath(RUN, W, "s1")).owner == "alice"  # type: ignore[union-attr]


def test_commit_refuses_a_manifest_of_another_checkpoint(node_a: Store) -> None:
    add_run(node_a)
    staging = node_a.files.staging_dir()
    manifest = node_a.adoption.manifest_for(RUN, W, "s1", size_bytes=1, user_metadata={}, expires_at=None)
    with pytest.raises(ServerError):
        node_a.files.commit_dir(staging, node_a.files.checkpoint_dir(RUN, W, "s2"), manifest=manifest)
    assert not node_a.files.checkpoint_dir(RUN, W, "s2").exists()


# --- adoption -----------------------------------------------------------------------------------------


def test_another_node_adopts_the_run_and_checkpoint_rows(node_a: Store, node_b: Store, clock: Clock) -> None:
    add_run(node_a)
    clock.advance(5)
    save(node_a, RUN, "s1")
    clock.advance(60)
    adopted = node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    assert adopted == node_a.checkpoints.get(RUN, W, "s1")
    assert node_b.runs.get(RUN) == msgspec.structs.replace(
        node_a.runs.get(RUN),  # type: ignore[arg-type]
        last_request_at=T0 + timedelta(seconds=5),  # the checkpoint's time: the last the run is known to have done
    )


def test_adoption_of_a_second_checkpoint_keeps_the_adopted_run(node_a: Store, node_b: Store, clock: Clock) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    run = node_b.runs.get(RUN)
    clock.advance(5)
    save(node_a, RUN, "s2")
    node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s2"))
    assert (node_b.runs.get(RUN), [row.name for row in node_b.checkpoints.of_run(RUN)]) == (run, ["s1", "s2"])


def test_nothing_is_adopted_without_a_directory(node_b: Store) -> None:
    assert (node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")), node_b.runs.get(RUN)) == (None, None)


def test_a_single_node_store_never_adopts(tmp_path: Path, clock: Clock) -> None:
    with Store.open(tmp_path / "alone", now=clock) as store:
        add_run(store)
        save(store, RUN, "s1")
        store.delete_checkpoint(RUN, W, "s1")
        staging = store.files.staging_dir()
        (staging / "adapter.safetensors").write_text("x")
        manifest = store.adoption.manifest_for(RUN, W, "s1", size_bytes=1, user_metadata={}, expires_at=None)
        # A directory without a row, as a crash between a delete's two steps leaves one.
        store.files.commit_dir(staging, store.files.checkpoint_dir(RUN, W, "s1"), manifest=manifest)
        assert store.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")) is None


def test_a_manifest_that_names_another_checkpoint_is_refused(
    node_a: Store, node_b: Store, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    shutil.copytree(final, root / OTHER_RUN / "weights" / "s1")
    with caplog.at_level(logging.WARNING, logger="openrld.store"):
        adopted = node_b.adoption.adopt_checkpoint(TinkerPath(OTHER_RUN, W, "s1"))
    assert (adopted, node_b.runs.get(OTHER_RUN), node_b.runs.get(RUN)) == (None, None, None)
    assert f"names tinker://{RUN}/weights/s1, but sits in the directory of tinker://{OTHER_RUN}/weights/s1" in caplog.text


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"format": 1}', b"[]"],
    ids=["not-json", "missing-fields", "not-an-object"],
)
def test_a_malformed_manifest_is_refused(node_a: Store, node_b: Store, content: bytes) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    (final / MANIFEST_NAME).write_bytes(content)
    assert (node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")), node_b.runs.get(RUN)) == (None, None)


def test_a_manifest_of_another_format_is_refused(node_a: Store, node_b: Store) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    manifest = msgspec.json.decode((final / MANIFEST_NAME).read_bytes())
    (final / MANIFEST_NAME).write_bytes(msgspec.json.encode({**manifest, "format": MANIFEST_FORMAT + 1}))
    assert node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")) is None


def test_a_symlinked_manifest_is_refused(node_a: Store, node_b: Store, tmp_path: Path) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(final / MANIFEST_NAME, elsewhere)
    (final / MANIFEST_NAME).symlink_to(elsewhere)
    assert node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")) is None


def test_a_symlinked_run_dir_out_of_the_root_is_refused(node_b: Store, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "weights" / "s1").mkdir(parents=True)
    (root / RUN).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ServerError):
        node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))


def test_a_run_of_another_owner_here_is_not_adopted_into(node_a: Store, node_b: Store) -> None:
    add_run(node_a, owner="alice")
    save(node_a, RUN, "s1")
    add_run(node_b, owner="bob")
    assert (node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1")), node_b.checkpoints.of_run(RUN)) == (None, [])


def test_adopted_rows_survive_reopen(tmp_path: Path, node_a: Store, root: Path, clock: Clock) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    b = Store.open(tmp_path / "b", checkpoint_root=root, now=clock)
    adopted: CheckpointRow | None = b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    run: RunRow | None = b.runs.get(RUN)
    b.close()
    with Store.open(tmp_path / "b", checkpoint_root=root, now=clock) as reopened:
        assert (reopened.checkpoints.get(RUN, W, "s1"), reopened.runs.get(RUN)) == (adopted, run)


def test_adopt_run_adopts_every_checkpoint_of_the_run(node_a: Store, node_b: Store, clock: Clock) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    clock.advance(5)
    save(node_a, RUN, "s2")
    run = node_b.adoption.adopt_run(RUN)
    assert (run is not None, node_b.checkpoints.of_run(RUN)) == (True, node_a.checkpoints.of_run(RUN))


def test_adopt_run_skips_the_aside_of_a_replace_in_progress(node_a: Store, node_b: Store, root: Path) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    shutil.copytree(final, root / RUN / "weights" / f"s1#old-{node_id(node_a)}")
    node_b.adoption.adopt_run(RUN)
    assert [row.name for row in node_b.checkpoints.of_run(RUN)] == ["s1"]


def test_adopt_run_of_an_unknown_run_is_none(node_b: Store) -> None:
    assert node_b.adoption.adopt_run(RUN) is None


def test_a_single_node_store_never_adopts_a_run(tmp_path: Path, clock: Clock) -> None:
    with Store.open(tmp_path / "alone", now=clock) as store:
        assert store.adoption.adopt_run("../escape") is None


def test_publish_is_written_into_the_manifest(node_a: Store, node_b: Store) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    node_a.set_checkpoint_public(RUN, W, "s1", True)
    adopted = node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    assert adopted is not None and adopted.public


def test_a_new_ttl_is_written_into_the_manifest(node_a: Store, node_b: Store) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    node_a.set_checkpoint_expiry(RUN, W, "s1", T0 + timedelta(days=30))
    adopted = node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    assert adopted is not None and adopted.expires_at == T0 + timedelta(days=30)


def test_a_manifest_update_leaves_no_staging_behind(node_a: Store, root: Path) -> None:
    add_run(node_a)
    save(node_a, RUN, "s1")
    node_a.set_checkpoint_public(RUN, W, "s1", True)
    assert os.listdir(root / ".staging" / node_id(node_a)) == []


def test_both_nodes_may_delete_an_adopted_checkpoint(node_a: Store, node_b: Store) -> None:
    add_run(node_a)
    final = save(node_a, RUN, "s1")
    node_b.adoption.adopt_checkpoint(TinkerPath(RUN, W, "s1"))
    node_a.delete_checkpoint(RUN, W, "s1")
    node_b.delete_checkpoint(RUN, W, "s1")  # its files are gone already: only the row goes
    assert (final.exists(), node_a.checkpoints.get(RUN, W, "s1"), node_b.checkpoints.get(RUN, W, "s1")) == (
        False, None, None
    )
