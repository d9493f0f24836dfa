"""gpu/safetensors_stream.py: files written one tensor at a time are the safetensors library's bytes.

One process, the writer's side only (the Automodel group tests drive it over 2 ranks):
- the bytes equal `safetensors.torch.save_file`'s (and `checkpoint.encode_tensors`') for tensors
  of every dtype the library writes, of several shapes, 0-d and empty ones included; the
  file loads with `load_file`; its header has no `__metadata__`, as the existing writers';
- a write that fails midway leaves no file at the final path and nothing else behind,
  takes the rest of the source all the same (the other ranks' gathers), and raises at `finish`;
- each tensor is dropped before the next is taken: `peak_held` is 1, and 2 for a source
  that keeps the previous tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from openrld.gpu import checkpoint
from openrld.gpu.safetensors_stream import (
    StreamedWrites,
    TensorEntry,
    encode_header,
    entries_of,
    file_order,
    taken_from,
)

# Every dtype safetensors.torch writes in this torch, in no particular order, but for the packed
# float4 (two values a byte: the library rewrites its shape; the stream writer refuses it).
DTYPES = [dtype for dtype in safetensors.torch._SIZE if dtype is not None and "float4" not in str(dtype)]


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Names out of order, dtypes mixed, shapes 2-d, 1-d, 0-d and empty."""
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.mlp.weight": torch.randn(5, 3, generator=generator),
        "lm_head.weight": torch.randn(4, 2, generator=generator).to(torch.bfloat16),
        "embed.weight": torch.randn(7, generator=generator).to(torch.float16),
        "a.step": torch.tensor(3, dtype=torch.int64),
        "z.scale": torch.tensor(1.5, dtype=torch.float64),
        "empty.rows": torch.zeros(0, 4),
        "empty.bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.tensor([[1, -2], [3, 4]], dtype=torch.int32),
        "ünïcode \"name\"\n": torch.arange(3, dtype=torch.uint8),
    }


def every_dtype() -> dict[str, torch.Tensor]:
    """One small tensor of each dtype, its bytes not all zero."""
    found = {}
    for index, dtype in enumerate(DTYPES):
        raw = torch.arange(1, 1 + 2 * dtype.itemsize, dtype=torch.uint8)
        found[f"t{index:02d}"] = raw.view(dtype).reshape(2, -1) if dtype != torch.bool else raw.remainder(2).bool()
    return found


def stream(path: Path, tensors: dict[str, torch.Tensor]):
    writes = StreamedWrites()
    writes.write(path, entries_of(tensors), taken_from(tensors))
    return writes.finish()


def header_of(data: bytes) -> dict:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


