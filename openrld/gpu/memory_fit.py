"""Whether a training datum's step fits in the memory its device can give, before it runs.

A datum too long for the device would otherwise run until the allocator fails: on CUDA an
out-of-memory error mid-step, on a CPU the kernel's OOM killer taking the whole daemon. So
`BatchScorer` estimates each datum's step and refuses one over the limit with a 400 that names
both figures (`fit_refusal`).

The estimate is measured, not derived from the model's shape: `measure_step_fit` runs the
scorer's own training step (forward, chunked log-softmax, backward; checkpointed and plain) on
two short probe lengths under `PeakMeter`, which records the most bytes of tensors allocated
and alive at once, and fits a line through them per regime. A step's memory is linear in its
tokens once the pieces that do not grow with them are held fixed:
- the logits: the probes pin the log-softmax chunk to `PROBE_CHUNK` positions, and a third
  probe measures what one more position of a chunk costs (the output layer's row, its fp32
  copy, the log-softmax, their gradients), so a real chunk is added at its own size;
- a sliding layer's attention past its window works on one block of queries at a time
  (`long_attention`), a fixed size the short probes never reach: added from the model's shape
  (`window_block_bytes`).
The tensor bytes are then scaled by `allocator_margin` for what the allocator holds beyond
them, measured against the process's resident memory (below).

Measured on 2 CPU cores, fresh process per length (`PeakMeter` on the real step against the
tensor estimate): SmolLM2 plain at 1,024 tokens 1.718 GiB against 1.724 estimated, checkpointed
at 2,048 0.335 against 0.336; Gemma 3 270M plain at 1,024 1.966 against 1.896 (the one case the
tensor estimate runs low, by 4%, inside the margin); every tiny family within 2x in the tests.

Why a hand-written meter: on CUDA the caching allocator reports its peak and `PeakMeter` reads
it; torch keeps no allocation statistics for the CPU, so there the meter is a dispatch mode that
adds each new tensor storage's bytes when an operator returns it and subtracts them when the
storage is freed (torch keeps one Python object per storage, so a finalizer on it fires exactly
then). Views and in-place results share an input's storage and are not counted again.

What it does not do: plan micro-batches, or decide whether to checkpoint (`scoring.py` does);
count what other engines in the process allocate meanwhile (a sampler's KV cache grows on its
own and is bounded by its own budget).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MEMINFO = Path("/proc/meminfo")
# Two lengths whose difference is the per-token slope: short, so that the probes cost little, and
# past 64 apart, so that a layer that pads to chunks of 64 (Qwen3.5's Gated DeltaNet) grows between
# them (at 16 and 48 its estimate came out at 0.58 of its step). SmolLM2's probes take about 8 s.
PROBE_TOKENS = (32, 96)
PROBE_CHUNK = 8  # log-softmax positions per chunk in the probes: both lengths hold several chunks
# Memory the allocator holds per byte of live tensors at a step's peak, by device and regime.
# CPU: glibc's malloc keeps freed blocks below its (adaptive) mmap threshold for reuse, and a
# checkpointed step, which frees and reallocates each layer's activations in backward, leaves
# most of them behind. Measured as the peak RSS a step adds over the tensor peak `PeakMeter`
# reads on it, fresh process per length, 2 CPU cores: SmolLM2 plain at 1,024 tokens 2.66 GiB
# over 1.72 (1.55), Gemma 3 270M plain at 1,024 2.49 over 1.97 (1.27), SmolLM2 checkpointed at
# 2,048 1.76 and, in a second run, 2.16 over 0.335 (5.3, 6.5), Gemma 3 270M checkpointed at
# 8,192 4.06 over about 0.67 (6.1; the daemon's RSS in bench/long_context.py against this
# estimate). The ratio falls with length
# (Gemma 3 270M at 32,768: about 2.7), so a very long datum is over-estimated up to 2.5x.
# The SmolLM2 figures are a plain process under glibc's defaults; the Gemma one is `openrld
# serve`, which bounds its heap (openrld/heap.py: then two arenas, a fixed 4 MiB mmap threshold) and
# still keeps about 6x. Under MALLOC_MMAP_THRESHOLD_=1048576 the SmolLM2 step adds 0.356 GiB, its
# tensors alone, but an SFT step of 8 × 128 took 5.3 s against 4.4 s under the defaults (one
# pair): the page faults of fresh mappings cost more than a tighter margin is worth.
# CUDA: torch's caching allocator rounds and splits blocks; not measured here (no GPU).
CPU_MARGIN = {False: 2.0, True: 8.0}  # checkpointed -> margin; the 8 leaves a fifth over the worst seen
CUDA_MARGIN = 1.3


def allocator_margin(device: torch.device, checkpointed: bool) -> float:
    return CUDA_MARGIN if device.type == "cuda" else CPU_MARGIN[checkpointed]


class PeakMeter:
    """The most bytes of tensor storage allocated inside the `with` block and alive at once
    (`peak`), on `device`; what was allocated before the block is not counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._mode: _StorageCounter | None = None
        self._before = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _StorageCounter()
            self._mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._mode is not None:
            self._mode.__exit__(kind, error, trace)
            self.peak = self._mode.peak
            self._mode = None
        else:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._before


