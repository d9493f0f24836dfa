"""Two CUDA assumptions of NeMo Automodel 0.7.0, lifted for a CPU device.

`NeMoAutoModelForCausalLM.from_pretrained` (in `nemo_automodel._transformers.auto_model`)
asks `torch.cuda.current_device()` for the device it builds on, and hands
`torch.device("cuda", that)` to `apply_model_infrastructure`, which materialises and
shards the model there. A CPU-only torch has no current CUDA device, and a CPU group's
model belongs on the CPU. `on_device(device)` makes both say `device` for the length of
one build, and restores them after; on a CUDA device it changes nothing.

Why patch at all: the device is not an argument of `from_pretrained` in 0.7.0. What was
measured (issue 20): with these two changes, FSDP2 over gloo on 2 CPU ranks matches one
process within ~1e-6.

What it does not do: anything outside the `with` block, or anything on a CUDA device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Build Automodel models on `device` (a CPU) inside this block; a no-op for CUDA devices."""
    if device.type == "cuda":
        yield
        return
    import nemo_automodel._transformers.auto_model as auto_model

    build_infrastructure = auto_model.apply_model_infrastructure
    current_device = torch.cuda.current_device

    def on_this_device(model: Any, **kwargs: Any) -> Any:
        kwargs["device"] = device
        return build_infrastructure(model, **kwargs)

    # The index is only ever put into torch.device("cuda", index), which the wrapper above replaces.
    torch.cuda.current_device = lambda: 0
    auto_model.apply_model_infrastructure = on_this_device
    try:
        yield
    finally:
        auto_model.apply_model_infrastructure = build_infrastructure
        torch.cuda.current_device = current_device
