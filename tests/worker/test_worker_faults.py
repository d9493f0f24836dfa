"""A worker that dies, hangs, never says hello or breaks the protocol fails its engine
with a clear error, is stopped and reaped, and runs nothing in the daemon.

The workers are real processes started by the process launcher; each runs
tests/worker/hostile_worker.py in one of its modes (a stand-in for an image the
operator did not write).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from openrld.batches import ForwardBackwardBatch, TrainDatum
from openrld.errors import EngineLost, ServerError
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.protocol import PROTOCOL_VERSION, Start

HOSTILE = Path(__file__).with_name("hostile_worker.py")
QUICK = WorkerTimeouts(hello_s=5.0, heartbeat_s=0.2, deadline_s=1.0, stop_s=1.0)
BATCH = ForwardBackwardBatch(
    data=[TrainDatum(tokens=np.arange(4), inputs={"target_tokens": np.arange(1, 5)})],
    loss_fn="cross_entropy", loss_config={}, forward_only=False,
)


class Launches(ProcessLauncher):
    """The process launcher, keeping what it launched, so a test can see it was reaped."""

    def __init__(self) -> None:
        super().__init__(sys.executable, (str(HOSTILE),))
        self.launched = []

    def launch(self, spec, socket_path, environment):
        worker = super().launch(spec, socket_path, environment)
        self.launched.append(worker)
        return worker


@pytest.fixture
def hostile(tmp_path: Path, socket_root: Path, monkeypatch: pytest.MonkeyPatch):
    """start(mode, timeouts) -> (a RemoteTrainer or the error, the launcher)."""
    monkeypatch.setenv("OPENRLD_TEST_PWNED", str(tmp_path / "pwned"))
    directory = socket_directory(socket_root)

    def start(mode: str, timeouts: WorkerTimeouts = QUICK):
        monkeypatch.setenv("OPENRLD_TEST_HOSTILE", mode)
        launcher = Launches()
        spec = WorkerSpec(name=f"hostile {mode}", role="trainer", start=Start("lora_trainer", "/nowhere", "cpu"))
        connection, _ = start_worker(launcher, spec, directory, timeouts=timeouts)
        return RemoteTrainer(connection), launcher

    yield start
    assert not (tmp_path / "pwned").exists(), "a worker's bytes ran code in the daemon"


def reaped(launcher: Launches) -> bool:
    return all(worker.poll() is not None for worker in launcher.launched)


def test_a_worker_that_exits_before_it_connects_is_reported_with_its_status(hostile):
    with pytest.raises(EngineLost, match=r"hostile exit_early exited \(status 3\) before it connected"):
        hostile("exit_early")


def test_a_worker_that_never_connects_is_stopped_after_the_hello_deadline(hostile):
    with pytest.raises(EngineLost, match="hostile never_connect did not connect within 1 s; it was stopped"):
        hostile("never_connect", WorkerTimeouts(hello_s=1.0, deadline_s=1.0, stop_s=1.0))


def test_a_worker_that_connects_and_never_says_hello_is_lost(hostile):
    with pytest.raises(EngineLost, match="hostile never_hello fell silent before it was ready"):
        hostile("never_hello", WorkerTimeouts(hello_s=1.0, deadline_s=1.0, stop_s=1.0))


def test_a_hello_with_another_token_is_refused(hostile):
    with pytest.raises(EngineLost, match=r"broke the worker protocol before it was ready \(its hello carries another token"):
        hostile("bad_token")


def test_a_hello_of_another_protocol_version_names_both_versions(hostile):
    expected = f"speaks worker protocol version {PROTOCOL_VERSION + 41}, and this daemon speaks {PROTOCOL_VERSION}"
    with pytest.raises(ServerError, match=expected):
        hostile("old_version")


def test_a_pickled_hello_is_refused_and_never_unpickled(hostile):
    with pytest.raises(EngineLost, match=r"broke the worker protocol before it was ready \(malformed frame header"):
        hostile("pickle_hello")


def test_a_failed_build_reaches_the_caller_with_the_workers_reason(hostile):
    with pytest.raises(ServerError, match="RuntimeError: no such model in this image"):
        hostile("build_fails")


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("die_in_call", r"died \(exit status 9\)"),
        ("hang_in_call", "sent nothing for 1 s during a call"),
        ("garbage_header", "broke the worker protocol .malformed frame header"),
        ("oversized_header", "broke the worker protocol .frame header of 2147483648 bytes is over the limit"),
        ("oversized_buffer", "broke the worker protocol .a frame of 1099511627776 bytes is over the limit"),
        ("pickle_result", "broke the worker protocol .a value that does not fit its type"),
        ("wrong_shape", r"broke the worker protocol .a float32 tensor of shape \[5\] over a buffer of 16 bytes"),
        ("wrong_dtype", "broke the worker protocol .a tensor of unknown dtype 'complex128'"),
        ("bad_buffer_index", "broke the worker protocol .a tensor points at buffer 7, and the frame has 1"),
        ("wrong_type", "broke the worker protocol .a value that does not fit its type"),
        ("unexpected_message", "broke the worker protocol .a Ready message where a result was due"),
        ("unsealed_memfd", "broke the worker protocol .the shared memory is not sealed against shrinking and growing"),
        ("unannounced_fds", "broke the worker protocol .too many file descriptors"),
    ],
)
def test_a_worker_that_breaks_a_call_is_lost_stopped_and_stays_lost(hostile, mode, why):
    trainer, launcher = hostile(mode)
    with pytest.raises(EngineLost, match=f"hostile {mode} {why}") as first:
        trainer.forward_backward("a", BATCH)
    assert "resume from a saved state" in first.value.detail
    assert reaped(launcher)
    with pytest.raises(EngineLost) as again:
        trainer.has_adapter("a")
    assert again.value is first.value


def test_a_dead_daemons_socket_directory_is_removed_and_a_live_ones_kept(socket_root: Path):
    dead = socket_root / "openrld-999999999-0badcafe"  # no such pid
    dead.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(dead / "w-1.sock"))
    stale.close()
    alive = socket_root / f"openrld-{os.getpid()}-00000000"
    alive.mkdir()
    mine = socket_directory(socket_root)
    assert sorted(p.name for p in socket_root.iterdir()) == sorted([alive.name, mine.name])
