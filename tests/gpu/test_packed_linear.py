"""packed_linear: weights packed once for oneDNN give F.linear's results, release a mapped
checkpoint's pages, and are given back on request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from openrld.gpu import packed_linear

# The mechanism on small matrices: every weight here is packed unless a test says otherwise.
pytestmark = pytest.mark.usefixtures("small_weights_pack")
FLOOR = packed_linear.MIN_PACKED_ELEMENTS  # the node's, read before the fixture lowers it


def mapped_weight(path: Path, out_features: int, in_features: int) -> torch.Tensor:
    """A float32 (out, in) weight whose bytes are a private mapping of a file, as a loaded checkpoint's are."""
    torch.randn(out_features, in_features).numpy().tofile(path)
    return torch.from_file(str(path), shared=False, size=out_features * in_features).view(out_features, in_features)


def test_a_packed_weight_multiplies_as_f_linear_does_at_any_row_count():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packs = packed_linear.PackedWeights()
    packs.pack([weight], rows=8)
    packed = packs.get(weight)
    for shape in ((1, 64), (8, 64), (3, 5, 64), (200, 64)):
        x = torch.randn(shape)
        torch.testing.assert_close(packed_linear.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_linear.linear(x, packed, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_packing_a_mapped_weight_releases_its_pages_and_keeps_its_values(tmp_path: Path):
    weight = mapped_weight(tmp_path / "weight.bin", 1024, 256)  # 1 MiB: whole pages
    values = weight.clone()
    packs = packed_linear.PackedWeights()
    assert packs.pack([weight], rows=8) == 1024 * 256 * 4
    assert torch.equal(weight, values)  # read back from the file


def test_a_weight_in_anonymous_memory_is_packed_and_kept():
    weight = torch.randn(64, 32)
    packs = packed_linear.PackedWeights()
    assert (packs.pack([weight], rows=8), packs.bytes, packs.get(weight) is not None) == (0, 64 * 32 * 4, True)


def test_a_weight_is_packed_once_however_often_it_is_named():
    weight = torch.randn(64, 32)
    packs = packed_linear.PackedWeights()
    packs.pack([weight, weight], rows=8)
    first = packs.get(weight)
    packs.pack([weight], rows=8)
    assert (packs.bytes, packs.get(weight) is first) == (64 * 32 * 4, True)


def test_only_float32_matrices_are_packed():
    half, vector = torch.randn(64, 32).to(torch.bfloat16), torch.randn(32)
    packs = packed_linear.PackedWeights()
    packs.pack([half, vector], rows=8)
    assert (packs.get(half), packs.get(vector), packs.bytes, packs.is_packed) == (None, None, 0, True)


def test_drop_gives_back_every_copy_and_its_bytes():
    weights = [torch.randn(64, 32), torch.randn(16, 64)]
    packs = packed_linear.PackedWeights()
    packs.pack(weights, rows=8)
    assert packs.drop() == (64 * 32 + 16 * 64) * 4
    assert ([packs.get(w) for w in weights], packs.bytes, packs.is_packed) == ([None, None], 0, False)


def test_a_models_linears_multiply_through_packed_copies_made_at_its_first_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16, bias=False))
    x = torch.randn(3, 5, 32)
    expected = model(x)
    linears = packed_linear.PackedLinears.for_model(model)
    assert linears is not None and linears.packed_bytes == 0
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert linears.packed_bytes == (32 * 64 + 64 * 16) * 4


def test_dropped_copies_are_packed_again_at_the_next_forward():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    linears = packed_linear.PackedLinears.for_model(model)
    assert linears is not None
    model(torch.randn(2, 8))
    assert (linears.drop_packed(), linears.packed_bytes, linears.drop_packed()) == (8 * 8 * 4, 0, 0)
    model(torch.randn(2, 8))
    assert linears.packed_bytes == 8 * 8 * 4


def test_a_model_with_no_float32_linear_gets_no_packed_linears():
    assert packed_linear.PackedLinears.for_model(torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16))) is None


def test_a_weight_under_the_floor_keeps_f_linear_and_one_at_it_is_packed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", FLOOR)
    small, large = torch.randn(FLOOR // 64 - 1, 64), torch.randn(FLOOR // 64, 64)
    packs = packed_linear.PackedWeights()
    packs.pack([small, large], rows=8)
    assert (packs.get(small) is None, packs.get(large) is not None, packs.bytes) == (True, True, FLOOR * 4)


def test_a_model_of_small_linears_only_gets_no_packed_linears(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", FLOOR)
    assert packed_linear.PackedLinears.for_model(torch.nn.Sequential(torch.nn.Linear(64, 64))) is None
