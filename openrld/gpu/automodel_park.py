"""Parking the Automodel trainer: each rank's device storages emptied to host memory and refilled in place.

What it owns: the time-slicer's park and resume of one rank of an FSDP2 model
(`gpu/automodel_trainer.py`). Parking finds the distinct storages behind everything
the rank keeps on its device (each parameter's local shard, each gradient's, the
buffers, the optimizer's state; the engine names the tensors), copies each storage's
bytes to a host buffer (pinned on CUDA), and shrinks the storage to 0 bytes, so the
device memory goes back to the allocator (`torch.cuda.empty_cache()` then releases it).
Resuming grows each storage back to its size and copies its bytes in.

Why by hand: no library parks FSDP2 shards in place (FSDP2 itself only frees the
all-gathered whole weights between passes, and `torch.distributed`'s CPU offload keeps
the shards on the host for good), and `offload.py`'s move, which gives each tensor a new
storage (`tensor.data = copy`), would break FSDP2's sharing: a DTensor's local shard is
a view into a padded storage of FSDP2's own (`_sharded_param_data`), and one FSDP2 group's
gradients are views into one reduce-scatter output. Emptying and refilling the storages
themselves keeps every view, every DTensor, every parameter and optimizer-state object
what it was: only the bytes behind them leave and come back.

Guarantees: after `resume` every storage holds the bytes it held before `park`, bit for
bit; a storage shared by many views is moved once; storages of 0 bytes (FSDP2's freed
all-gather outputs) are left alone; nothing is moved unless every storage can be (a
storage torch does not own, such as numpy's, is refused before any copy; storages shrink
only once every copy is done, so a failed copy leaves them all as they were). `StorageSlot`
refuses a second park, a resume when nothing is parked, and compute while parked, with
`offload.ParkSlot`'s messages. It runs the same on every device: on a CPU the "device" is
the host, so parking is a copy within host memory, which lets one test the very path a
GPU takes on a CPU.

What it never does: know about jobs, requests or turns; run collectives (every rank
parks its own storages, and the report is its own device's); import trio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from openrld.engine_types import ParkReport, ResumeReport
from openrld.gpu.offload import Slot

__all__ = ["ParkedStorages", "StorageSlot", "distinct_storages", "empty_to_host", "fsdp_module_tensors", "refill"]

logger = logging.getLogger(__name__)


class ParkedStorages:
    """Emptied storages and the host buffers that hold their bytes until `refill`."""

    def __init__(self, device: torch.device, storages: list[torch.UntypedStorage], host: list[torch.Tensor]) -> None:
        self.device = device
        self.storages = storages
        self.host = host  # uint8 (nbytes,) each, in the order of `storages`

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self.host)


# ---------------------------------------------------------------------------
# Naming what lives on the device


def fsdp_module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's local shard, its gradient's, and every buffer of an FSDP2 `module`.

    Every FSDP2 module is resharded first (`FSDPModule.reshard`, a no-op when it is): the
    root keeps its all-gathered weights after a forward until its backward, and only
    when resharded does the module hold its shards as its parameters.
    """
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    found: list[torch.Tensor] = []
    for param in module.parameters():
        found.append(_local(param))
        if param.grad is not None:
            found.append(_local(param.grad))
    found.extend(module.buffers())
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor is a wrapper with no storage of its own; its rank's shard is what is on the device.
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def distinct_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages behind `tensors` that live on `device`, in first-seen order.

    Views of one storage give it once (found by the address of its bytes). Storages of
    0 bytes hold nothing to move: FSDP2 frees its all-gathered weights that way.

    Raises:
        ValueError: a storage cannot be resized (memory torch does not own: numpy's, a mapped file's).
    """
    chosen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        if not _is_on(tensor, device):
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in chosen:
            continue
        if not storage.resizable():
            raise ValueError(
                f"cannot park: a {tuple(tensor.shape)} {tensor.dtype} tensor's storage ({storage.nbytes()} bytes) "
                "is not resizable (memory torch does not own)"
            )
        chosen[storage.data_ptr()] = storage
    return list(chosen.values())


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    # torch.device("cuda") has no index; it means the current device.
    return device.index is None or tensor.device.index == device.index


# ---------------------------------------------------------------------------
# Moving


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (no copy), to copy its bytes with."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def empty_to_host(storages: Sequence[torch.UntypedStorage], device: torch.device) -> ParkedStorages:
    """Copy each storage's bytes to a host buffer (pinned on CUDA), then shrink the storage to 0 bytes."""
    pinned = device.type == "cuda"  # pinned memory lets the copies run at full PCIe/NVLink speed
    host = []
    for storage in storages:
        buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pinned)
        buffer.copy_(_bytes_of(storage), non_blocking=pinned)
        host.append(buffer)
    if pinned:
        torch.cuda.synchronize(device)  # every copy is complete before its source goes
    for storage in storages:
        storage.resize_(0)
    return ParkedStorages(device, list(storages), host)


