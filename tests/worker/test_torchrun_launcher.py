"""A torchrun group of 2 CPU ranks behind one worker endpoint: every call runs on every
rank, rank 0 answers, a rank's error names it, a lost rank fails the call and takes the
whole group down, and nothing of the group outlives it.

The ranks run tests/worker/rank_worker.py (a trainer whose calls all-reduce over gloo).
torchrun and 2 interpreters with torch take a few seconds to start, so the tests that
leave the group running share one.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from in_call import InCall, entered

from openrld.batches import ForwardBackwardBatch, TrainDatum
from openrld.errors import EngineLost, ServerError
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.hosting import WorkerHosting
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.launchers.torchrun import TorchrunGroup, TorchrunLauncher, group_devices
from openrld.worker.protocol import Start
from openrld.worker.ranks import rank_device
from tests.processes import running

RANK_WORKER = Path(__file__).with_name("rank_worker.py")
# Two interpreters importing torch on two shared cores: seconds, not the default's minutes.
TIMEOUTS = WorkerTimeouts(hello_s=60.0, heartbeat_s=0.2, deadline_s=10.0, stop_s=10.0)
BATCH = ForwardBackwardBatch(
    data=[TrainDatum(tokens=np.arange(4), inputs={"target_tokens": np.arange(1, 5)})],
    loss_fn="cross_entropy", loss_config={}, forward_only=False,
)
LOST = "the weights and optimizer state it held are gone: resume from a saved state (load_state, or load_state_with_optimizer)"


def start_group(directory: Path, options: dict | None = None) -> tuple[RemoteTrainer, TorchrunGroup]:
    launcher = TorchrunLauncher(sys.executable, 2, (str(RANK_WORKER),))
    spec = WorkerSpec(name="rank group", role="trainer", start=Start("rank", "/nowhere", "cpu", options=options or {}))
    connection, _ = start_worker(launcher, spec, directory, timeouts=TIMEOUTS)
    return RemoteTrainer(connection), connection.worker


def group_pids(group: TorchrunGroup) -> list[int]:
    ranks = group.rank_pids()
    assert len(ranks) == 2, f"torchrun runs {ranks}, not 2 ranks"
    return [group.process.pid, *ranks]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    trainer, _group = start_group(socket_directory(tmp_path_factory.mktemp("sockets")))
    yield trainer
    trainer.close()


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("device", "nproc", "expected"),
    [
        ("cpu", 2, ("cpu", None)),
        ("cuda", 2, ("cuda", None)),
        ("cuda:2,3", 2, ("cuda:0,1", "2,3")),
        ("cuda:5,1,7,0", 4, ("cuda:0,1,2,3", "5,1,7,0")),
    ],
    ids=["cpu", "every-visible-gpu", "two-gpus", "four-gpus-out-of-order"],
)
def test_a_groups_devices_are_hidden_and_renumbered_for_its_ranks(device, nproc, expected):
    assert group_devices(device, nproc) == expected


def test_a_device_list_whose_length_is_not_nproc_is_refused():
    with pytest.raises(ValueError, match=r"^a torchrun group of 2 ranks was given 3 device\(s\): 'cuda:1,2,3'$"):
        group_devices("cuda:1,2,3", 2)


@pytest.mark.parametrize(
    ("device", "local_rank", "expected"),
    [("cpu", 1, "cpu"), ("cuda", 1, "cuda:1"), ("cuda:0,1", 1, "cuda:1"), ("cuda:0", 1, "cuda:0")],
    ids=["cpu", "cuda-by-local-rank", "its-entry-of-the-list", "one-device-shared"],
)
def test_each_rank_builds_on_its_own_device(device, local_rank, expected):
    assert rank_device(device, local_rank) == expected


def test_hosting_gives_several_devices_a_torchrun_group_in_the_builtin_launchers_python(tmp_path):
    hosting = WorkerHosting(builtin=ProcessLauncher("/opt/automodel/bin/python"), socket_root=tmp_path)
    launcher = hosting.launcher_for("full_trainer", nproc=4)
    hosting.close()
    assert isinstance(launcher, TorchrunLauncher)
    assert (launcher.python, launcher.nproc, launcher.command) == ("/opt/automodel/bin/python", 4, ("-m", "openrld.worker"))


def test_hosting_runs_no_image_as_a_torchrun_group():
    with pytest.raises(ServerError, match=r"^image my/trainer:1: an image runs on one device"):
        WorkerHosting.inproc().launcher_for("full_trainer", "my/trainer:1", nproc=2)


# ---------------------------------------------------------------- a running group


def test_a_call_runs_on_every_rank_and_rank_0_answers_with_the_reduced_values(shared):
    result = shared.forward_backward("sum", BATCH)
    # ranks 0 + 1; one per rank; tokens 0+1+2+3 = 6 on each rank, through rank 0's broadcast.
    assert result.metrics == {"ranks:sum": 1.0, "world:size": 2.0, "tokens:sum": 12.0}


def test_buffers_in_shared_memory_reach_every_rank_whole(shared):
    tokens = np.arange(100_000)  # 800,000 bytes: over frames.SHARED_MIN_BYTES, so a memfd to rank 0
    batch = ForwardBackwardBatch(
        data=[TrainDatum(tokens=tokens, inputs={"target_tokens": tokens + 1})],
        loss_fn="cross_entropy", loss_config={}, forward_only=False,
    )
    # 0 + 1 + ... + 99,999 = 4,999,950,000 on each of the 2 ranks; exact in float64.
    assert shared.forward_backward("sum", batch).metrics["tokens:sum"] == 9_999_900_000.0


def test_an_error_on_rank_1_alone_fails_the_call_naming_rank_1_and_the_group_serves_on(shared):
    with pytest.raises(ValueError, match=r"^rank 1 of 2 failed: rank 1 refuses$"):
        shared.forward_backward("fail:1", BATCH)
    assert shared.forward_backward("sum", BATCH).metrics == {"ranks:sum": 1.0, "world:size": 2.0, "tokens:sum": 12.0}


def test_an_error_on_every_rank_names_them_all_and_gives_the_first_ones_error(shared):
    with pytest.raises(ValueError, match=r"^ranks 0, 1 of 2 failed; rank 0: rank 0 refuses$"):
        shared.forward_backward("fail:all", BATCH)


def test_sigkill_of_rank_1_mid_call_raises_engine_lost_and_leaves_no_process_of_the_group(tmp_path, socket_root):
    fifo = tmp_path / "entered"
    os.mkfifo(fifo)
    trainer, group = start_group(socket_directory(socket_root), {"fifo": str(fifo)})
    pids = group_pids(group)
    call = InCall(lambda: trainer.forward_backward("block:1", BATCH))
    rank_1 = int(entered(fifo, "rank 1"))  # it wrote its pid: it is inside forward_backward
    assert rank_1 == pids[2]
    os.kill(rank_1, signal.SIGKILL)
    [error] = call.join()
    assert isinstance(error, EngineLost)
    assert str(error) == f"rank group died (exit status 1); {LOST}"
    assert running(pids) == []


def test_close_ends_every_rank_and_torchrun_exits_0(socket_root):
    trainer, group = start_group(socket_directory(socket_root))
    pids = group_pids(group)
    trainer.close()
    assert group.poll() == 0
    assert running(pids) == []


def test_stop_of_a_group_that_runs_on_ends_torchrun_and_every_rank(socket_root):
    _, group = start_group(socket_directory(socket_root))
    pids = group_pids(group)
    group.stop(0.0)  # no Bye: SIGTERM to torchrun, which stops its ranks and exits 1
    assert group.poll() == 1
    assert running(pids) == []


def test_kill_ends_torchrun_and_every_rank_with_sigkill_and_no_grace(socket_root):
    # A member whose span's home is gone: torchrun's SIGTERM would wait on the home's rendezvous.
    _, group = start_group(socket_directory(socket_root))
    pids = group_pids(group)
    group.kill()
    assert group.poll() == -signal.SIGKILL
    assert running(pids) == []


class ExitedTorchrun:
    """A torchrun that has exited by the time `stop` first waits for it; records that wait."""

    pid = 0

    def __init__(self) -> None:
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        return 0


@pytest.mark.parametrize(("bye_s", "waited"), [(None, 10.0), (2.0, 2.0), (30.0, 10.0)])
def test_a_spans_group_waits_for_its_bye_at_most_its_bye_s(bye_s, waited):
    torchrun = ExitedTorchrun()
    TorchrunGroup(torchrun, "cpu", "rank group", 2, bye_s=bye_s).stop(10.0)  # type: ignore[arg-type]
    assert torchrun.waits == [waited]


def test_the_daemons_end_of_the_connection_while_idle_stops_every_rank_in_order(socket_root):
    trainer, group = start_group(socket_directory(socket_root))
    pids = group_pids(group)
    trainer.connection.frames.close()  # no Bye: EOF, as when the daemon dies
    group.stop(TIMEOUTS.stop_s)
    assert group.poll() == 0
    assert running(pids) == []


def test_a_build_that_fails_on_rank_1_is_reported_naming_rank_1_and_the_group_is_reaped(socket_root):
    launched: list[TorchrunGroup] = []

    class Keeps(TorchrunLauncher):
        def launch(self, spec, socket_path, environment):
            launched.append(super().launch(spec, socket_path, environment))
            return launched[-1]

    spec = WorkerSpec(name="rank group", role="trainer",
                      start=Start("rank", "/nowhere", "cpu", options={"fail_build_on_rank": 1}))
    with pytest.raises(ServerError, match=(
        r"^the worker could not build its engine: rank 1 of 2 failed: RuntimeError: no weights on rank 1$"
    )):
        start_worker(Keeps(sys.executable, 2, (str(RANK_WORKER),)), spec, socket_directory(socket_root), timeouts=TIMEOUTS)
    [group] = launched
    assert group.poll() is not None
    assert group.rank_pids() == []
