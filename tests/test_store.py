"""SQLite metadata and checkpoint directories (openrld/store/)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from openrld.errors import BadRequest, Conflict, Gone, NotFound, ServerError
from openrld.ids import CheckpointKind
from openrld.store import (
    CheckpointRow,
    RequestFinish,
    RequestState,
    RunRow,
    SamplerRow,
    SessionRow,
    Store,
    StoreStatistics,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
RUN = "s-0123456789abcdef:train:0"
W = CheckpointKind.WEIGHTS
S = CheckpointKind.SAMPLER_WEIGHTS


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float = 1.0) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path, clock: Clock) -> Iterator[Store]:
    with Store.open(data_dir, now=clock) as opened:
        yield opened


def reopen(store: Store, clock: Clock) -> Store:
    store.close()
    return Store.open(store.data_dir, now=clock)


def add_session(store: Store, session_id: str = "s-0123456789abcdef", owner: str = "alice") -> SessionRow:
    return store.sessions.create(session_id, owner, ["openrl.exclusive=false"], {"team": "rl"}, "0.38.0", "proj", "demo")


def add_run(store: Store, run_id: str = RUN, owner: str = "alice", session_id: str = "s-0123456789abcdef") -> RunRow:
    return store.runs.create(
        run_id,
        session_id,
        owner,
        "org/tiny-llama",
        "/srv/models/tiny",
        {"rank": 8, "seed": None, "train_unembed": True, "train_mlp": True, "train_attn": True},
        {"fine_tuning_type": "lora", "exclusive": False},
        {"purpose": "test"},
        {"type": "adamw"},
    )


@contextlib.contextmanager
def writer_connection(data_dir: Path) -> Iterator[sqlite3.Connection]:
    """A second connection to the store's database (as another process would have), committing on exit."""
    conn = sqlite3.connect(data_dir / "openrld.sqlite3")
    try:
        with conn:
            yield conn
    finally:
        conn.close()


def write_checkpoint(store: Store, run_id: str, kind: CheckpointKind, name: str, text: str, *, replace: bool = False) -> Path:
    staging = store.files.staging_dir()
    (staging / "adapter.safetensors").write_text(text)
    (staging / "meta").mkdir()
    (staging / "meta" / "info.json").write_text("{}")
    final = store.files.checkpoint_dir(run_id, kind, name)
    store.files.commit_dir(staging, final, replace=replace)
    return final


# --- persistence ------------------------------------------------------------------------------------


def test_session_survives_close_and_reopen(store: Store, clock: Clock) -> None:
    created = add_session(store)
    store = reopen(store, clock)
    assert store.sessions.get("s-0123456789abcdef") == created == SessionRow(
        session_id="s-0123456789abcdef",
        owner="alice",
        tags=("openrl.exclusive=false",),
        user_metadata={"team": "rl"},
        sdk_version="0.38.0",
        project_id="proj",
        display_name="demo",
        created_at=T0,
        last_heartbeat_at=T0,
        finished_at=None,
        finish_reason=None,
        finish_detail=None,
    )
    store.close()


def test_run_survives_close_and_reopen(store: Store, clock: Clock) -> None:
    created = add_run(store)
    store = reopen(store, clock)
    assert store.runs.get(RUN) == created == RunRow(
        run_id=RUN,
        session_id="s-0123456789abcdef",
        owner="alice",
        base_model="org/tiny-llama",
        model_dir="/srv/models/tiny",
        lora={"rank": 8, "seed": None, "train_unembed": True, "train_mlp": True, "train_attn": True},
        settings={"fine_tuning_type": "lora", "exclusive": False},
        user_metadata={"purpose": "test"},
        optimizer_config={"type": "adamw"},
        created_at=T0,
        last_request_at=T0,
        corrupted=False,
    )
    assert (created.is_lora, created.lora_rank) == (True, 8)
    store.close()


def test_sampler_survives_close_and_reopen(store: Store, clock: Clock) -> None:
    created = store.samplers.create("s-1:sample:0", "s-1", "alice", "org/tiny-llama", f"tinker://{RUN}/sampler_weights/a", RUN)
    store = reopen(store, clock)
    assert store.samplers.get("s-1:sample:0") == created == SamplerRow(
        sampler_id="s-1:sample:0",
        session_id="s-1",
        owner="alice",
        base_model="org/tiny-llama",
        model_path=f"tinker://{RUN}/sampler_weights/a",
        run_id=RUN,
        created_at=T0,
    )
    store.close()


