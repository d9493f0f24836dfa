"""safetensors files written one tensor at a time: checkpoints of weights no rank holds whole.

The Automodel trainer's full fine-tuning keeps every weight (and its AdamW state) as
shards over the group's ranks. Its checkpoints must be the single-device trainers'
files, byte for byte (`full_io`, the `optimizer.safetensors` of `torch_trainer`), but
gathering every tensor into one dict first would put the whole model, and twice it
again for AdamW, in rank 0's memory. So the files are written streaming:
- the header is computed from names, dtypes and shapes alone (`encode_header`), which
  every rank knows from the DTensors' global shapes, and written first;
- then each tensor is gathered whole (every rank takes part, in the file's order),
  written, and dropped before the next one is gathered.

Why by hand: the safetensors library serialises a complete dict of tensors only (its
`save`/`save_file` take the dict and lay out the file from it); nothing in it writes a
header ahead of the data. What it lays out is matched here exactly, as safetensors 0.8
writes it (`test_safetensors_stream.py` checks the bytes against the library for every
dtype): tensors sorted by dtype, widest first in the library's own order of its dtypes,
then by name; a compact JSON header of {"dtype", "shape", "data_offsets"} per tensor in
that order, padded with spaces to a multiple of 8 bytes after its 8-byte little-endian
length; then the tensors' bytes end to end, little-endian. No `__metadata__`: the
existing writers (`checkpoint.encode_tensors`) put none, and the library writes several
metadata keys in hash order, so no other writer could match its bytes for them.

Guarantees: a file is written under a temporary name in its directory, fsynced, and
renamed into place, then the directory is fsynced: a write that fails (or a process that
dies) midway leaves nothing at the final path. A failure on the writing rank (a full
disk, a path that exists) is raised only after every tensor has been taken from the
source, since the other ranks wait in those gathers; `StreamedWrites` carries that over
several files, so no rank is left alone in a collective. On the writing rank, each
tensor taken is dropped before the next is taken; `StreamStatistics.peak_held` counts
what was really alive at once (1 when nothing keeps a tensor past its write).

What it does not do: gather anything itself (the caller's source does, as a collective),
read files (safetensors does that), write LoRA adapters (their dicts are small: `lora_io`
writes them), or import torch.distributed or trio.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec
import torch

from openrld.gpu import checkpoint

__all__ = [
    "StreamStatistics", "StreamedWrites", "TensorEntry", "TensorSource", "encode_header", "entries_of", "file_order",
    "taken_from",
]

# safetensors' dtype codes, in the order the library lays tensors out: its Dtype enum
# descending (the widest first). A torch without a dtype (older float8 kinds) skips it.
# Left out: float4_e2m1fn_x2 ("F4"), whose shape the library rewrites (two values a byte).
_DTYPE_CODES = (
    ("uint64", "U64"), ("int64", "I64"), ("float64", "F64"), ("complex64", "C64"), ("float32", "F32"),
    ("uint32", "U32"), ("int32", "I32"), ("bfloat16", "BF16"), ("float16", "F16"), ("uint16", "U16"),
    ("int16", "I16"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("int8", "I8"),
    ("uint8", "U8"), ("bool", "BOOL"),
)
_CODES: dict[torch.dtype, tuple[int, str]] = {
    getattr(torch, name): (rank, code) for rank, (name, code) in enumerate(_DTYPE_CODES) if hasattr(torch, name)
}
_HEADER_ALIGNMENT = 8  # the library pads its JSON header with spaces to this


class TensorEntry(NamedTuple):
    """One tensor of a file, as every rank knows it before any gather."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # the whole tensor's (a DTensor's global shape)


# Given the names in file order, yields (name, the whole tensor) for each, in that order,
# one at a time; on a rank that does not write, the tensor may be None (the gather's
# result lands on the writer only). Every rank's source runs the same collectives.
TensorSource = Callable[[list[str]], Iterable[tuple[str, "torch.Tensor | None"]]]


