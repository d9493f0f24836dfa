"""The running decode batch's cache: rows of different lengths, left-padded to one width.

Continuous batching needs rows that joined at different times (and so hold
different numbers of cached tokens) to decode together in one forward. This
module keeps them in one `transformers.DynamicCache`: every row sits in a
global frame of W columns, its `lengths[r]` real positions right-aligned, and
the first W - lengths[r] columns are padding that the attention mask hides.
Keys are cached after RoPE, so a row's padding never shifts its positions:
each decode step passes the row's true position (its length) as its position
id, and the masks are built on columns, where a row's distances between
positions are its true ones.

Each layer keeps what its kind needs (`LayerKind`), per row:
- full attention: all W columns;
- sliding window w: the last min(W, w - 1) columns, as the model's own
  `DynamicSlidingWindowLayer` keeps them (its `cumulative_length` is W, so the
  model's mask builder offsets its window mask to those columns); no row can
  attend further back than w - 1 columns, whatever its padding;
- linear attention (Gated DeltaNet and the like): a convolution state and a
  recurrent state per row, with no columns at all; padding never reaches them,
  since rows join with the states their own prefill left;
- shared KV (Gemma 4's last layers reuse an earlier layer's keys): nothing.

A prefill runs on a batch-1 cache from `prefill_cache`, where sliding layers
keep every position like full ones (the window is applied by the mask): its
KV is then a plain prefix the prefix cache can keep, and joining the batch
cuts each sliding layer to its window. A long prompt's prefill may instead be
`windowed` (the caller decides when: the torch sampler past
`windowed_prefill_tokens`): its sliding layers are Hugging Face's own and keep
only their window from chunk to chunk, so their memory stops growing with the
prompt, and its KV is no plain prefix (the prefix cache cannot take it). A
windowed cache still has full layers to say its length: models whose every
attention layer slides are never prefilled windowed (`can_window`).

`KvBatch` knows nothing of requests, sampling or LoRA versions: rows join
(`join`), advance one token per forward (`mask_and_positions`, `advance`) and
leave (`keep`); columns that every row pads are trimmed away at once, so a
long prompt that left does not make every later step pay for its width.

Why it is written here: transformers' caches batch rows only when they start
together (generate's left padding); nothing in it joins a row into a running
batch or drops one from it. Plain synchronous torch; no trio.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import transformers
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

# One row's cache, per cache layer: (keys, values), each (1, H, L, D), for an attention layer;
# (convolution state, recurrent state), each batch-first, for a linear-attention layer; None for a
# layer that caches nothing (shared KV). A batch's rows are the same with B rows.
KvLayers = list[tuple[torch.Tensor, torch.Tensor] | None]


class LayerKind(enum.Enum):
    FULL = "full attention"
    SLIDING = "sliding-window attention"
    LINEAR = "linear attention"
    SHARED = "shared KV"


class UnsupportedCache(ValueError):
    """The model's cache has a layer kind the sampler cannot batch; the message names it."""


def layer_kinds(cache: transformers.DynamicCache) -> list[LayerKind]:
    """Each cache layer's kind; raises UnsupportedCache for any other layer."""
    kinds = []
    for layer in cache.layers:
        # Exact types: a subclass (indexed attention, hybrid linear + attention) keeps more than these do.
        if type(layer) is DynamicLayer:
            kinds.append(LayerKind.FULL)
        elif type(layer) is DynamicSlidingWindowLayer:
            kinds.append(LayerKind.SLIDING)
        elif type(layer) is LinearAttentionLayer and layer.number_of_states == 1:
            kinds.append(LayerKind.LINEAR)
        elif type(layer) is DummyLayer:
            kinds.append(LayerKind.SHARED)
        else:
            raise UnsupportedCache(f"the sampler cannot batch {type(layer).__name__} cache layers")
    if not any(kind in (LayerKind.FULL, LayerKind.SLIDING) for kind in kinds):
        raise UnsupportedCache("the sampler needs at least one attention layer")
    return kinds


def check_batchable(config: transformers.PretrainedConfig) -> list[LayerKind]:
    """The kinds of the model's cache layers; raises UnsupportedCache when one cannot be batched."""
    return layer_kinds(transformers.DynamicCache(config=config))


def prefix_reuse_unsupported(config: transformers.PretrainedConfig) -> str | None:
    """Why the prefix cache must step aside for this model, or None when it can serve it.

    A linear-attention layer's state after a prefix is not a slice of anything the prefill
    keeps: it would have to be saved at every block boundary. The sampler does not save it, so
    models with such layers prefill every prompt whole."""
    if LayerKind.LINEAR in check_batchable(config):
        return "linear-attention layers keep a recurrent state, not per-position KV"
    return None


