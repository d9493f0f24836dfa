"""The running decode batch's KV cache: rows of different lengths, left-padded to one width.

Continuous batching needs rows that joined at different times (and so hold
different numbers of cached tokens) to decode together in one forward. This
module keeps them in one `transformers.DynamicCache` of width W: row r holds
its `lengths[r]` real positions right-aligned, and the first W - lengths[r]
columns are padding that the attention mask hides. Keys are cached after
RoPE, so a row's padding never shifts its positions: each decode step passes
the row's true position (its length) as its position id.

`KvBatch` knows nothing of requests, sampling or LoRA versions: rows join
(`join`), advance one token per forward (`mask_and_positions`, `advance`) and
leave (`keep`); columns that every row pads are trimmed away at once, so a
long prompt that left does not make every later step pay for its width.
Plain synchronous torch; no trio.
"""

from __future__ import annotations

import torch
import transformers
from transformers.cache_utils import DynamicLayer


KvLayers = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (keys, values), (B, H, L, D)


def cache_tensors(cache: transformers.DynamicCache) -> KvLayers:
    """Each layer's (keys, values), (B, H, L, D)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_holding(config: transformers.PretrainedConfig, layers: KvLayers) -> transformers.DynamicCache:
    """A cache that holds `layers` (each (1, H, L, D)) as its positions 0 .. L-1, to run more after."""
    cache = transformers.DynamicCache(config=config)
    assert len(cache.layers) == len(layers), f"{len(layers)} cached layers for a model of {len(cache.layers)}"
    for layer, (keys, values) in zip(cache.layers, layers):
        _assign(layer, keys, values)
    return cache


def _assign(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def check_plain_layers(cache: transformers.DynamicCache) -> None:
    """Left-padding is only sound when every layer caches every position (no sliding window)."""
    for layer in cache.layers:
        assert type(layer) is DynamicLayer, f"continuous batching needs full-attention layers, got {type(layer).__name__}"


class KvBatch:
    """A left-padded batch of KV rows. Row order is the caller's: it indexes rows by position."""

    def __init__(self, config: transformers.PretrainedConfig, device: torch.device) -> None:
        self.cache = transformers.DynamicCache(config=config)
        check_plain_layers(self.cache)
        self._device = device
        self.lengths: list[int] = []  # real cached positions per row
        # Per layer: (keys, values) buffers whose first W columns the cache's tensors view (`append`).
        self._room: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.cache.layers)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.cache.get_seq_length() if self.lengths else 0

    def join(self, joining: list[tuple[KvLayers, int]]) -> None:
        """Append rows: for each (layers, copies), `copies` copies of the single row of `layers`
        (all of its positions are real). One copy of the batch for all of them, however many
        requests take rows in one step."""
        for layers, _ in joining:
            assert layers[0][0].shape[0] == 1, f"join takes batch-1 caches, got batch {layers[0][0].shape[0]}"
        width = max([self.width] + [layers[0][0].shape[2] for layers, _ in joining])
        for index, layer in enumerate(self.cache.layers):
            keys = [_left_pad(layer.keys, width)] if self.lengths else []
            values = [_left_pad(layer.values, width)] if self.lengths else []
            for layers, copies in joining:
                keys.append(_left_pad(layers[index][0], width).expand(copies, -1, -1, -1))
                values.append(_left_pad(layers[index][1], width).expand(copies, -1, -1, -1))
            # cat copies, even a single part: the rows never alias the prefill caches.
            _assign(layer, torch.cat(keys), torch.cat(values))
        for layers, copies in joining:
            self.lengths.extend([layers[0][0].shape[2]] * copies)

    def attend_and_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next forward's attention mask (B, W + 1), True where a row may attend (padding
        columns are False), and position ids (B, 1), for one new token per row."""
        width = self.width
        lengths = torch.tensor(self.lengths, dtype=torch.int64, device=self._device)  # (B,)
        columns = torch.arange(width + 1, device=self._device)
        return columns >= (width - lengths)[:, None], lengths[:, None]

    def mask_and_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend_and_positions` with the mask as Hugging Face takes it: int64, padding 0."""
        attend, positions = self.attend_and_positions()
        return attend.to(torch.int64), positions

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache one new position per row in `layer` ((B, H, 1, D) each); returns that layer's
        keys and values, (B, H, W + 1, D). For a forward that does not go through the cache's own
        `update` (`fused_forward`); `advance` follows once every layer has appended.

        The position is written in place into spare columns kept behind the layer's tensors,
        so a step copies one column rather than the whole cache (what `update`'s cat does).
        Whatever replaced the layer's tensors since (join, keep, an `update`) is noticed, and
        the next append copies them into fresh room once.
        """
        cached = self.cache.layers[layer]
        width = cached.keys.shape[2]
        room = self._room[layer]
        if room is None or width == room[0].shape[2] or not _is_prefix(cached.keys, room[0]):
            room = self._room[layer] = _grow(cached.keys, cached.values)
        room_keys, room_values = room
        room_keys.select(2, width).copy_(keys.select(2, 0))
        room_values.select(2, width).copy_(values.select(2, 0))
        _assign(cached, room_keys.narrow(2, 0, width + 1), room_values.narrow(2, 0, width + 1))
        return cached.keys, cached.values

    def advance(self) -> None:
        """Every row cached one more position (the forward that just ran appended it)."""
        self.lengths = [n + 1 for n in self.lengths]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order; then drop columns that are padding in every row."""
        if len(rows) == len(self.lengths):
            return
        self.lengths = [self.lengths[r] for r in rows]
        if not rows:
            # Free the tensors; the next join starts from its own rows alone.
            for layer in self.cache.layers:
                _assign(layer, layer.keys[:0], layer.values[:0])
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self._device)
        self.cache.batch_select_indices(index)
        unused = self.width - max(self.lengths)
        if unused > 0:
            for layer in self.cache.layers:
                _assign(layer, layer.keys[:, :, unused:].contiguous(), layer.values[:, :, unused:].contiguous())


def _is_prefix(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` is `buffer[:, :, :W]` for some W (so columns W.. of buffer are free)."""
    same_start = view.data_ptr() == buffer.data_ptr()
    return same_start and view.shape[:2] == buffer.shape[:2] and view.stride() == buffer.stride()


def _grow(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers holding `keys` and `values` (B, H, W, D) in their first W columns, with room for
    as many again (at least 32): appends copy the cache once per doubling, not once per step."""
    batch, heads, width, dim = keys.shape
    capacity = width + max(32, width)
    room_keys = keys.new_empty((batch, heads, capacity, dim))
    room_values = values.new_empty((batch, heads, capacity, values.shape[3]))
    room_keys[:, :, :width] = keys
    room_values[:, :, :width] = values
    return room_keys, room_values


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, width, D) with zeros in front."""
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0))
