"""The node's device inventory: from config (CPU placement labels) or from the hardware."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch

from openrld.gpu.devices import (
    CudaFacts,
    DeviceInfo,
    cpu_threads,
    detected_device_names,
    group_device,
    inventory,
    resolve_device,
    why_no_cuda,
)

HOST_MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_configured_cpu_labels_are_each_a_device_with_the_host_memory():
    records = inventory(["cpu:0", "cpu:1"])
    assert [(r.name, r.kind, r.memory_bytes) for r in records] == [
        ("cpu:0", "cpu", HOST_MEMORY), ("cpu:1", "cpu", HOST_MEMORY),
    ]
    assert all(0 < r.free_bytes <= HOST_MEMORY for r in records)


def test_no_configured_devices_on_a_cpu_machine_is_the_one_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert [(r.name, r.kind) for r in inventory([])] == [("cpu", "cpu")]


def test_a_pinned_device_option_is_the_only_device():
    assert detected_device_names("cpu") == ["cpu"]


def test_a_device_listed_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"device 'cpu:1' is listed twice"):
        inventory(["cpu:1", "cpu:1"])


@pytest.mark.parametrize("spec", ["gpu0", "cpu:x", "cpux"], ids=["gpu0", "cpu-letter", "cpux"])
def test_a_malformed_device_string_is_refused_naming_it(spec: str):
    with pytest.raises(ValueError, match=f"device '{spec}'"):
        resolve_device(spec)


@pytest.mark.gpu
@needs_cuda
def test_auto_takes_every_cuda_device_with_its_memory():
    records = inventory([], "auto")
    assert [r.name for r in records] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for record in records:
        _free, total = torch.cuda.mem_get_info(torch.device(record.name))
        assert isinstance(record, DeviceInfo) and record.kind == "cuda" and record.memory_bytes == total
        assert 0 < record.free_bytes <= total


CPU = DeviceInfo("cpu", "cpu", 1, 1)
CUDA = DeviceInfo("cuda:0", "cuda", 1, 1)


def test_cpu_threads_give_each_cpu_device_all_its_share_of_the_cores():
    assert [cpu_threads(0, [CPU], cores) for cores in (1, 2, 3, 16)] == [1, 2, 3, 16]
    assert cpu_threads(0, [CPU, msgspec.structs.replace(CPU, name="cpu:1")], 16) == 8
    assert cpu_threads(0, [CPU, msgspec.structs.replace(CPU, name="cpu:1")], 3) == 1


def test_configured_cpu_threads_are_taken_as_they_are():
    assert cpu_threads(6, [CPU], 2) == 6


def test_a_node_without_a_cpu_device_keeps_torchs_default_threads():
    assert cpu_threads(0, [CUDA], 64) is None


GPU_NODE = CudaFacts(
    torch_version="2.13.0+cu128", torch_cuda="12.8", driver_loaded=True, device_nodes=True,
    gke_driver_libs=False, ld_library_path="",
)


def test_why_no_cuda_names_a_cpu_build_of_torch_first():
    facts = msgspec.structs.replace(GPU_NODE, torch_version="2.13.0+cpu", torch_cuda=None, driver_loaded=False)
    assert why_no_cuda(facts).startswith("the installed torch (2.13.0+cpu) is a CPU build; install a CUDA build")


def test_why_no_cuda_names_gkes_library_path_when_the_driver_libraries_are_mounted_but_not_on_it():
    facts = msgspec.structs.replace(GPU_NODE, gke_driver_libs=True, ld_library_path="/usr/lib")
    assert why_no_cuda(facts) == (
        "the NVIDIA driver's libraries are mounted at /usr/local/nvidia/lib64 but LD_LIBRARY_PATH does not include "
        "it; set LD_LIBRARY_PATH=/usr/local/nvidia/lib64 in the container (GKE)"
    )


def test_why_no_cuda_says_no_driver_when_there_is_neither_the_module_nor_a_device_node():
    facts = msgspec.structs.replace(GPU_NODE, driver_loaded=False, device_nodes=False)
    assert why_no_cuda(facts).startswith("no NVIDIA driver is loaded (/proc/driver/nvidia/version and /dev/nvidia0")


def test_why_no_cuda_says_the_device_nodes_are_hidden_when_only_the_driver_is_there():
    facts = msgspec.structs.replace(GPU_NODE, device_nodes=False)
    assert why_no_cuda(facts).startswith("the driver is loaded but /dev/nvidia0 is not visible here")


def test_why_no_cuda_points_at_the_driver_version_when_everything_else_is_in_place():
    assert why_no_cuda(GPU_NODE).startswith("torch (CUDA 12.8) cannot initialise the driver")


def test_a_node_told_to_use_cuda_without_one_refuses_to_start_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--data-dir", str(tmp_path), "--device", "cuda"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == f"openrld: device 'cuda': no CUDA device is usable here: {why_no_cuda(CudaFacts.here())}\n"


def test_a_torchrun_group_on_cpu_devices_sees_the_cpu():
    assert group_device(["cpu:0", "cpu:1"]) == "cpu"


def test_a_torchrun_group_on_gpus_names_their_indices_in_rank_order():
    assert group_device(["cuda:3", "cuda:1"]) == "cuda:3,1"


def test_a_torchrun_group_on_mixed_devices_is_refused():
    with pytest.raises(ValueError, match=r"must all be cpu or all cuda:N, got \['cpu:0', 'cuda:1'\]"):
        group_device(["cpu:0", "cuda:1"])
