"""Frozen linear weights packed once for oneDNN, for the CPU sampler's matmuls.

On the CPU, `F.linear` runs MKL's sgemm, which at a decode step's few rows spends much of its
time copying the weight into its own blocked layout, again at every call: `perf` on a daemon
sampling SmolLM2 put 47% of its CPU in MKL's copy routines (`sgemm_scopy_*`). oneDNN's inner
product takes the weight packed once into its layout (`torch.ops.mkldnn._reorder_linear_weight`,
what torch's inductor does to frozen CPU weights) and reads it as it is. SmolLM2's 211 linears,
float32, two threads (`bench/packed_linear.py`): 63.9 ms a step with `F.linear` against 30.9 ms
packed at 8 rows; 98 against 57 ms at 32 rows; 1.78 against 1.44 s at 1,024. The results agree with
`F.linear`'s to float32 rounding: the same products, summed in another order. A small weight is
not packed (`MIN_PACKED_ELEMENTS`): oneDNN's fixed cost a call is more than its whole multiply.

What it owns: the packed copies of one model's frozen weights, by the parameter each copies,
made when asked (`pack`) and given back when asked (`drop`: a parked sampler holds no copy;
packing SmolLM2 again takes about 0.3 s). A weight whose bytes lie in a file mapping (a
checkpoint that was loaded by mapping it) has those pages released once it is packed
(`heap.release_file_pages`), so the model is not held twice; they come back from the file if
something reads the weight again (a tied embedding's lookups read a few rows a step). A weight
in anonymous memory (a checkpoint converted on load) is held twice.

`PackedLinears` does the same inside a forward that is Hugging Face's own (the families
`fused_forward` does not run: Gemma, Qwen3.5, mixture-of-experts): each of the model's
`nn.Linear`s multiplies through its weight's packed copy, made at the first forward.

Not for weights that change in place (the full fine-tuning sampler's synced weights): a copy
does not see the change. It is torch alone, no trio; `usable` says where oneDNN can take a
weight and repays it, and elsewhere the caller keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from openrld import heap

_NO_ATTRIBUTES: list[object] = []  # oneDNN's post-op arguments: none

# A oneDNN call costs about 12-15 microseconds whatever its size, where MKL's sgemm of a small
# weight takes 3-8: below about 2**17 elements the packed copy is slower, above it faster (one
# weight, 8 and 64 rows, 1 and 2 threads: 64 x 64 0.19-0.44 of F.linear's speed, 192 x 576
# 0.89-1.07, 2,048 x 64 1.06-1.47, 576 x 576 1.13-1.42). The tiny Llama's weights (at most
# 384 x 64) are all below it: its engine's sample of 8 x 32 took 32.5 ms with them packed
# against 20.7 ms with none.
MIN_PACKED_ELEMENTS = 2**17


def usable(weight: torch.Tensor) -> bool:
    """Whether `weight` is worth packing for oneDNN: a float32 matrix on the CPU, where torch has
    oneDNN, of at least `MIN_PACKED_ELEMENTS`."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
        and weight.numel() >= MIN_PACKED_ELEMENTS and torch.backends.mkldnn.is_available()
    )


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN through `packed`, the weight's packed copy or the
    weight as it lies ((out, in), of any strides: `lora_addmm`'s training node); x: (..., in)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", _NO_ATTRIBUTES, "")


class PackedWeights:
    """The packed copies of one model's weights, by parameter; one caller at a time."""

    def __init__(self) -> None:
        # id(weight) -> (the weight, its packed copy): the weight is held so that its id stays its own.
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.is_packed = False  # `pack` ran since the last `drop` (it may have found nothing to pack)

    @property
    def bytes(self) -> int:
        """The bytes of the packed copies held, counted as their dense weights'."""
        return sum(weight.numel() * weight.element_size() for weight, _ in self._copies.values())

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s packed copy, or None where it has none."""
        entry = self._copies.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def pack(self, weights: list[torch.Tensor], rows: int) -> int:
        """Pack each of `weights` that oneDNN can take and has no copy yet, for calls of about
        `rows` rows (oneDNN's hint: any row count works); returns the file-mapped bytes released."""
        released = 0
        for weight in weights:
            if self.get(weight) is not None or not usable(weight):
                continue
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
            self._copies[id(weight)] = (weight, packed)
            released += heap.release_file_pages(weight.data_ptr(), weight.numel() * weight.element_size())
        self.is_packed = True
        return released

    def drop(self) -> int:
        """Give back every packed copy; returns their bytes."""
        dropped = self.bytes
        self._copies.clear()
        self.is_packed = False
        return dropped


class PackedLinears:
    """A model's `nn.Linear`s, as they are when it is loaded (before any adapter), multiplying
    through packed copies of their weights in the model's own forward.

    Each linear's `forward` is replaced on the instance; peft keeps the module as its LoRA
    layer's `base_layer` and calls it, so every adapter's term is added as before. The copies are
    made at the first forward after construction or `drop`. A linear whose weight oneDNN cannot
    take (`usable`) keeps `F.linear`.
    """

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        self._linears = linears
        self._packs = PackedWeights()
        for module in linears:
            module.forward = functools.partial(self._forward, module)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PackedLinears | None:
        """The model's linears routed through packed copies; None when none is worth packing (`usable`)."""
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        return cls(linears) if any(usable(m.weight) for m in linears) else None

    @property
    def packed_bytes(self) -> int:
        """The bytes of the weights held packed now (as dense float32), as `FusedForward.packed_bytes`."""
        return self._packs.bytes

    def drop_packed(self) -> int:
        """Give back the packed copies (the next forward packs them again); returns their bytes,
        as `FusedForward.drop_packed`."""
        return self._packs.drop() if self._packs.is_packed else 0

    def _forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self._packs.is_packed:
            self._packs.pack([m.weight for m in self._linears], rows=8)  # a decode step's rows: a hint
        packed = self._packs.get(module.weight)
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        return linear(x, packed, module.bias)
