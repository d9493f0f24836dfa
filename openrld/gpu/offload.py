"""Parking and resuming a worker's device state, for the time-slicer.

A parked worker gives its device back: its parameters, gradients, buffers and
optimizer state move to pinned host memory, caches that can be recomputed (the
sampler's KV cache) are dropped, and the device's cached blocks are released
(`torch.cuda.empty_cache()`). Resuming copies everything back.

What it owns: the move of one set of tensors between their device and the host,
and the report of what moved. Tensors move *in place*: each tensor object keeps
its identity and only its storage changes (`tensor.data = copy`, the way
`torch.nn.Module._apply` moves parameters). So every holder of a tensor, a
module, an optimizer's moment, a dict of adapter parameters, sees it move
without being told, and the engine is the same engine after `resume`, with every
value bit for bit what it was.

It is generic over engines: an engine names the tensors it keeps on its device
(`module_tensors` for its modules, plus its optimizer state) and the bytes of
caches it dropped; `park` and `resume` do the rest. On a CPU device the host is
the device, so parking moves nothing and keeps everything as it is: a correct
no-op that still drops caches and reports.

Past the node's host-memory budget, the actors may `spill` a parked set's host copies to
one file on disk: each tensor's storage becomes a mapping of its bytes in the file, read
back (paged in) by `resume` and the file removed then, so the host holds nothing of it in
between but what the kernel keeps cached. Bit for bit, as a park without a spill.

Guarantees: a tensor is moved at most once per park (shared tensors, such as
tied embeddings, are found by identity); two distinct tensors that share one
storage (views) are refused, since moving them apart would silently break the
aliasing. Nothing here knows about turns, leases or trio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from openrld.engine_types import ParkReport, ResumeReport

logger = logging.getLogger(__name__)


class EngineParked(RuntimeError):
    """Compute was asked of a parked engine, or park/resume out of turn: a caller bug, not a user error."""


class CannotPark(RuntimeError):
    """The engine holds state that parking would lose (a request mid-decode); park it between requests."""


class Parked:
    """A parked engine's tensors and the device they came from; `resume` takes it back."""

    def __init__(self, device: torch.device, tensors: list[torch.Tensor], report: ParkReport) -> None:
        self.device = device
        self.tensors = tensors
        self.report = report