def refill(parked: ParkedStorages) -> int:
    """Grow each storage back to its size and copy its bytes in; the bytes copied."""
    pinned = parked.device.type == "cuda"
    for storage, buffer in zip(parked.storages, parked.host, strict=True):
        storage.resize_(buffer.numel())
        _bytes_of(storage).copy_(buffer, non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize(parked.device)  # the bytes are in place before anyone computes
    return parked.nbytes


# ---------------------------------------------------------------------------
# The engine's slot


class StorageSlot(Slot[ParkedStorages]):
    """One rank's parking: its device state found anew at each park (`state`: the tensors
    it keeps on `device`), emptied to the host, and refilled at resume.

    The refusals and their messages are `offload.Slot`'s, as `ParkSlot`'s are, so an engine
    reads the same whichever slot it parks with.
    """

    def park(self) -> ParkReport:
        """Empty every storage of the engine's device state to host memory.

        Returns:
            This rank's report: `tensors` counts storages; `bytes_held` and `bytes_moved` are
            their bytes (moved on a CPU too); `device_bytes_freed` is CUDA's allocated memory
            before less after (0 on a CPU, whose host buffers take the bytes back).
        Raises:
            EngineParked: already parked.  ValueError: a storage cannot be resized (see `distinct_storages`).
        """
        self._refuse_second_park()
        start = time.perf_counter()
        storages = distinct_storages(self._state(), self._device)
        is_cuda = self._device.type == "cuda"
        before = torch.cuda.memory_allocated(self._device) if is_cuda else 0
        self._parked = empty_to_host(storages, self._device)
        freed = reserved = 0
        if is_cuda:
            torch.cuda.empty_cache()
            freed = before - torch.cuda.memory_allocated(self._device)
            reserved = torch.cuda.memory_reserved(self._device)
        moved = self._parked.nbytes
        report = ParkReport(
            device=str(self._device), tensors=len(storages), bytes_held=moved, bytes_moved=moved,
            cache_bytes_dropped=0, device_bytes_freed=freed, device_bytes_reserved_after=reserved,
            seconds=time.perf_counter() - start,
        )
        logger.info(
            "parked storages device=%s storages=%d bytes_moved=%d device_bytes_freed=%d seconds=%.3f",
            report.device, report.tensors, report.bytes_moved, report.device_bytes_freed, report.seconds,
        )
        return report

    def resume(self) -> ResumeReport:
        """Refill every parked storage, bit for bit. Raises EngineParked if not parked."""
        parked = self._held()
        start = time.perf_counter()
        moved = refill(parked)
        report = ResumeReport(
            device=str(self._device), tensors=len(parked.storages), bytes_moved=moved,
            seconds=time.perf_counter() - start,
        )
        self._parked = None
        logger.info(
            "resumed storages device=%s storages=%d bytes_moved=%d seconds=%.3f",
            report.device, report.tensors, report.bytes_moved, report.seconds,
        )
        return report