class StreamStatistics(msgspec.Struct, frozen=True):
    """One streamed file, as the rank that called `write` saw it."""

    file: str  # the file's name in its directory
    tensors: int  # tensors taken from the source
    bytes: int  # the file's size; 0 on a rank that does not write
    peak_held: int  # the most tensors from the source alive at once on this rank (1: one at a time)
    seconds: float  # gathers and writes, end to end


def entries_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """The entries of named tensors (or DTensors: their global shapes), in the mapping's order."""
    return [TensorEntry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def taken_from(tensors: Mapping[str, torch.Tensor]) -> TensorSource:
    """A source over tensors already at hand (one process): each by name, as it is."""
    return lambda names: ((name, tensors[name]) for name in names)


def file_order(entries: Iterable[TensorEntry]) -> list[TensorEntry]:
    """The entries in the order safetensors lays them out: by dtype, widest first, then by name.

    Raises:
        ValueError: a name appears twice, or a dtype safetensors has no code for.
    """
    entries = list(entries)
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"a safetensors file names each tensor once; got {twice[:3]} twice")
    return sorted(entries, key=lambda entry: (_code(entry.dtype)[0], entry.name))


def encode_header(ordered: Sequence[TensorEntry]) -> bytes:
    """The file's first bytes, for entries already in `file_order`: the header's length
    (8 bytes, little-endian), then its JSON padded with spaces to a multiple of 8."""
    fields, offset = {}, 0
    for entry in ordered:
        size = _nbytes(entry)
        fields[entry.name] = {
            "dtype": _code(entry.dtype)[1], "shape": list(entry.shape), "data_offsets": [offset, offset + size],
        }
        offset += size
    # The library's serde_json compact form, which these options give: no spaces, non-ASCII
    # as UTF-8, and the same escapes (\n, \u001f, \", \\).
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


class StreamedWrites:
    """The files of one save, written streaming by one rank while every rank gathers.

    Each rank makes one, calls `write` for the same files in the same order, then
    `finish`. The first failure on the writing rank (a `precondition` refused, a path
    that exists, a write error, a tensor of another dtype or shape than its entry) is
    kept: that file is discarded, later files only take their tensors (the other ranks
    are in those gathers), and `finish` raises it. A source that raises (a failed
    collective) propagates at once, after the file in progress is discarded.

    Args:
        is_writer: this rank writes the files (rank 0); the others only take part in the gathers.
    """

    def __init__(self, *, is_writer: bool = True) -> None:
        if is_writer and sys.byteorder != "little":
            raise NotImplementedError("safetensors files are little-endian; this writer runs on little-endian hosts")
        self.is_writer = is_writer
        self._failure: Exception | None = None
        self._statistics: list[StreamStatistics] = []

    def precondition(self, check: Callable[[], None]) -> None:
        """On the writer, run `check`; an exception it raises is kept, to be raised by `finish`
        once the gathers are done (raising now would leave the other ranks in them)."""
        if self.is_writer and self._failure is None:
            try:
                check()
            except Exception as error:  # kept, raised by finish after the collectives
                self._failure = error

    def write(self, path: Path, entries: Iterable[TensorEntry], source: TensorSource) -> None:
        """Stream the tensors of `entries` from `source` into a new safetensors file at `path`."""
        started = time.perf_counter()
        ordered = file_order(entries)
        tensors = iter(source([entry.name for entry in ordered]))
        live = _LiveCount()
        if not self.is_writer or self._failure is not None:
            for _ in ordered:
                _take(tensors, live)
            size = 0
        else:
            size = self._write_file(path, ordered, tensors, live)
        seconds = time.perf_counter() - started
        self._statistics.append(StreamStatistics(path.name, len(ordered), size, live.peak, seconds))

    def finish(self) -> list[StreamStatistics]:
        """Every file's statistics, in the order written.

        Raises:
            The first failure on the writer (FileExistsError, OSError, ValueError, or what a
            precondition raised), now that every rank is done gathering.
        """
        if self._failure is not None:
            raise self._failure
        return list(self._statistics)

    def _write_file(self, path: Path, ordered: list[TensorEntry], tensors: Iterator, live: _LiveCount) -> int:
        """Header, then each tensor as it comes; the file's size, or 0 with the failure kept."""
        sink = _PartialFile(path)
        try:
            sink.write(encode_header(ordered))
            for entry in ordered:
                _write_one(sink, entry, tensors, live)
        except BaseException:  # the source failed (a collective): nothing stays behind, and it propagates
            sink.discard()
            raise
        size = sink.commit()
        self._failure = sink.failure
        return size