class _StorageCounter(TorchDispatchMode):
    """Live bytes of the storages operators return, and their maximum (`PeakMeter` on a CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage address -> bytes, while it lives

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in inputs or address in self._sizes or storage.nbytes() == 0:
                continue  # a view or an in-place result: no new memory
            self._sizes[address] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, address)
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, address: int) -> None:
        self.live -= self._sizes.pop(address, 0)


class Line(msgspec.Struct, frozen=True):
    """bytes = fixed + per_token × tokens."""

    fixed: float
    per_token: float

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


class StepFit(msgspec.Struct, frozen=True):
    """A training step's peak tensor bytes as a function of its tokens, measured on the model.

    `plain` and `checkpointed` are lines through the probes (None: the model cannot checkpoint),
    with log-softmax chunks of `PROBE_CHUNK` positions; `logits_per_position` is what one more
    position of a chunk costs; `window_block` a sliding layer's block past its window."""

    plain: Line
    checkpointed: Line | None
    logits_per_position: float
    window_block: int

    def step_bytes(self, tokens: int, checkpointed: bool, chunk_positions: int, margin: float) -> int:
        """The allocator's bytes for a step over `tokens` tokens, its log-softmax taking
        `chunk_positions` at a time (all of them when fewer), checkpointed or not: the tensors'
        peak times `margin` (`allocator_margin`)."""
        if checkpointed and self.checkpointed is not None:
            line = self.checkpointed
        else:
            line = self.plain
        logits = self.logits_per_position * (min(tokens, chunk_positions) - PROBE_CHUNK)
        return int(margin * (line.at(tokens) + max(0.0, logits) + self.window_block))


def measure_step_fit(
    device: torch.device,
    run_step: Callable[[int, bool], None],
    run_chunk: Callable[[int], None],
    can_checkpoint: bool,
    window_block: int,
) -> StepFit:
    """Probe a model's training step (`run_step(tokens, checkpointed)`, with chunks of
    `PROBE_CHUNK` positions) at `PROBE_TOKENS`, and one log-softmax chunk (`run_chunk(positions)`)
    at one and two `PROBE_CHUNK`s, each under a `PeakMeter`."""

    def peak(run: Callable[[], None]) -> int:
        with PeakMeter(device) as meter:
            run()
        return meter.peak

    def line(checkpointed: bool) -> Line:
        short, long = PROBE_TOKENS
        low = peak(lambda: run_step(short, checkpointed))
        high = peak(lambda: run_step(long, checkpointed))
        per_token = max(0.0, (high - low) / (long - short))
        return Line(fixed=low - per_token * short, per_token=per_token)

    one = peak(lambda: run_chunk(PROBE_CHUNK))
    two = peak(lambda: run_chunk(2 * PROBE_CHUNK))
    return StepFit(
        plain=line(False),
        checkpointed=line(True) if can_checkpoint else None,
        logits_per_position=max(0.0, (two - one) / PROBE_CHUNK),
        window_block=window_block,
    )


def window_block_bytes(config: Any, block: int, element_size: int) -> int:
    """A sliding layer's attention scores for one block of `block` queries past its window: the
    scores, their softmax, and the gradients of both, (heads, block, block + window) each.
    0 for a model without sliding layers."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not window or not getattr(text, "layer_types", None) or "sliding_attention" not in text.layer_types:
        return 0
    block = min(block, window)
    return 4 * text.num_attention_heads * block * (block + window) * element_size


def available_memory(device: torch.device) -> int:
    """The bytes the device can give to a new allocation now.

    CUDA: what the driver has free plus what torch's caching allocator holds but does not use.
    CPU: MemAvailable from /proc/meminfo (free memory plus the page cache the kernel can drop);
    where that file does not exist, the free pages sysconf reports.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    if MEMINFO.exists():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts in KiB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fit_refusal(index: int, tokens: int, estimate: int, limit: int) -> str | None:
    """The 400's message for datum `index` when its `estimate` passes `limit`; None when it fits."""
    if estimate <= limit:
        return None
    return (
        f"datum {index}: model_input has {tokens} tokens, whose training step needs about "
        f"{_gib(estimate)} of memory; the device can give {_gib(limit)} "
        f"({estimate} > {limit} bytes); send a shorter datum"
    )


def _gib(size: int) -> str:
    return f"{size / 1024**3:.2f} GiB"