def test_checkpoint_row_and_files_survive_close_and_reopen(store: Store, clock: Clock) -> None:
    final = write_checkpoint(store, RUN, W, "step-1", "tensors")
    created = store.checkpoints.add(RUN, W, "step-1", "alice", 7, {"step": "1"}, T0 + timedelta(days=7))
    store = reopen(store, clock)
    assert store.checkpoints.get(RUN, W, "step-1") == created == CheckpointRow(
        run_id=RUN,
        kind=W,
        name="step-1",
        owner="alice",
        created_at=T0,
        size_bytes=7,
        user_metadata={"step": "1"},
        expires_at=T0 + timedelta(days=7),
        public=False,
    )
    assert (final / "adapter.safetensors").read_text() == "tensors"
    store.close()


def test_checkpoint_row_gives_the_sdk_fields(store: Store) -> None:
    row = store.checkpoints.add(RUN, S, "step-1", "alice", None, {}, None)
    assert (row.checkpoint_id, row.checkpoint_type, row.tinker_path) == (
        "sampler_weights/step-1",
        "sampler",
        f"tinker://{RUN}/sampler_weights/step-1",
    )


def test_session_lists_its_runs_and_samplers_in_creation_order(store: Store, clock: Clock) -> None:
    add_run(store, "s-0123456789abcdef:train:1")
    clock.advance()
    add_run(store, "s-0123456789abcdef:train:0")
    add_run(store, "s-other:train:0", session_id="s-other")
    store.samplers.create("s-0123456789abcdef:sample:0", "s-0123456789abcdef", "alice", "m", None, None)
    assert store.runs.of_session("s-0123456789abcdef") == ["s-0123456789abcdef:train:1", "s-0123456789abcdef:train:0"]
    assert store.samplers.of_session("s-0123456789abcdef") == ["s-0123456789abcdef:sample:0"]


def test_base_models_are_those_of_runs_and_samplers_sorted_once_each(store: Store, clock: Clock) -> None:
    add_run(store, "s-0123456789abcdef:train:0")  # on org/tiny-llama
    add_run(store, "s-0123456789abcdef:train:1")
    store.samplers.create("s-1:sample:0", "s-1", "bob", "/srv/models/qwen", None, None)
    store.samplers.create("s-1:sample:1", "s-1", "bob", "org/tiny-llama", f"tinker://{RUN}/sampler_weights/a", RUN)
    store = reopen(store, clock)
    assert store.runs.base_models() == ["/srv/models/qwen", "org/tiny-llama"]
    store.close()


def test_duplicate_ids_are_conflicts(store: Store) -> None:
    add_session(store)
    add_run(store)
    store.samplers.create("x:sample:0", "x", "alice", "m", None, None)
    with pytest.raises(Conflict):
        add_session(store)
    with pytest.raises(Conflict):
        add_run(store)
    with pytest.raises(Conflict):
        store.samplers.create("x:sample:0", "x", "alice", "m", None, None)


def test_run_id_that_is_unsafe_as_a_path_is_refused(store: Store) -> None:
    with pytest.raises(BadRequest) as excinfo:
        add_run(store, "../escape")
    assert excinfo.value.detail == "run id: must not contain '/' or '\\', got '../escape'"


def test_non_string_user_metadata_is_refused(store: Store) -> None:
    with pytest.raises(BadRequest) as excinfo:
        store.sessions.create("s-1", "alice", [], {"n": 3}, "0.38.0", None, None)  # type: ignore[dict-item]
    assert excinfo.value.detail == "session user_metadata: expected string keys and values: Expected `str`, got `int` - at `$[...]`"


# --- sessions ---------------------------------------------------------------------------------------


def test_heartbeat_moves_last_heartbeat_time(store: Store, clock: Clock) -> None:
    add_session(store)
    later = clock.advance(10)
    store.sessions.heartbeat("s-0123456789abcdef")
    session = store.sessions.get("s-0123456789abcdef")
    assert session is not None and (session.created_at, session.last_heartbeat_at) == (T0, later)