def can_window(config: transformers.PretrainedConfig) -> bool:
    """Whether a windowed prefill (sliding layers keep only their window) saves anything and
    leaves the row's length readable: the model has sliding layers and full ones."""
    kinds = check_batchable(config)
    return LayerKind.SLIDING in kinds and LayerKind.FULL in kinds


def prefill_cache(config: transformers.PretrainedConfig, *, windowed: bool = False) -> transformers.DynamicCache:
    """An empty batch-1 cache for a prefill: sliding layers keep every position, as full ones
    do, unless `windowed` (then they keep their window, as in the running batch)."""
    cache = transformers.DynamicCache(config=config)
    if not windowed:
        cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def cache_tensors(cache: transformers.DynamicCache) -> KvLayers:
    """Each layer's tensors (`KvLayers`) as the cache holds them."""
    out: KvLayers = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            out.append((layer.conv_states[0], layer.recurrent_states[0]))
        elif isinstance(layer, DummyLayer):
            out.append(None)
        else:
            out.append((layer.keys, layer.values))
    return out


def cache_holding(
    config: transformers.PretrainedConfig, layers: KvLayers, *, windowed: bool = False
) -> transformers.DynamicCache:
    """A prefill cache that holds `layers` (each (1, H, L, D)) as its positions 0 .. L-1, to run
    more after; `windowed` as in `prefill_cache` (its sliding layers keep their last w - 1)."""
    cache = prefill_cache(config, windowed=windowed)
    if len(cache.layers) != len(layers):
        raise ValueError(f"{len(layers)} cached layers for a model of {len(cache.layers)}")
    for layer, tensors in zip(cache.layers, layers):
        if tensors is None:
            continue
        keys, values = tensors
        if type(layer) is DynamicSlidingWindowLayer:
            # What the layer's own update would have kept, and how far its positions reach.
            layer.cumulative_length = keys.shape[2]
            keys, values = keys[:, :, -(layer.sliding_window - 1) :], values[:, :, -(layer.sliding_window - 1) :]
        _assign(layer, keys, values)
    return cache