# ---------------------------------------------------------------------------
# Naming what lives on the device


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter, every parameter's gradient and every buffer of `module`, once each."""
    found: list[torch.Tensor] = []
    for param in module.parameters():
        found.append(param)
        if param.grad is not None:
            found.append(param.grad)
    found.extend(module.buffers())
    return found


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors of a torch optimizer (exp_avg, exp_avg_sq, step, ...)."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def unique_tensors(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The distinct tensors among `tensors` that live on `device`, in first-seen order.

    Raises:
        ValueError: two distinct tensors share one storage (views of each other).
    """
    chosen: dict[int, torch.Tensor] = {}
    storages: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if id(tensor) in chosen or not _is_on(tensor, device):
            continue
        storage = tensor.untyped_storage().data_ptr()
        other = storages.get(storage)
        if other is not None and tensor.numel() and other.numel():
            raise ValueError(
                f"cannot park: a {tuple(tensor.shape)} tensor and a {tuple(other.shape)} tensor share one storage; "
                "moving them separately would break the aliasing"
            )
        storages[storage] = tensor
        chosen[id(tensor)] = tensor
    return list(chosen.values())


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    # torch.device("cuda") has no index; it means the current device.
    return device.index is None or tensor.device.index == device.index


# ---------------------------------------------------------------------------
# Moving


def relocate(tensors: Sequence[torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Give each tensor the storage of `copy(tensor)`, in place; return the bytes copied.

    The tensor objects stay the same (their `id`, their `requires_grad`, their
    place in modules and optimizer state); only their data moves. `copy` must
    return a tensor of the same shape and dtype.
    """
    moved = 0
    with torch.no_grad():
        for tensor in tensors:
            new = copy(tensor.data)
            assert new.shape == tensor.shape and new.dtype == tensor.dtype, (
                f"copy changed a tensor: {tuple(tensor.shape)} {tensor.dtype} -> {tuple(new.shape)} {new.dtype}"
            )
            tensor.data = new
            moved += new.numel() * new.element_size()
    return moved


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    # Pinned memory lets the copy run asynchronously and at full PCIe/NVLink speed.
    host = torch.empty_like(tensor, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def park(
    device: torch.device, tensors: Iterable[torch.Tensor], *, cache_bytes_dropped: int = 0
) -> Parked:
    """Move every tensor of `tensors` that lives on `device` to pinned host memory, in place.

    The caller has already dropped its caches (and says how many bytes); on a
    CUDA device the caching allocator's free blocks are then released. On the
    CPU nothing moves.

    Returns:
        The parked state, whose `report` says what moved and how long it took.
    Raises:
        ValueError: two distinct tensors share a storage (see `unique_tensors`).
    """
    start = time.perf_counter()
    chosen = unique_tensors(tensors, device)
    held = sum(t.numel() * t.element_size() for t in chosen)
    moved = freed = reserved = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        moved = relocate(chosen, _to_pinned_host)
        torch.cuda.synchronize(device)  # the host copies are complete before anyone reads them
        torch.cuda.empty_cache()
        freed = before - torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    report = ParkReport(
        device=str(device), tensors=len(chosen), bytes_held=held, bytes_moved=moved,
        cache_bytes_dropped=cache_bytes_dropped, device_bytes_freed=freed,
        device_bytes_reserved_after=reserved, seconds=time.perf_counter() - start,
    )
    logger.info(
        "parked device=%s tensors=%d bytes_moved=%d device_bytes_freed=%d seconds=%.3f",
        report.device, report.tensors, report.bytes_moved, report.device_bytes_freed, report.seconds,
    )
    return Parked(device, chosen, report)


def resume(parked: Parked) -> ResumeReport:
    """Copy a parked set back to its device, in place; the tensors are bit-identical to before `park`."""
    start = time.perf_counter()
    moved = 0
    if parked.device.type == "cuda":
        moved = relocate(parked.tensors, lambda t: t.to(parked.device, non_blocking=True))
        torch.cuda.synchronize(parked.device)
    report = ResumeReport(
        device=str(parked.device), tensors=len(parked.tensors), bytes_moved=moved, seconds=time.perf_counter() - start
    )
    logger.info(
        "resumed device=%s tensors=%d bytes_moved=%d seconds=%.3f",
        report.device, report.tensors, report.bytes_moved, report.seconds,
    )
    return report


SPILL_ALIGN = 64  # each tensor's bytes start at a multiple of this in a spill file: aligned for any dtype


def spill(tensors: Sequence[torch.Tensor], path: Path) -> int:
    """Move the host tensors among `tensors` into one new file at `path`, in place.

    Each dense CPU tensor (contiguous, or a column-major matrix, a transposed view)
    keeps its identity, shape, strides and dtype; its storage becomes a private mapping of its
    bytes in the file (`torch.from_file`), paged in when read. Others (on a device, strided
    otherwise, empty) stay as they are. Returns the bytes moved to the file.
    """
    chosen = [(t, d) for t in tensors if t.device.type == "cpu" and t.numel() > 0 and (d := _dense(t.detach())) is not None]
    if not chosen:
        return 0
    offsets, end = [], 0
    with open(path, "wb") as file:
        for _, dense in chosen:
            pad = -end % SPILL_ALIGN
            file.write(bytes(pad))
            offsets.append(end + pad)
            data = dense.reshape(-1).view(torch.uint8).numpy()
            file.write(memoryview(data))
            end += pad + data.nbytes
    mapped = torch.from_file(str(path), shared=False, size=end, dtype=torch.uint8)
    moved = 0
    with torch.no_grad():
        for (tensor, _), offset in zip(chosen, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            flat = mapped[offset : offset + nbytes].view(tensor.dtype)
            tensor.data = flat.view(tensor.shape) if tensor.is_contiguous() else flat.view(tensor.shape[::-1]).t()
            moved += nbytes
    logger.info("spilled parked state path=%s tensors=%d bytes=%d", path, len(chosen), moved)
    return moved


def _dense(tensor: torch.Tensor) -> torch.Tensor | None:
    """`tensor` as one dense block in its storage's order: itself, or the transpose of a column-major matrix."""
    if tensor.is_contiguous():
        return tensor
    if tensor.dim() == 2 and tensor.t().is_contiguous():
        return tensor.t()
    return None


Held = TypeVar("Held")  # what a slot keeps while parked


class Slot(Generic[Held]):
    """What every parking slot shares: the engine's role and device, how it finds its device
    state, what it holds while parked, and the refusals, with messages that name the role.
    `ParkSlot` moves tensors; `automodel_park.StorageSlot` empties a sharded rank's storages."""

    def __init__(self, role: str, device: torch.device, state: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._role = role  # "trainer" or "sampler", for messages
        self._device = device
        self._state = state
        self._parked: Held | None = None

    @property
    def is_parked(self) -> bool:
        return self._parked is not None

    def park(self) -> ParkReport:
        raise NotImplementedError  # each slot moves its own kind of device state

    def resume(self) -> ResumeReport:
        raise NotImplementedError

    def require_resident(self, operation: str) -> None:
        """Raises EngineParked if parked: compute on parked state would run on the host, or on nothing."""
        if self._parked is not None:
            raise EngineParked(f"{operation} on a parked {self._role}; resume() it first")

    def spill(self, directory: Path) -> int:
        """Write what `park` copied to the host into a file in `directory`; the bytes moved (0: this
        slot keeps its parked state some other way, or nothing sits on the host)."""
        return 0

    def host_state_bytes(self) -> int:
        """Bytes of the engine's state that live in host memory because its device is the CPU (each
        tensor once); 0 on a CUDA device, whose parked copies a park's report counts instead."""
        if self._device.type != "cpu":
            return 0
        return sum(t.numel() * t.element_size() for t in unique_tensors(self._state(), self._device))

    def _refuse_second_park(self) -> None:
        if self._parked is not None:
            raise EngineParked(f"the {self._role} is already parked")

    def _held(self) -> Held:
        """What `park` put aside. Raises EngineParked if nothing is parked."""
        if self._parked is None:
            raise EngineParked(f"the {self._role} is not parked")
        return self._parked


class ParkSlot(Slot[Parked]):
    """One engine's parking: what it moves, whether it is parked, and the checks every engine shares.

    The engine names its device state once, when it makes its slot (`state`: the tensors
    it keeps on `device`, found anew at each park; `drop_caches`: frees what can be
    recomputed and says how many bytes, or raises CannotPark while that would lose
    work). The slot refuses a second park, a resume when nothing is parked, and compute
    while parked, with messages that name the engine's role. An engine's `park`,
    `resume` and `is_parked` are this slot's.
    """

    def __init__(
        self,
        role: str,
        device: torch.device,
        state: Callable[[], Iterable[torch.Tensor]],
        drop_caches: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(role, device, state)
        self._drop_caches = drop_caches
        self._spilled: Path | None = None  # the file the parked copies were spilled to, until resume

    def park(self) -> ParkReport:
        """Drop the engine's caches, then `park` its tensors and hold them until `resume`.

        Raises:
            EngineParked: already parked.  CannotPark: from `drop_caches`.
        """
        self._refuse_second_park()
        dropped = self._drop_caches() if self._drop_caches is not None else 0
        self._parked = park(self._device, self._state(), cache_bytes_dropped=dropped)
        return self._parked.report

    def resume(self) -> ResumeReport:
        """Copy the parked tensors back, bit for bit. Raises EngineParked if not parked."""
        report = resume(self._held())
        self._parked = None
        if self._spilled is not None:  # the tensors are on the device again: nothing maps the file
            self._spilled.unlink(missing_ok=True)
            self._spilled = None
        return report

    def spill(self, directory: Path) -> int:
        """`offload.spill` of the parked host copies, to a file of this slot's own in `directory`.
        Raises EngineParked if not parked."""
        parked = self._held()
        if self._device.type == "cpu" or self._spilled is not None:  # on the CPU nothing was copied
            return 0
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self._role}-{id(self):x}.parked"
        moved = spill(parked.tensors, path)
        self._spilled = path
        return moved


class ParksInSlot:
    """`park`, `resume` and `is_parked` of an engine whose `_slot` (a ParkSlot or StorageSlot) knows
    its device state.

    A mixin with no state of its own, so that the delegation is written once: the engine
    names what to move when it makes its slot, and these are its time-slicer calls.
    """

    _slot: Slot[Any]

    def park(self) -> ParkReport:
        """Move the engine's device state to host memory (`ParkSlot.park` drops caches first;
        `StorageSlot.park` empties a sharded rank's storages); compute refuses until `resume`.

        Raises:
            EngineParked: already parked.  CannotPark: a cache cannot be dropped yet (a request decodes).
        """
        return self._slot.park()

    def resume(self) -> ResumeReport:
        """Copy the parked state back to the device, bit for bit. Raises EngineParked if not parked."""
        return self._slot.resume()

    @property
    def is_parked(self) -> bool:
        return self._slot.is_parked

    def host_state_bytes(self) -> int:
        """Bytes of the engine's state held in host memory on a CPU device (`Slot.host_state_bytes`)."""
        return self._slot.host_state_bytes()

    def spill_parked(self, directory: str) -> int:
        """Move the parked state's host copies to a file in `directory` until `resume` (`ParkSlot.spill`);
        the bytes moved. The actors call it when a park went past the node's host-memory budget."""
        return self._slot.spill(Path(directory))