def test_heartbeat_for_unknown_session_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.sessions.heartbeat("s-none")


def test_heartbeat_for_finished_session_is_gone(store: Store) -> None:
    add_session(store)
    store.sessions.finish("s-0123456789abcdef", "success", None)
    with pytest.raises(Gone) as excinfo:
        store.sessions.heartbeat("s-0123456789abcdef")
    assert excinfo.value.detail == "session 's-0123456789abcdef' has finished (success)"


def test_first_finish_reason_wins(store: Store, clock: Clock) -> None:
    add_session(store)
    first_at = clock.advance()
    assert store.sessions.finish("s-0123456789abcdef", "errored", "boom") is True
    clock.advance()
    assert store.sessions.finish("s-0123456789abcdef", "success", None) is False
    session = store.sessions.get("s-0123456789abcdef")
    assert session is not None
    assert (session.finish_reason, session.finish_detail, session.finished_at, session.is_finished) == (
        "errored",
        "boom",
        first_at,
        True,
    )


def test_finish_unknown_session_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.sessions.finish("s-none", "success", None)


def test_list_sessions_is_newest_first_and_per_owner(store: Store, clock: Clock) -> None:
    for n in range(3):
        add_session(store, f"s-{n}")
        clock.advance()
    add_session(store, "s-bob", owner="bob")
    assert [s.session_id for s in store.sessions.list("alice", 2, 0)] == ["s-2", "s-1"]
    assert [s.session_id for s in store.sessions.list("alice", 2, 2)] == ["s-0"]


# --- runs and pagination ----------------------------------------------------------------------------


def test_list_runs_pages_newest_first_with_the_owners_total(store: Store, clock: Clock) -> None:
    for n in range(5):
        add_run(store, f"s-1:train:{n}")
        clock.advance()
    add_run(store, "s-2:train:0", owner="bob")
    page, total = store.runs.list("alice", 2, 2)
    assert ([r.run_id for r in page], total) == (["s-1:train:2", "s-1:train:1"], 5)


def test_list_runs_past_the_end_is_empty_with_the_total(store: Store) -> None:
    add_run(store)
    assert store.runs.list("alice", 10, 5) == ([], 1)


def test_negative_limit_is_refused(store: Store) -> None:
    with pytest.raises(BadRequest) as excinfo:
        store.runs.list("alice", -1, 0)
    assert excinfo.value.detail == "limit: expected 0 or more, got -1"


def test_touch_run_moves_last_request_time(store: Store, clock: Clock) -> None:
    add_run(store)
    later = clock.advance(5)
    store.runs.touch(RUN)
    run = store.runs.get(RUN)
    assert run is not None and (run.created_at, run.last_request_at) == (T0, later)


def test_touch_unknown_run_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        store.runs.touch("s-1:train:9")


# --- checkpoints ------------------------------------------------------------------------------------


def test_existing_checkpoint_is_a_conflict(store: Store) -> None:
    store.checkpoints.add(RUN, W, "a", "alice", 1, {}, None)
    with pytest.raises(Conflict) as excinfo:
        store.checkpoints.add(RUN, W, "a", "alice", 2, {}, None)
    assert excinfo.value.detail == f"checkpoint tinker://{RUN}/weights/a already exists"


def test_overwrite_replaces_the_checkpoint_row(store: Store, clock: Clock) -> None:
    store.checkpoints.add(RUN, W, "a", "alice", 1, {"v": "1"}, None)
    later = clock.advance()
    row = store.checkpoints.add(RUN, W, "a", "alice", 2, {"v": "2"}, None, overwrite=True)
    assert store.checkpoints.of_run(RUN) == [row]
    assert (row.size_bytes, row.user_metadata, row.created_at) == (2, {"v": "2"}, later)


def test_same_name_in_another_kind_is_a_different_checkpoint(store: Store) -> None:
    store.checkpoints.add(RUN, W, "a", "alice", 1, {}, None)
    store.checkpoints.add(RUN, S, "a", "alice", 1, {}, None)
    assert [c.checkpoint_id for c in store.checkpoints.of_run(RUN)] == ["weights/a", "sampler_weights/a"]


