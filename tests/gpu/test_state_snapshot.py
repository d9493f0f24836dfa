"""A job's snapshot layouts (openrld/gpu/state_snapshot.py): kept from one snapshot to the next, each
snapshot a new copy of the tensors' bytes as they are then, the layout made anew when the tensors change.

Plain CPU tensors stand for a job's adapter and optimizer state; the bytes are checked against
the safetensors library's own (`checkpoint.encode_tensors`), as `save_state` writes them.
"""

from __future__ import annotations

import numpy as np
import torch

from openrld.engine_types import SnapshotFile
from openrld.gpu.checkpoint import encode_tensors
from openrld.gpu.state_snapshot import Layouts


def state() -> dict[str, torch.Tensor]:
    return {
        "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a.weight": torch.full((4,), 0.5, dtype=torch.bfloat16),
        "a.step": torch.tensor(3, dtype=torch.int64),  # 0-d: an optimizer's step count, new at each snapshot
    }


def file_bytes(file: SnapshotFile) -> bytes:
    return file.head + (file.body.tobytes() if file.body is not None else b"")


def test_a_kept_layout_copies_the_values_the_tensors_hold_now():
    layouts, tensors = Layouts(), state()
    layouts.tensors_file("optimizer.safetensors", tensors)
    tensors["b.weight"].add_(1.0)  # a step changes the live tensors in place
    tensors["a.step"] = torch.tensor(4, dtype=torch.int64)
    assert file_bytes(layouts.tensors_file("optimizer.safetensors", tensors)) == encode_tensors(tensors)


def test_an_earlier_snapshot_is_not_written_over_by_a_later_one():
    layouts, tensors = Layouts(), state()
    first = layouts.tensors_file("optimizer.safetensors", tensors)
    expected = encode_tensors(tensors)  # a writer may still be writing `first` when the next step's is taken
    tensors["b.weight"].mul_(-1.0)
    second = layouts.tensors_file("optimizer.safetensors", tensors)
    assert first.body is not None and second.body is not None
    assert not np.shares_memory(first.body, second.body)
    assert file_bytes(first) == expected


def test_a_tensor_replaced_by_another_is_read_from_the_new_one():
    layouts, tensors = Layouts(), state()
    layouts.tensors_file("optimizer.safetensors", tensors)
    tensors["b.weight"] = torch.full((2, 3), 7.0)  # an optimizer that loaded its state
    assert file_bytes(layouts.tensors_file("optimizer.safetensors", tensors)) == encode_tensors(tensors)


def test_a_tensor_moved_in_place_is_read_from_its_new_storage():
    layouts, tensors = Layouts(), state()
    layouts.tensors_file("optimizer.safetensors", tensors)
    tensors["a.weight"].data = torch.full((4,), -2.0, dtype=torch.bfloat16)  # how a park moves it
    assert file_bytes(layouts.tensors_file("optimizer.safetensors", tensors)) == encode_tensors(tensors)


def test_a_non_contiguous_tensor_is_read_anew_each_time():
    layouts = Layouts()
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tensors = {"t.weight": base.t()}  # its flat bytes are a copy, never a view of the live tensor
    layouts.tensors_file("adapter.safetensors", tensors)
    base.add_(10.0)
    assert file_bytes(layouts.tensors_file("adapter.safetensors", tensors)) == encode_tensors(tensors)


def test_each_file_keeps_a_layout_of_its_own():
    layouts, tensors = Layouts(), state()
    adapter = {"lora_A.weight": torch.ones(3)}
    layouts.tensors_file("optimizer.safetensors", tensors)
    layouts.tensors_file("adapter.safetensors", adapter)
    assert file_bytes(layouts.tensors_file("optimizer.safetensors", tensors)) == encode_tensors(tensors)
    assert file_bytes(layouts.tensors_file("adapter.safetensors", adapter)) == encode_tensors(adapter)