class _PartialFile:
    """A file written under a temporary name in its directory, renamed into place by `commit`.

    A failure is kept, not raised: the writes after it do nothing, and `commit` discards
    the file, so the caller can go on taking tensors for the other ranks' gathers.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failure: Exception | None = None
        self._partial: Path | None = None
        self._file: BinaryIO | None = None
        self._attempt(self._open)

    def write(self, data: bytes | memoryview) -> None:
        self._attempt(lambda: self._file.write(data))  # type: ignore[union-attr]

    def fail(self, error: Exception) -> None:
        if self.failure is None:
            self.failure = error

    def commit(self) -> int:
        """Make the file durable under its name; its size (0, and no file, after a failure)."""
        self._attempt(self._finish)
        if self.failure is not None:
            self.discard()
            return 0
        return self.path.stat().st_size

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None

    def _open(self) -> None:
        if self.path.exists():
            raise FileExistsError(f"{self.path} exists; saves go into a fresh directory")
        descriptor, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".partial")
        self._partial = Path(name)
        self._file = os.fdopen(descriptor, "wb")

    def _finish(self) -> None:
        assert self._file is not None and self._partial is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.rename(self._partial, self.path)
        self._partial = None
        checkpoint.fsync_directory(self.path.parent)  # the new name itself is durable, not only the bytes

    def _attempt(self, action: Callable[[], object]) -> None:
        if self.failure is not None:
            return
        try:
            action()
        except OSError as error:
            self.failure = error


def _write_one(sink: _PartialFile, entry: TensorEntry, tensors: Iterator, live: _LiveCount) -> None:
    """Take the next tensor, check it against its entry, write its bytes. The tensor is
    referenced from this frame only, so it is gone before the next one is gathered."""
    name, tensor = _take(tensors, live)
    if name != entry.name or tensor is None:
        sink.fail(ValueError(f"the source gave {name!r} where the file has {entry.name!r} next"))
    elif tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        sink.fail(ValueError(
            f"{entry.name}: got {tensor.dtype} {list(tensor.shape)}; the header says {entry.dtype} {list(entry.shape)}"
        ))
    elif sink.failure is None:
        sink.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _take(tensors: Iterator, live: _LiveCount) -> tuple[str, torch.Tensor | None]:
    alive = live.alive
    taken = next(tensors, None)
    if taken is None:
        raise ValueError("the source ended before the file's last tensor")
    live.track(taken[1], alive)
    return taken


class _LiveCount:
    """How many taken tensors are alive now, and the most at once: each is counted until
    it is garbage (a weak reference's finaliser), so a tensor kept by mistake shows."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor | None, alive_while_taking: int) -> None:
        """Count `tensor`, taken while `alive_while_taking` earlier ones were still alive (held
        through its gather, though a source may drop one before it yields the next)."""
        held = alive_while_taking + (tensor is not None)
        self.peak = max(self.peak, held)
        if tensor is None:
            return
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(tensor, self._release)

    def _release(self) -> None:
        self.alive -= 1


def _code(dtype: torch.dtype) -> tuple[int, str]:
    found = _CODES.get(dtype)
    if found is None:
        raise ValueError(f"safetensors has no dtype code for {dtype}")
    return found


def _nbytes(entry: TensorEntry) -> int:
    numel = 1
    for size in entry.shape:
        numel *= size
    return numel * entry.dtype.itemsize