def test_list_user_checkpoints_pages_newest_first_with_the_owners_total(store: Store, clock: Clock) -> None:
    for n in range(4):
        store.checkpoints.add(RUN, W, f"step-{n}", "alice", 10, {}, None)
        clock.advance()
    store.checkpoints.add("s-2:train:0", W, "x", "bob", 10, {}, None)
    page, total = store.checkpoints.of_owner("alice", 3, 0)
    assert ([c.name for c in page], total) == (["step-3", "step-2", "step-1"], 4)


def test_last_checkpoint_is_the_newest_of_its_kind(store: Store, clock: Clock) -> None:
    store.checkpoints.add(RUN, W, "step-1", "alice", 1, {}, None)
    clock.advance()
    store.checkpoints.add(RUN, W, "step-2", "alice", 1, {}, None)
    clock.advance()
    store.checkpoints.add(RUN, S, "step-3", "alice", 1, {}, None)
    last = store.checkpoints.last(RUN, W)
    assert last is not None and last.name == "step-2"
    assert store.checkpoints.last("s-2:train:0", W) is None


def test_delete_checkpoint_removes_row_and_directory(store: Store) -> None:
    final = write_checkpoint(store, RUN, W, "a", "x")
    store.checkpoints.add(RUN, W, "a", "alice", 1, {}, None)
    store.delete_checkpoint(RUN, W, "a")
    assert (store.checkpoints.get(RUN, W, "a"), final.exists(), os.listdir(store.data_dir / "tmp")) == (None, False, [])


def test_delete_missing_checkpoint_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as excinfo:
        store.delete_checkpoint(RUN, W, "a")
    assert excinfo.value.detail == f"checkpoint tinker://{RUN}/weights/a not found"


def test_session_checkpoint_usage_counts_its_runs_checkpoints(store: Store) -> None:
    add_run(store)
    store.checkpoints.add(RUN, W, "a", "alice", 100, {}, None)
    store.checkpoints.add(RUN, S, "b", "alice", 20, {}, None)
    store.checkpoints.add("s-2:train:0", W, "c", "alice", 5, {}, None)
    assert store.checkpoints.usage_of_session("s-0123456789abcdef") == (2, 120)


# --- checkpoint directories -------------------------------------------------------------------------


def test_checkpoint_dir_layout(store: Store) -> None:
    assert store.files.checkpoint_dir(RUN, S, "step-1") == store.data_dir / "checkpoints" / RUN / "sampler_weights" / "step-1"


@pytest.mark.parametrize(
    ("run_id", "name", "detail"),
    [
        ("..", "a", "run id: must not start with '.', got '..'"),
        (RUN, "..", "checkpoint name: must not start with '.', got '..'"),
        (RUN, "../../x", "checkpoint name: must not contain '/' or '\\', got '../../x'"),
        ("/etc", "a", "run id: must not contain '/' or '\\', got '/etc'"),
        (RUN, "/tmp/evil", "checkpoint name: must not contain '/' or '\\', got '/tmp/evil'"),
    ],
    ids=["dotdot-run", "dotdot-name", "climbing-name", "absolute-run", "absolute-name"],
)
def test_checkpoint_dir_refuses_escaping_names(store: Store, run_id: str, name: str, detail: str) -> None:
    with pytest.raises(BadRequest) as excinfo:
        store.files.checkpoint_dir(run_id, W, name)
    assert excinfo.value.detail == detail


def test_checkpoint_dir_refuses_a_planted_symlink_out_of_the_data_dir(store: Store, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.data_dir / "checkpoints" / RUN).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ServerError) as excinfo:
        store.files.checkpoint_dir(RUN, W, "a")
    assert excinfo.value.detail == (
        f"{store.data_dir / 'checkpoints' / RUN / 'weights' / 'a'} resolves outside "
        f"{store.data_dir.resolve() / 'checkpoints'}; refusing to use it"
    )