def _assign(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def _assign_states(layer: LinearAttentionLayer, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Give a linear-attention layer these states, marked as a continuation (not a prefill)."""
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.conv_kernel_size[0] = conv.shape[-1]
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.device, layer.dtype = conv.device, conv.dtype


class KvBatch:
    """A left-padded batch of cached rows. Row order is the caller's: it indexes rows by position."""

    def __init__(self, config: transformers.PretrainedConfig, device: torch.device) -> None:
        self._config = config
        self.cache = transformers.DynamicCache(config=config)
        self.kinds = layer_kinds(self.cache)
        self._device = device
        self.lengths: list[int] = []  # real cached positions per row
        self._width = 0  # W: the columns of the global frame
        # Per layer: (keys, values) buffers whose first W columns the cache's tensors view (`append`).
        self._room: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.cache.layers)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self._width if self.lengths else 0

    def nbytes(self) -> int:
        """The bytes the batch's tensors hold: the cache's and the spare room behind them
        (`append`), each storage once."""
        held = [tensor for tensors in cache_tensors(self.cache) if tensors is not None for tensor in tensors]
        held += [tensor for room in self._room if room is not None for tensor in room]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t is not None}
        return sum(storages.values())

    def join(self, joining: list[tuple[KvLayers, int]]) -> None:
        """Append rows: for each (layers, copies), `copies` copies of the single row of `layers`
        (a prefill cache: all of its positions are real). One copy of the batch for all of them,
        however many requests take rows in one step."""
        lengths = [_row_length(layers, self.kinds) for layers, _ in joining]
        width = max([self.width] + lengths)
        for index, (layer, kind) in enumerate(zip(self.cache.layers, self.kinds)):
            if kind is LayerKind.SHARED:
                continue
            parts = [self._padded_layer(index, width)] if self.lengths else []
            for layers, copies in joining:
                parts.append(self._padded_row(layers[index], kind, layer, width, copies))
            # cat copies, even a single part: the rows never alias the prefill caches.
            first, second = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            if kind is LayerKind.LINEAR:
                _assign_states(layer, first, second)
            else:
                _assign(layer, first, second)
            # The old rows' room goes now, not at the next append: held until then, it kept the
            # batch's KV twice over (SmolLM2, 64 rows of ~200 positions: 0.7 GB each).
            self._room[index] = None
        for length, (_, copies) in zip(lengths, joining):
            self.lengths.extend([length] * copies)
        self._set_width(width)

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
        """Cache one new position per row in full-attention `layer` ((B, H, 1, D) each); returns
        that layer's keys and values, (B, H, W + 1, D). For a forward that does not go through the
        cache's own `update` (`fused_forward`, which runs only models whose every layer is full
        attention); `advance` follows once every layer has appended.

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
        self._width += 1

    def row_layers(self, row: int) -> KvLayers | None:
        """Row `row`'s cache as a prefill would hold it (every position from column 0), or None
        when the batch no longer holds all of it (a sliding layer keeps only its window) or the
        model has linear-attention layers (whose states hold no prefix)."""
        length = self.lengths[row]
        out: KvLayers = []
        for layer, kind in zip(self.cache.layers, self.kinds):
            if kind is LayerKind.SHARED:
                out.append(None)
                continue
            if kind is LayerKind.LINEAR or layer.keys.shape[2] < length:
                return None
            columns = layer.keys.shape[2]
            out.append((layer.keys[row : row + 1, :, columns - length :], layer.values[row : row + 1, :, columns - length :]))
        return out

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order; then drop columns that are padding in every row."""
        if len(rows) == len(self.lengths):
            return
        self.lengths = [self.lengths[r] for r in rows]
        if not rows:
            # Free the tensors; the next join starts from its own rows alone.
            self.cache = transformers.DynamicCache(config=self._config)
            self._room = [None] * len(self.cache.layers)
            self._width = 0
            return
        index = torch.tensor(rows, dtype=torch.int64, device=self._device)
        width = max(self.lengths)
        for number, (layer, kind) in enumerate(zip(self.cache.layers, self.kinds)):
            if kind is LayerKind.LINEAR:
                _assign_states(layer, layer.conv_states[0][index], layer.recurrent_states[0][index])
            elif kind is not LayerKind.SHARED:
                # The kept rows trimmed to the columns some row still uses, in one copy; and the
                # old room freed now (`join` says why).
                columns = min(layer.keys.shape[2], width)
                _assign(layer, layer.keys[:, :, -columns:][index], layer.values[:, :, -columns:][index])
                self._room[number] = None
        self._set_width(width)

    # -- internals ----------------------------------------------------------

    def _set_width(self, width: int) -> None:
        self._width = width
        for layer, kind in zip(self.cache.layers, self.kinds):
            if kind is LayerKind.SLIDING:
                layer.cumulative_length = width  # the model's mask offsets its window from it

    def _padded_layer(self, index: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's rows of layer `index`, in a frame of `width` columns."""
        layer, kind = self.cache.layers[index], self.kinds[index]
        if kind is LayerKind.LINEAR:
            return layer.conv_states[0], layer.recurrent_states[0]
        columns = _columns(kind, layer, width)
        return _left_pad(layer.keys, columns), _left_pad(layer.values, columns)

    def _padded_row(
        self, tensors: tuple[torch.Tensor, torch.Tensor] | None, kind: LayerKind, layer: object, width: int, copies: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`copies` copies of a joining row's layer, in a frame of `width` columns."""
        if tensors is None:
            raise ValueError(f"a joining row has no tensors for a {kind.value} layer")
        first, second = tensors
        if kind is not LayerKind.LINEAR:
            columns = _columns(kind, layer, width)
            first, second = _left_pad(first[:, :, -columns:], columns), _left_pad(second[:, :, -columns:], columns)
        return first.expand(copies, *first.shape[1:]), second.expand(copies, *second.shape[1:])


def _columns(kind: LayerKind, layer: Any, width: int) -> int:
    """How many of the frame's last columns a layer keeps."""
    if kind is LayerKind.SLIDING:
        return min(width, layer.sliding_window - 1)
    return width


def _row_length(layers: KvLayers, kinds: list[LayerKind]) -> int:
    """A prefill cache's positions: the columns of its full layers, which keep all of them (a
    windowed prefill's sliding layers keep only their window), else of its sliding layers."""
    for wanted in (LayerKind.FULL, LayerKind.SLIDING):
        for tensors, kind in zip(layers, kinds):
            if kind is wanted:
                if tensors is None or tensors[0].shape[0] != 1:
                    raise ValueError("join takes batch-1 prefill caches")
                return tensors[0].shape[2]
    raise ValueError("a cache without attention layers has no length")


def _is_prefix(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` is `buffer[:, :, :W]` for some W (so columns W.. of buffer are free)."""
    same_start = view.data_ptr() == buffer.data_ptr()
    return same_start and view.shape[:2] == buffer.shape[:2] and view.stride() == buffer.stride()


def _grow(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers holding `keys` and `values` (B, H, W, D) in their first W columns, with room for
    a quarter as many again (at least 32): appends copy the cache once per W/4 steps, not once
    per step. A quarter, not a doubling: after a 32k-token prompt joins, a doubling would hold
    room for 32k more positions that a request rarely generates (up to 2x the KV, issue 36),
    while the copies it saves are 4 columns a step against the W columns each step's attention
    reads anyway."""
    batch, heads, width, dim = keys.shape
    capacity = width + max(32, width // 4)
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
