"""gpu/delta.py: compute a delta, apply it in place, and the digest that checks the result.

Every comparison here is exact (torch.equal on bits): a weight sync is bit-exact or wrong.
"""

from __future__ import annotations

import pytest
import torch

from openrld.gpu import delta

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 16, generator=generator).to(dtype),
        "layer.weight": torch.randn(16, 16, generator=generator).to(dtype),
        "norm": torch.ones(16, dtype=dtype),
    }


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(delta.bits(a[k]), delta.bits(b[k])) for k in a)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_applying_the_delta_makes_the_old_weights_bit_identical_to_the_new(dtype: torch.dtype) -> None:
    old = weights(dtype)
    new = delta.clone_weights(old)
    new["embed"][3, 5] += 1.0
    new["layer.weight"][0] *= 2.0  # one row of 16
    change = delta.compute_delta(new, old, base_version="v1")
    target = delta.clone_weights(old)
    delta.apply_delta(target, change)
    assert bitwise_equal(target, new)
    assert delta.digest(target) == change.digest == delta.digest(new)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_delta_sends_only_changed_elements_in_the_native_dtype(dtype: torch.dtype) -> None:
    old = weights(dtype)
    new = delta.clone_weights(old)
    new["embed"][0, :4] += 1.0
    change = delta.compute_delta(new, old, base_version=None)
    assert [(t.name, t.indices.tolist(), t.values.dtype) for t in change.tensors] == [("embed", [0, 1, 2, 3], dtype)]
    assert change.changed_elements == 4
    assert change.total_elements == 64 * 16 + 16 * 16 + 16
    # 4 int32 indices + 4 values of the dtype's width.
    assert change.bytes_moved == 4 * 4 + 4 * torch.empty((), dtype=dtype).element_size()


def test_a_mostly_changed_tensor_goes_dense() -> None:
    old = weights(torch.float32)
    new = delta.clone_weights(old)
    new["layer.weight"] += 1.0  # all 256 elements: 256 x (4 + 4) bytes sparse > 1024 dense
    change = delta.compute_delta(new, old, base_version=None)
    (part,) = change.tensors
    assert (part.name, part.indices, part.values.numel()) == ("layer.weight", None, 256)
    assert change.bytes_moved == 256 * 4


def test_an_unchanged_model_sends_nothing() -> None:
    old = weights(torch.bfloat16)
    change = delta.compute_delta(delta.clone_weights(old), old, base_version="v")
    assert (change.tensors, change.bytes_moved, change.changed_elements) == ([], 0, 0)


def test_signed_zero_counts_as_a_change() -> None:
    old = {"w": torch.zeros(8)}
    new = {"w": torch.zeros(8)}
    new["w"][2] = -0.0
    change = delta.compute_delta(new, old, base_version=None)
    assert change.tensors[0].indices.tolist() == [2]
    delta.apply_delta(old, change)
    assert torch.equal(delta.bits(old["w"]), delta.bits(new["w"]))


def test_full_update_sends_every_tensor_dense_and_applies_exactly() -> None:
    old, new = weights(torch.bfloat16, seed=0), weights(torch.bfloat16, seed=1)
    change = delta.full_update(new, base_version="v0")
    assert change.mode == "full"
    assert change.bytes_moved == change.full_bytes == (64 * 16 + 16 * 16 + 16) * 2
    delta.apply_delta(old, change)
    assert bitwise_equal(old, new)


def test_digest_changes_when_one_bit_changes() -> None:
    base = weights(torch.float32)
    flipped = delta.clone_weights(base)
    flipped["norm"].view(torch.int32)[7] ^= 1  # the lowest mantissa bit of one element
    assert delta.digest(flipped) != delta.digest(base)


def test_digest_changes_when_two_values_swap_places() -> None:
    base = {"w": torch.arange(8, dtype=torch.float32)}
    swapped = {"w": base["w"][[1, 0, 2, 3, 4, 5, 6, 7]].clone()}
    assert delta.digest(swapped) != delta.digest(base)


def test_digest_covers_tensors_longer_than_one_block() -> None:
    base = {"w": torch.zeros(3 * (1 << 20) + 5)}
    changed = {"w": base["w"].clone()}
    changed["w"][-1] = 1.0
    assert delta.digest(changed) != delta.digest(base)


def test_digest_covers_the_elements_after_the_last_whole_word() -> None:
    base = {"w": torch.zeros(11, dtype=torch.bfloat16)}  # two 8-byte words and three elements
    changed = {"w": base["w"].clone()}
    changed["w"][-1] = 1.0
    assert delta.digest(changed) != delta.digest(base)


def test_digest_of_a_view_not_aligned_to_a_word_equals_the_digest_of_its_copy() -> None:
    storage = torch.arange(20, dtype=torch.bfloat16)
    view = storage[1:17]  # starts 2 bytes into the storage: its words cannot be a view
    assert view.storage_offset() == 1
    assert delta.digest({"w": view}) == delta.digest({"w": view.clone()})


def test_weights_of_another_shape_are_refused() -> None:
    old = weights(torch.float32)
    new = delta.clone_weights(old)
    new["norm"] = torch.ones(17)
    with pytest.raises(ValueError, match=r"norm: \[17\] torch.float32 vs \[16\] torch.float32"):
        delta.compute_delta(new, old, base_version=None)


def test_a_delta_of_another_dtype_is_refused() -> None:
    change = delta.compute_delta(weights(torch.bfloat16, 1), weights(torch.bfloat16, 0), base_version=None)
    with pytest.raises(ValueError, match=r"is torch\.bfloat16; the weight is torch\.float32"):
        delta.apply_delta(weights(torch.float32), change)


# ---------------------------------------------------------------------------
# Devices. FakeTensorMode gives tensors that say they are on cuda:0 without a GPU, and
# raises as CUDA would when an op mixes cuda and cpu tensors.


def test_the_shadow_copy_stays_on_each_tensors_device() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        live = {"w": torch.empty(4, 4, device="cuda:0", dtype=torch.bfloat16)}
        shadow = delta.clone_weights(live)
    assert shadow["w"].device == torch.device("cuda:0")


def test_a_delta_between_weights_on_two_devices_is_refused_by_name() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        live = {"w": torch.empty(4, 4, device="cuda:0", dtype=torch.bfloat16)}
        with pytest.raises(ValueError, match=r"^w: the weights are on cuda:0 and the copy they are compared with on cpu"):
            delta.compute_delta(live, {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, base_version=None)


def test_a_payload_leaves_the_device_as_host_copies() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        values = torch.empty(3, device="cuda:0", dtype=torch.bfloat16)
        indices = torch.empty(3, device="cuda:0", dtype=torch.int32)
        change = delta.WeightDelta(
            base_version="v1", tensors=[delta.TensorDelta("a", indices, values), delta.TensorDelta("b", None, values)],
            digest=7, mode="delta", changed_elements=6, total_elements=40, full_bytes=80, compute_s=0.0,
        )
        host = change.to_host()
    assert [(t.values.device.type, None if t.indices is None else t.indices.device.type) for t in host.tensors] == [
        ("cpu", "cpu"), ("cpu", None)
    ]
    assert (host.base_version, host.digest, host.changed_elements) == ("v1", 7, 6)