def test_checkpoint_dir_refuses_a_symlinked_checkpoints_root(data_dir: Path, clock: Clock, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    data_dir.mkdir()
    (data_dir / "checkpoints").symlink_to(outside, target_is_directory=True)
    with Store.open(data_dir, now=clock) as store, pytest.raises(ServerError):
        store.files.checkpoint_dir(RUN, W, "a")


def test_commit_dir_puts_the_files_in_place_and_empties_staging(store: Store) -> None:
    final = write_checkpoint(store, RUN, W, "a", "tensors")
    assert (final / "adapter.safetensors").read_text() == "tensors"
    assert (final / "meta" / "info.json").read_text() == "{}"
    assert os.listdir(store.data_dir / "tmp") == []


def test_commit_dir_onto_an_existing_checkpoint_is_a_conflict(store: Store) -> None:
    final = write_checkpoint(store, RUN, W, "a", "first")
    with pytest.raises(Conflict) as excinfo:
        write_checkpoint(store, RUN, W, "a", "second")
    assert excinfo.value.detail == f"checkpoint tinker://{RUN}/weights/a already exists"
    assert (final / "adapter.safetensors").read_text() == "first"


def test_commit_dir_with_replace_swaps_the_contents(store: Store) -> None:
    final = write_checkpoint(store, RUN, W, "a", "first")
    write_checkpoint(store, RUN, W, "a", "second", replace=True)
    assert (final / "adapter.safetensors").read_text() == "second"
    assert sorted(os.listdir(final.parent)) == ["a"]


def test_commit_dir_refuses_a_symlink_inside_staging(store: Store, tmp_path: Path) -> None:
    staging = store.files.staging_dir()
    (staging / "weights").symlink_to(tmp_path)
    with pytest.raises(ServerError) as excinfo:
        store.files.commit_dir(staging, store.files.checkpoint_dir(RUN, W, "a"))
    assert excinfo.value.detail == f"{staging / 'weights'}: a checkpoint holds only files and directories"


def test_commit_dir_refuses_a_directory_not_from_staging_dir(store: Store, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(ServerError) as excinfo:
        store.files.commit_dir(elsewhere, store.files.checkpoint_dir(RUN, W, "a"))
    assert excinfo.value.detail == f"{elsewhere} is not a staging dir of this store"


def test_staging_dirs_are_fresh_and_empty(store: Store) -> None:
    first, second = store.files.staging_dir(), store.files.staging_dir()
    assert (first != second, os.listdir(first), first.parent) == (True, [], store.data_dir / "tmp")


# --- crash recovery ---------------------------------------------------------------------------------


def test_reopen_removes_leftover_staging(store: Store, clock: Clock) -> None:
    staging = store.files.staging_dir()
    (staging / "half-written.safetensors").write_text("partial")
    store = reopen(store, clock)
    assert (staging.exists(), os.listdir(store.data_dir / "tmp")) == (False, [])
    store.close()


def test_reopen_restores_a_checkpoint_a_crash_left_moved_aside(store: Store, clock: Clock) -> None:
    # The crash came between moving the old dir aside and renaming the new one in.
    final = write_checkpoint(store, RUN, W, "a", "old")
    final.rename(final.with_name("a#old"))
    store = reopen(store, clock)
    assert ((final / "adapter.safetensors").read_text(), sorted(os.listdir(final.parent))) == ("old", ["a"])
    store.close()


def test_reopen_drops_the_old_copy_of_a_finished_replace(store: Store, clock: Clock) -> None:
    # The crash came after the new dir was in place, before the old one was removed.
    final = write_checkpoint(store, RUN, W, "a", "new")
    (final.parent / "a#old").mkdir()
    store = reopen(store, clock)
    assert ((final / "adapter.safetensors").read_text(), sorted(os.listdir(final.parent))) == ("new", ["a"])
    store.close()


def finish(*request_ids: str, at: datetime = T0) -> list[RequestFinish]:
    return [RequestFinish(r, at) for r in request_ids]


def test_every_request_of_the_last_process_is_lost_after_reopen(store: Store, clock: Clock) -> None:
    # A finished result lived in the dead process's memory too: unread, it is as lost.
    store.requests.record("r-pending", RUN, "forward_backward")
    store.requests.record("r-done", RUN, "optim_step")
    store.requests.finish(finish("r-done"))
    store = reopen(store, clock)
    assert (store.requests.state("r-pending"), store.requests.state("r-done")) == (RequestState.LOST, RequestState.LOST)
    store.close()


def test_reopen_warns_of_the_pending_requests_only(store: Store, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    store.requests.record("r-pending", RUN, "forward_backward")
    store.requests.record("r-done", RUN, "optim_step")
    store.requests.finish(finish("r-done"))
    store = reopen(store, clock)
    store.close()
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == ["1 requests pending at the last stop are now lost"]


def test_request_states_read_as_their_strings(store: Store) -> None:
    store.requests.record("r-1", RUN, "sample")
    assert store.requests.state("r-1") == "pending"
    store.requests.finish(finish("r-1"))
    assert store.requests.state("r-1") == "done"


def test_unknown_request_has_no_state(store: Store) -> None:
    assert store.requests.state("r-none") is None


def test_finishing_an_unknown_request_logs_nothing(store: Store) -> None:
    store.requests.finish(finish("r-none"))
    assert store.requests.state("r-none") is None


def test_a_request_finished_twice_keeps_its_first_finish(store: Store, clock: Clock) -> None:
    store.requests.record("r-1", RUN, "sample")
    store.requests.finish(finish("r-1", at=T0 + timedelta(seconds=2)))
    store.requests.finish(finish("r-1", at=T0 + timedelta(seconds=9)))
    assert store.requests.of_session(RUN.split(":")[0]) == [("r-1", RUN, "sample", T0, T0 + timedelta(seconds=2))]


def test_duplicate_request_id_is_a_conflict(store: Store) -> None:
    store.requests.record("r-1", RUN, "sample")
    with pytest.raises(Conflict):
        store.requests.record("r-1", RUN, "sample")


def test_prune_requests_forgets_old_finished_ones_only(store: Store, clock: Clock) -> None:
    store.requests.record("r-old", RUN, "sample")
    store.requests.finish(finish("r-old"))
    store.requests.record("r-pending", RUN, "sample")
    clock.advance(60)
    store.requests.record("r-new", RUN, "sample")
    store.requests.finish(finish("r-new", at=clock.now))
    assert store.requests.prune(T0 + timedelta(seconds=30)) == 1
    assert [store.requests.state(r) for r in ("r-old", "r-pending", "r-new")] == [None, "pending", "done"]


# --- the data dir -----------------------------------------------------------------------------------


def test_second_open_of_the_same_data_dir_is_refused(store: Store, clock: Clock) -> None:
    with pytest.raises(ServerError) as excinfo:
        Store.open(store.data_dir, now=clock)
    assert excinfo.value.detail == f"data dir {store.data_dir} is in use by another openrld process"


def test_database_is_in_wal_mode(store: Store) -> None:
    with writer_connection(store.data_dir) as reader:
        assert reader.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_database_of_another_schema_version_is_refused(store: Store, clock: Clock) -> None:
    store.close()
    with writer_connection(store.data_dir) as writer:
        writer.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(ServerError) as excinfo:
        Store.open(store.data_dir, now=clock)
    assert excinfo.value.detail == (
        f"{store.data_dir / 'openrld.sqlite3'} has schema version 99; this openrld reads version 1"
    )


def test_data_dir_is_free_again_after_a_refused_open(store: Store, clock: Clock) -> None:
    store.close()
    with writer_connection(store.data_dir) as writer:
        writer.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(ServerError):
        Store.open(store.data_dir, now=clock)
    with writer_connection(store.data_dir) as fixer:
        fixer.execute("UPDATE schema_version SET version = 1")
    Store.open(store.data_dir, now=clock).close()


def test_statistics_count_what_is_stored(store: Store) -> None:
    add_session(store)
    add_run(store)
    store.samplers.create("s-1:sample:0", "s-1", "alice", "m", None, None)
    store.checkpoints.add(RUN, W, "a", "alice", 100, {}, None)
    store.checkpoints.add(RUN, S, "b", "alice", None, {}, None)
    store.requests.record("r-1", RUN, "sample")
    assert store.statistics() == StoreStatistics(
        sessions=1, runs=1, samplers=1, checkpoints=2, checkpoint_bytes=100, pending_requests=1
    )
