"""A worker's CUDA_VISIBLE_DEVICES names the daemon's devices as the node does.

A daemon under CUDA_VISIBLE_DEVICES=4,5,6,7 that sends a worker to its cuda:1 means the
node's GPU 5; the worker's own list replaces the daemon's, so it must say 5, not 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from openrld.worker.launchers import WorkerSpec
from openrld.worker.launchers.container import ContainerLauncher
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.launchers.torchrun import group_devices
from openrld.worker.launchers.visible_devices import worker_visible_devices
from openrld.worker.protocol import Start

UUIDS = "GPU-1a2b3c4d-0000-0000-0000-000000000000,GPU-5e6f7a8b-0000-0000-0000-000000000001"


@pytest.mark.parametrize(
    ("indices", "inherited", "expected"),
    [
        (["1"], None, "1"),
        (["1"], "4,5,6,7", "5"),
        (["3", "0"], "4,5,6,7", "7,4"),
        (["1"], UUIDS, "GPU-5e6f7a8b-0000-0000-0000-000000000001"),
        (["0"], "MIG-aaaa, MIG-bbbb", "MIG-aaaa"),
    ],
    ids=["unset", "a-slice", "a-group-in-rank-order", "uuids", "mig-with-spaces"],
)
def test_the_daemons_index_is_its_entry_of_its_own_visible_devices(indices, inherited, expected):
    assert worker_visible_devices(indices, inherited) == expected


def test_an_index_past_the_daemons_devices_is_refused():
    with pytest.raises(ValueError, match=r"^cuda:2 is past the 2 device\(s\) the daemon sees \(CUDA_VISIBLE_DEVICES='4,5'\)$"):
        worker_visible_devices(["2"], "4,5")


def test_a_torchrun_group_under_a_slice_sees_the_slices_devices():
    assert group_devices("cuda:0,2", 2, "4,5,6,7") == ("cuda:0,1", "4,6")


def test_a_worker_process_under_a_slice_runs_on_the_nodes_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen = tmp_path / "env"
    probe = f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    spec = WorkerSpec(name="w", role="sampler", start=Start("vllm_sampler", "/m", "cuda:1"))
    worker = ProcessLauncher(sys.executable, ("-c", probe)).launch(spec, str(tmp_path / "s.sock"), {})
    worker.stop(30)
    assert (seen.read_text(), worker.device) == ("5", "cuda:0")


def test_a_container_worker_under_a_slice_is_given_the_nodes_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    launcher = ContainerLauncher("podman", "n1")
    assert launcher._devices("cuda:1") == (["--device", "nvidia.com/gpu=GPU-bbbb"], "cuda:0")