@pytest.mark.parametrize("tensors", [mixed_tensors(), every_dtype(), {}], ids=["mixed", "every-dtype", "none"])
def test_a_streamed_file_is_the_librarys_bytes(tmp_path, tensors):
    safetensors.torch.save_file(tensors, tmp_path / "library.safetensors")
    [written] = stream(tmp_path / "streamed.safetensors", tensors)
    ours = (tmp_path / "streamed.safetensors").read_bytes()
    assert ours == (tmp_path / "library.safetensors").read_bytes()
    assert ours == checkpoint.encode_tensors(tensors)  # what full_io and the optimizer files are written with
    assert (written.file, written.tensors, written.bytes) == ("streamed.safetensors", len(tensors), len(ours))
    loaded = safetensors.torch.load_file(tmp_path / "streamed.safetensors")
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape
        assert torch.equal(loaded[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["library.safetensors", "streamed.safetensors"]


def test_the_header_has_no_metadata_and_is_padded_to_8_bytes_with_spaces():
    tensors = mixed_tensors()
    header = encode_header(file_order(entries_of(tensors)))
    (length,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + length and length % 8 == 0
    assert "__metadata__" not in header_of(header)
    assert header[8:] == checkpoint.encode_tensors(tensors)[8 : 8 + length]
    json_text = header[8:].rstrip(b" ")
    assert json_text.endswith(b"}") and len(header[8:]) - len(json_text) < 8  # spaces pad it, no more than 7


def test_the_file_order_is_widest_dtype_first_then_by_name():
    tensors = mixed_tensors()
    order = [entry.name for entry in file_order(entries_of(tensors))]
    # int64 and float64 (8 bytes), float32, int32, bf16, fp16, uint8, bool; names sorted within a dtype.
    assert order == [
        "a.step", "z.scale", "empty.rows", "model.layers.1.mlp.weight", "ids", "empty.bf16", "lm_head.weight",
        "embed.weight", "ünïcode \"name\"\n", "mask",
    ]
    assert list(header_of(checkpoint.encode_tensors(tensors))) == order


def recording(tensors: dict[str, torch.Tensor], taken: list[str]):
    """A source over `tensors` that notes each name it gives."""

    def source(names):
        for name in names:
            taken.append(name)
            yield name, tensors[name]

    return source


def test_a_write_failing_midway_leaves_no_file_and_still_takes_every_tensor(tmp_path):
    tensors = mixed_tensors()
    entries = entries_of(tensors)
    wrong = {**tensors, "ids": torch.zeros(2, 2, dtype=torch.int64)}  # not what the header says
    taken: list[str] = []
    writes = StreamedWrites()
    writes.write(tmp_path / "model.safetensors", entries, recording(wrong, taken))
    # After a failure, a later file's tensors are taken (the other ranks gather them) and not written.
    writes.write(tmp_path / "optimizer.safetensors", entries, taken_from(tensors))
    with pytest.raises(ValueError, match=r"^ids: got torch.int64 \[2, 2\]; the header says torch.int32 \[2, 2\]$"):
        writes.finish()
    assert taken == [entry.name for entry in file_order(entries)]  # the tensors after the bad one too
    assert list(tmp_path.iterdir()) == []  # no file at the final path, no temporary one


def test_a_path_that_exists_is_refused_after_the_gathers_and_left_as_it_was(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"earlier")
    taken: list[str] = []
    writes = StreamedWrites()
    writes.write(tmp_path / "model.safetensors", entries_of(mixed_tensors()), recording(mixed_tensors(), taken))
    with pytest.raises(FileExistsError, match=r"model\.safetensors exists"):
        writes.finish()
    assert len(taken) == len(mixed_tensors())
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"earlier"


def test_a_failed_precondition_writes_nothing_and_is_raised_by_finish(tmp_path):
    def refuse() -> None:
        raise FileExistsError("not empty")

    writes = StreamedWrites()
    writes.precondition(refuse)
    writes.write(tmp_path / "model.safetensors", entries_of(mixed_tensors()), taken_from(mixed_tensors()))
    with pytest.raises(FileExistsError, match="not empty"):
        writes.finish()
    assert list(tmp_path.iterdir()) == []


def test_a_source_that_raises_propagates_at_once_and_leaves_nothing(tmp_path):
    tensors = mixed_tensors()

    def source(names):
        yield names[0], tensors[names[0]]
        raise RuntimeError("the gather failed")

    with pytest.raises(RuntimeError, match="the gather failed"):
        StreamedWrites().write(tmp_path / "model.safetensors", entries_of(tensors), source)
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_does_not_write_takes_every_tensor_and_writes_nothing(tmp_path):
    tensors = mixed_tensors()
    writes = StreamedWrites(is_writer=False)
    writes.write(tmp_path / "model.safetensors", entries_of(tensors), lambda names: [(name, None) for name in names])
    [written] = writes.finish()
    assert (written.tensors, written.bytes, written.peak_held) == (len(tensors), 0, 0)
    assert list(tmp_path.iterdir()) == []


def test_each_tensor_is_dropped_before_the_next_is_taken(tmp_path):
    sizes = {f"w{i}": torch.full((8, 8), float(i)) for i in range(5)}

    def fresh(names):  # as a gather does: a new whole tensor each time, kept by nobody
        return ((name, sizes[name].clone()) for name in names)

    def keeping(names):  # a source that holds the previous tensor while it gathers the next
        for name in names:
            value = sizes[name].clone()
            yield name, value

    writes = StreamedWrites()
    writes.write(tmp_path / "fresh.safetensors", entries_of(sizes), fresh)
    writes.write(tmp_path / "keeping.safetensors", entries_of(sizes), keeping)
    first, second = writes.finish()
    assert (first.peak_held, second.peak_held) == (1, 2)
    assert (tmp_path / "fresh.safetensors").read_bytes() == checkpoint.encode_tensors(sizes)


def test_a_name_twice_or_a_dtype_without_a_code_is_refused():
    with pytest.raises(ValueError, match=r"each tensor once; got \['a'\] twice"):
        file_order([TensorEntry("a", torch.float32, ()), TensorEntry("a", torch.int64, ())])
    for dtype in (torch.complex128, torch.float4_e2m1fn_x2):
        with pytest.raises(ValueError, match=f"no dtype code for {dtype}"):
            file_order([TensorEntry("a", dtype, (1,))])
