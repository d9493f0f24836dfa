"""A trainer's state copied to host memory in one go, for an auto-save written off the engine thread.

`save_state` serialises, writes and fsyncs a job's state on the engine thread, and the next
op waits for all of it. An auto-save after every optim_step must cost that next op almost
nothing, so the engine thread only copies (`snapshot_state`): each safetensors file of the
state becomes its header, computed from the tensors' names, dtypes and shapes
(`safetensors_stream`), and one host buffer of the tensors' bytes in the file's order; each
JSON file, its bytes. A later op that changes the state changes the live tensors, never the
copy. The files are the ones `save_state` writes, byte for byte, so `load_state` (and a node
that adopts the job) reads them alike.

The header, the file order and a flat byte view of each live tensor depend only on which
tensors there are, not on their values, so a job's `Layouts` keeps them from one snapshot to
the next and a snapshot is then one memcpy per file. Each snapshot first checks that the
tensors are still the same storage, of the same dtype and shape (their `data_ptr`s: an
optimizer's reset or loaded state, or a park that moved them, gives new ones, and the layout
is made anew); a 0-d tensor (an optimizer's step count, a new tensor each time) is read anew
each time. The snapshot's own buffer is always a new one: the copy a writer still holds is
never written over.

Measured on SmolLM2-135M's rank-8 LoRA state (11 MB of adapter, 23 MB of AdamW state, 1,688
tensors), on 2 shared CPU cores: `save_state` took about 190 ms (27 ms of it peft's state dict,
35 ms of clones, 87 ms of safetensors serialising, 27 ms of writes and 25 ms of fsyncs). Under
a load of 7-13 on them: a snapshot that made its layout each time, about 26 ms of CPU; one from
a kept layout, 16-17 ms, about 10 of it the copy into a new buffer (into a reused one, about 4:
not worth a buffer the writer might still hold).

What it does not do: write files (`openrld/autosave.py` `write_snapshot`, in a thread of the
daemon's), or copy a full fine-tuning job's state (the whole model and twice it again: those
engines write synchronously, streamed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TypeAlias, cast

import msgspec
import numpy as np
import torch

from openrld.engine_types import SnapshotFile
from openrld.gpu import safetensors_stream


class Layouts:
    """A job's safetensors files as laid out over its live tensors, by file name, kept from one
    snapshot to the next (the module's docstring says when one is made anew). It holds views of
    the tensors: `clear` it before they move off a device (a park), so that it keeps no device
    memory alive; drop it with the job."""

    def __init__(self) -> None:
        self._files: dict[str, _Layout] = {}

    def tensors_file(self, name: str, tensors: Mapping[str, torch.Tensor]) -> SnapshotFile:
        """The safetensors file `name` of `tensors` as they are now: its header, and a new host
        copy of their bytes in file order (the bytes `checkpoint.encode_tensors` would give)."""
        identity = _identity(tensors)
        layout = self._files.get(name)
        if layout is None or layout.identity != identity:
            layout = self._files[name] = _Layout(identity, tensors)
        body = _host_bytes(layout.parts(tensors), layout.size)
        return SnapshotFile(name, layout.head, body if body.size else None)

    def clear(self) -> None:
        self._files.clear()


def json_file(name: str, meta: msgspec.Struct) -> SnapshotFile:
    """The JSON file `name` of `meta`, as the trainers write it (`checkpoint.save_weights`, `write_beside`)."""
    return SnapshotFile(name, msgspec.json.encode(meta))


# A tensor's bytes as kept in a layout: a numpy view of a host tensor, a flat uint8 view of a device's.
_Part: TypeAlias = np.ndarray | torch.Tensor


def _kept(tensor: torch.Tensor) -> bool:
    """Whether a view of `tensor` stays its bytes: contiguous (a reshape of another copies), and
    not 0-d (an optimizer's step count is a new tensor at each snapshot)."""
    return tensor.dim() > 0 and tensor.is_contiguous()


def _identity(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[object, ...], ...]:
    """What a layout holds for: each tensor's name, dtype, shape and device, and the address of
    the bytes a kept view reads (a moved or replaced tensor has new ones; the old storage cannot
    be reused meanwhile, since the layout's view holds it)."""
    return tuple((key, t.dtype, t.shape, t.device, t.data_ptr() if _kept(t) else None) for key, t in tensors.items())


class _Layout:
    """One file's header, size and parts in file order: a kept view, or None for a tensor read anew."""

    def __init__(self, identity: tuple[tuple[object, ...], ...], tensors: Mapping[str, torch.Tensor]) -> None:
        ordered = safetensors_stream.file_order(safetensors_stream.entries_of(tensors))
        self.identity = identity
        self.head = safetensors_stream.encode_header(ordered)
        self.size = sum(tensors[entry.name].nbytes for entry in ordered)
        self._parts: list[_Part | None] = [
            _bytes_of(tensors[entry.name]) if _kept(tensors[entry.name]) else None for entry in ordered
        ]
        self._fresh = [(index, entry.name) for index, entry in enumerate(ordered) if self._parts[index] is None]

    def parts(self, tensors: Mapping[str, torch.Tensor]) -> list[_Part]:
        """The file's parts now: the kept views, and the tensors read anew."""
        parts = list(self._parts)
        for index, key in self._fresh:
            parts[index] = _bytes_of(tensors[key])
        return cast(list[_Part], parts)  # every None was filled just now


def _bytes_of(tensor: torch.Tensor) -> _Part:
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _device_of(part: _Part) -> torch.device | None:
    return None if isinstance(part, np.ndarray) else part.device  # None: host memory


def _host_bytes(parts: Iterable[_Part], size: int) -> np.ndarray:
    """The parts' bytes end to end in one new host buffer of `size` bytes: one copy per run of
    parts on one device (a device-to-host copy of a device's run, which waits for the ops
    queued before it)."""
    out = np.empty(size, dtype=np.uint8)
    start = 0
    for device, same_device in itertools.groupby(parts, key=_device_of):
        run = list(same_device)
        window = out[start : start + sum(part.nbytes for part in run)]
        if device is None:
            np.concatenate(run, out=window)  # one memcpy each, one thread
        else:
            torch.from_numpy(window).copy_(torch.cat(run))  # one kernel, then one copy to the host
        start += window.size
    assert start == size, f"a snapshot's parts hold {start} bytes; its header says {size}"
    return out
