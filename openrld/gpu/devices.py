"""The compute devices of this node: what the hardware has, or what config names.

This module owns the node's device inventory (`inventory`) and the meaning of a
device string (`resolve_device`). A node's devices come from its config when
the config lists them (`devices = ["cpu:0", "cpu:1"]`, for CPU nodes and
tests), else from the hardware: every CUDA device when there is one, else the
CPU. Each device is a `DeviceInfo` record: name, kind, total memory and the
memory free when it was read. Nothing here knows about jobs, placement or
turns; it never imports trio.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec
import torch

from openrld.gpu import call_threads


class DeviceInfo(msgspec.Struct, frozen=True):
    name: str  # "cpu", "cpu:1" or "cuda:0": the label placement and the status API use
    kind: str  # "cpu" or "cuda"
    memory_bytes: int
    free_bytes: int  # free when the inventory was taken; a CPU device reports the host's available memory


def resolve_device(spec: str) -> torch.device:
    """`auto`, `cpu`, `cpu:N`, `cuda` or `cuda:N` -> a torch device that exists here.

    Raises:
        ValueError: the string names no device, or a CUDA device this machine lacks.
    """
    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu" or (spec.startswith("cpu:") and spec[4:].isdecimal()):
        return torch.device("cpu")  # cpu:N are placement labels; torch has one CPU device
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: no CUDA device is usable here: {why_no_cuda(CudaFacts.here())}")
        try:
            device = torch.device(spec)
        except RuntimeError as exc:
            raise ValueError(f"device {spec!r}: expected cuda or cuda:N") from exc
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA devices here")
        return device
    raise ValueError(f"device {spec!r}: expected auto, cpu, cpu:N, cuda or cuda:N")


def group_device(labels: Sequence[str]) -> str:
    """A torchrun group's `Start.device` from its ranks' device labels, in rank order
    (launchers/torchrun.py): "cpu" for CPU labels, "cuda:2,3" for cuda:2 and cuda:3.

    Raises:
        ValueError: no labels, CPU and CUDA mixed, or a bare "cuda" among several.
    """
    if not labels:
        raise ValueError("a torchrun group needs at least one device")
    if all(label == "cpu" or label.startswith("cpu:") for label in labels):
        return "cpu"
    indices = [label.partition(":")[2] for label in labels if label.startswith("cuda:")]
    if len(indices) != len(labels) or not all(index.isdecimal() for index in indices):
        raise ValueError(f"a torchrun group's devices must all be cpu or all cuda:N, got {list(labels)}")
    return "cuda:" + ",".join(indices)


GKE_DRIVER_LIBS = "/usr/local/nvidia/lib64"  # where GKE's driver installer puts libcuda for containers


class CudaFacts(msgspec.Struct, frozen=True):
    """What decides why CUDA is not usable, read from this machine (or given by a test)."""

    torch_version: str
    torch_cuda: str | None  # None: torch was built without CUDA
    driver_loaded: bool  # the kernel module answers at /proc/driver/nvidia/version
    device_nodes: bool  # /dev/nvidia0 exists in this (container's) view
    gke_driver_libs: bool  # GKE's driver library directory is mounted
    ld_library_path: str

    @classmethod
    def here(cls) -> CudaFacts:
        return cls(
            torch_version=torch.__version__,
            torch_cuda=torch.version.cuda,
            driver_loaded=os.path.exists("/proc/driver/nvidia/version"),
            device_nodes=os.path.exists("/dev/nvidia0"),
            gke_driver_libs=os.path.isdir(GKE_DRIVER_LIBS),
            ld_library_path=os.environ.get("LD_LIBRARY_PATH", ""),
        )


def why_no_cuda(facts: CudaFacts) -> str:
    """The likeliest reason CUDA is unusable, with what to do about it, most basic first."""
    if facts.torch_cuda is None:
        return (
            f"the installed torch ({facts.torch_version}) is a CPU build; install a CUDA build of torch "
            "(the GPU image has one; `pip install torch==<version>` from PyPI on Linux is one)"
        )
    if facts.gke_driver_libs and GKE_DRIVER_LIBS not in facts.ld_library_path.split(":"):
        return (
            f"the NVIDIA driver's libraries are mounted at {GKE_DRIVER_LIBS} but LD_LIBRARY_PATH does not include "
            f"it; set LD_LIBRARY_PATH={GKE_DRIVER_LIBS} in the container (GKE)"
        )
    if not facts.driver_loaded and not facts.device_nodes:
        return (
            "no NVIDIA driver is loaded (/proc/driver/nvidia/version and /dev/nvidia0 are missing); install the "
            "driver on the host, and in a container ask for the GPU (nvidia.com/gpu, or --gpus / CDI)"
        )
    if not facts.device_nodes:
        return (
            "the driver is loaded but /dev/nvidia0 is not visible here; give this process the GPU's device nodes "
            "(a container must request the GPU; under systemd, do not set PrivateDevices)"
        )
    return (
        f"torch (CUDA {facts.torch_cuda}) cannot initialise the driver; check that the driver supports CUDA "
        f"{facts.torch_cuda} (nvidia-smi shows the newest CUDA it supports) and that libcuda.so.1 is found"
    )


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def describe(device: torch.device, name: str | None = None) -> DeviceInfo:
    """The record of one device, named `name` (default: torch's name for it; "cpu" for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceInfo(name=name or str(device), kind="cuda", memory_bytes=int(total), free_bytes=int(free))
    total, available = _host_memory()
    return DeviceInfo(name=name or "cpu", kind="cpu", memory_bytes=int(total), free_bytes=int(available))


def detected_device_names(device: str) -> list[str]:
    """The devices a node with no `devices` list uses, from its `device` option and the hardware.

    `auto` takes every CUDA device there is, else the CPU; anything else pins the node to that one device.
    """
    if device != "auto":
        return [device]
    if torch.cuda.is_available():
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    return ["cpu"]


def inventory(names: Sequence[str], device: str = "auto") -> list[DeviceInfo]:
    """The node's devices: the configured `names`, or, when there are none, what `device` detects.

    Raises:
        ValueError: a name that is malformed, named twice, or a device this machine lacks.
    """
    chosen = list(names) or detected_device_names(device)
    seen: set[str] = set()
    records: list[DeviceInfo] = []
    for name in chosen:
        torch_device = resolve_device(name)
        label = str(torch_device) if name in ("auto", "cuda") else name
        if label in seen:
            raise ValueError(f"device {name!r} is listed twice")
        seen.add(label)
        records.append(describe(torch_device, label))
    return records


def cpu_threads(configured: int, devices: Sequence[DeviceInfo], cores: int | None = None) -> int | None:
    """Torch's intra-op threads for this node's CPU work; None leaves torch's default (no CPU device).

    `configured` > 0 is taken as it is. Otherwise each CPU device gets an equal
    share of the cores, as the ceiling of whichever engine holds the device's turn
    (each call takes as many of them as its size repays, `call_threads`):
    the engines of one device (its trainers, samplers and replicas) take turns
    under one limiter (actors/device_pool.py), so a synchronous RL loop's
    trainer and sampler each compute with every core while the other waits.
    Torch's pool waits passively (openrld/__init__.py), so the idle engine's
    threads hold no core.
    """
    if configured > 0:
        return configured
    cpu_devices = sum(1 for d in devices if d.kind == "cpu")
    if cpu_devices == 0:
        return None
    return max(1, (cores or os.cpu_count() or 1) // cpu_devices)


def apply_cpu_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count for the whole process (its worker threads take it too),
    and the most that one engine call takes (`call_threads`: fewer for small work). None
    changes nothing: an inproc engine's build passes None and keeps the daemon's."""
    if threads is not None:
        torch.set_num_threads(threads)
        call_threads.set_ceiling(threads)
