"""A TorchTrainer in a process of its own (gpu/engine_process.py) against one in this process.

The child is a fresh interpreter with the same torch thread count, so its float32 results
are the in-process engine's bit for bit; the tests compare with `==`.
"""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import engine_processes

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest, Conflict, EngineLost
from openrld.gpu import engine_process
from openrld.gpu.engine_process import TrainerProcess
from openrld.gpu.engines import build_lora_trainer

CPU = torch.device("cpu")
SPEC = LoraSpec(rank=4, seed=3)
ADAM = AdamParams(learning_rate=1e-2)


def batch(seed: int, rows: int = 3, length: int = 9) -> ForwardBackwardBatch:
    tokens = np.random.default_rng(seed).integers(3, 300, size=(rows, length + 1))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in tokens]
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path):
    """(in a child process, in this one), each with adapter "a"; the child is stopped after the module."""
    build = partial(build_lora_trainer, tiny_llama, CPU, 4096)
    remote = TrainerProcess(build, threads=torch.get_num_threads(), name="test")
    local = build()
    for engine in (remote, local):
        engine.add_adapter("a", SPEC)
    yield remote, local
    remote.close()


def test_training_steps_match_the_engine_in_this_process_exactly(engines):
    remote, local = engines
    for step in range(3):
        results = [engine.forward_backward_many("a", [batch(step), batch(step + 10)]) for engine in engines]
        optimised = [engine.optim_step("a", ADAM) for engine in engines]
        assert [r.metrics for r in results[0]] == [r.metrics for r in results[1]]
        for there, here in zip(results[0], results[1]):
            assert all(np.array_equal(a, b) for a, b in zip(there.logprobs, here.logprobs))
        assert optimised[0].metrics == optimised[1].metrics
    there, here = remote.adapter_tensors("a"), local.adapter_tensors("a")
    assert sorted(there) == sorted(here)
    assert all(torch.equal(there[key], here[key]) for key in here)


def test_a_user_error_crosses_with_its_type_status_and_detail(engines):
    remote, _ = engines
    with pytest.raises(Conflict) as raised:
        remote.add_adapter("a", SPEC)
    assert raised.value.status == 409
    assert raised.value.detail == "adapter 'a' already exists"


def test_a_bad_datum_is_refused_and_the_process_carries_on(engines):
    remote, _ = engines
    bad = ForwardBackwardBatch(
        data=[TrainDatum(tokens=np.arange(3, 8), inputs={"target_tokens": np.arange(3, 7)})],
        loss_fn="cross_entropy", loss_config={}, forward_only=False,
    )
    with pytest.raises(BadRequest):
        remote.forward_backward("a", bad)
    assert remote.has_adapter("a") is True


def test_save_state_writes_into_the_directory_it_is_given(engines, tmp_path: Path):
    remote, _ = engines
    size = remote.save_state("a", tmp_path, True)
    written = sum(path.stat().st_size for path in tmp_path.rglob("*") if path.is_file())
    assert size == written
    assert (tmp_path / "state.json").is_file()


def test_a_property_of_the_engine_reads_through(engines):
    remote, _ = engines
    assert remote.is_parked is False


def test_a_killed_process_fails_the_next_call_and_every_later_one(tiny_llama: Path):
    engine = TrainerProcess(partial(build_lora_trainer, tiny_llama, CPU, 4096), threads=1, name="doomed")
    os.kill(engine.pid, signal.SIGKILL)
    died = r"trainer process doomed died \(exit status -9\); the weights and optimizer state it held are gone"
    with pytest.raises(EngineLost, match=died):
        engine.adapter_names()
    with pytest.raises(EngineLost, match="trainer process doomed was closed"):
        engine.adapter_names()


def test_a_failed_build_raises_its_error_and_leaves_no_process(tmp_path: Path):
    before = engine_processes(os.getpid())
    with pytest.raises(OSError):
        TrainerProcess(partial(build_lora_trainer, tmp_path / "missing", CPU, 4096), threads=1, name="unbuilt")
    assert engine_processes(os.getpid()) == before


def test_close_stops_the_child(tiny_llama: Path):
    engine = TrainerProcess(partial(build_lora_trainer, tiny_llama, CPU, 4096), threads=1, name="closed")
    pid = engine.pid
    engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(EngineLost, match="was closed"):
        engine.adapter_names()


def test_a_fault_in_the_child_carries_the_childs_traceback(engines, tmp_path: Path):
    remote, _ = engines
    (tmp_path / "taken").write_text("a file where a directory should be")
    with pytest.raises(OSError) as raised:
        remote.save_state("a", tmp_path / "taken" / "state", True)
    assert "in save_state" in raised.value.__notes__[0]


def test_the_child_keeps_its_working_set_in_mallocs_heap(engines):
    remote, _ = engines
    environment = Path(f"/proc/{remote.pid}/environ").read_bytes().split(b"\0")
    assert b"MALLOC_MMAP_THRESHOLD_=33554432" in environment
    assert b"MALLOC_TRIM_THRESHOLD_=1073741824" in environment


def test_an_operators_malloc_setting_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert engine_process._child_environment()["MALLOC_TRIM_THRESHOLD_"] == "131072"
