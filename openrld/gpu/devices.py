"""The compute devices of this node: what the hardware has, or what config names.

`auto` picks the first CUDA device when there is one, else the CPU. Nothing
here knows about jobs or placement; it only answers what a device string means.
"""

from __future__ import annotations

import msgspec
import torch


class DeviceInfo(msgspec.Struct, frozen=True):
    name: str  # "cpu" or "cuda:0"
    kind: str  # "cpu" or "cuda"
    memory_bytes: int


def resolve_device(spec: str) -> torch.device:
    """`auto`, `cpu`, `cpu:N`, `cuda` or `cuda:N` -> a torch device that exists here.

    Raises:
        ValueError: the string names no device, or a CUDA device this machine lacks.
    """
    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec.startswith("cpu"):
        return torch.device("cpu")  # cpu:N are placement labels; torch has one CPU device
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: this machine has no CUDA device")
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA devices here")
        return device
    raise ValueError(f"device {spec!r}: expected auto, cpu, cpu:N, cuda or cuda:N")


def describe(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(name=str(device), kind="cuda", memory_bytes=int(props.total_memory))
    import os

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceInfo(name="cpu", kind="cpu", memory_bytes=int(pages))
