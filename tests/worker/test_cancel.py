"""Cancelling the call in flight: an engine that asks `server.cancelled()` stops early."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from in_call import InCall

from openrld.batches import ForwardBackwardBatch, TrainDatum
from openrld.errors import Gone
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.protocol import Start

PATIENT = Path(__file__).with_name("cancellable_worker.py")
BATCH = ForwardBackwardBatch(
    data=[TrainDatum(tokens=np.arange(4), inputs={"target_tokens": np.arange(1, 5)})],
    loss_fn="cross_entropy", loss_config={}, forward_only=False,
)


@pytest.fixture
def patient(tmp_path: Path, socket_root: Path, monkeypatch: pytest.MonkeyPatch):
    marker = tmp_path / "running"
    monkeypatch.setenv("OPENRLD_TEST_MARKER", str(marker))
    spec = WorkerSpec(name="patient", role="trainer", start=Start("lora_trainer", "/nowhere", "cpu"))
    timeouts = WorkerTimeouts(hello_s=30.0, heartbeat_s=0.2, deadline_s=5.0, stop_s=5.0)
    connection, _ = start_worker(
        ProcessLauncher(sys.executable, (str(PATIENT),)), spec, socket_directory(socket_root), timeouts=timeouts
    )
    trainer = RemoteTrainer(connection)
    call = InCall(lambda: trainer.forward_backward("a", BATCH))
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), "the call never began"
    yield trainer, call
    trainer.close()


def test_a_cancelled_call_stops_early_with_the_engines_error(patient):
    trainer, call = patient
    assert trainer.connection.cancel() is True
    outcome = call.join(5)
    assert [type(o) for o in outcome] == [Gone]
    assert outcome[0].detail == "forward_backward stopped: the daemon cancelled it"
    assert trainer.has_adapter("a") is True  # the worker serves on


def test_closing_a_connection_cancels_its_call_in_flight(patient):
    trainer, call = patient
    began = time.monotonic()
    trainer.close()
    outcome = call.join(5)
    assert time.monotonic() - began < 5
    assert [type(o) for o in outcome] == [Gone]
    assert trainer.connection.worker.poll() == 0


def test_with_no_call_in_flight_there_is_nothing_to_cancel(patient):
    trainer, call = patient
    trainer.connection.cancel()
    call.join(5)
    assert trainer.connection.cancel() is False
