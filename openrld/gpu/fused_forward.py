"""The sampler's forwards of a Llama-family model as flat sequences of torch calls.

A decode step feeds one token per row through the whole model, and a prefill
feeds one short prompt. Hugging Face's forward spends most of such a call in
Python around the arithmetic (module calls, mask builders, output
dataclasses, cache bookkeeping): on a small model it costs several times its
matmuls. `FusedForward` runs the same math as plain functional calls on the
model's own parameters, so it sees every change to them (full fine-tuning's
in-place syncs, parking) and holds no copy, unless it is asked to pack them (below).

What it covers: decoder-only models whose layers are pre-norm RMSNorm,
rotary attention with grouped KV heads over every position (no sliding
window), and a gated SiLU MLP; optionally per-head q/k norms (Qwen3) and qkv
biases (Qwen2). That is Llama, Mistral, Qwen2 and Qwen3, and so SmolLM2.
`for_model` answers None for anything else, and the caller keeps Hugging
Face's forward.

LoRA: when peft has injected adapters, a target linear computes its base
output once for every row and adds each row's own adapter, B(A x) * scaling,
over the rows that name it, as peft's mixed-batch forward does; "__base__"
rows get no adapter.

Packed weights: built with `packed_weights=True` on the CPU, it multiplies by copies of the
base weights packed for oneDNN (`packed_linear`: about twice as fast at a decode step's
rows), made at its first forward and again after `drop_packed`. Those copies do not see
in-place changes to the weights, so a caller whose weights change in place leaves it off.

Plain synchronous torch; never imports trio. The caller runs it under
`torch.inference_mode()`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import peft
import torch
import torch.nn.functional as F
import transformers

from openrld.gpu import call_threads, packed_linear
from openrld.gpu.kv_batch import KvBatch, KvLayers

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed-batch forward

# (adapter name, the rows that use it or None for every row)
AdapterRows = list[tuple[str, torch.Tensor | None]]
# (layer, new keys, new values) -> that layer's cached keys and values, the new ones appended
Append = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `FusedForward` cannot run this model, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None
    lora: peft.tuners.lora.Linear | None
    packed: torch.Tensor | None  # the weight packed for oneDNN (`packed_linear`), or None: F.linear
    # adapter name -> (A, B, scaling), or None where the module has no such adapter; filled on
    # first use, emptied by `bind` whenever adapters come or go.
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float] | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class _Norm:
    weight: torch.Tensor
    eps: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    q_norm: _Norm | None  # Qwen3's per-head norms
    k_norm: _Norm | None
    post_norm: _Norm
    gate: _Linear
    up: _Linear
    down: _Linear


class FusedForward:
    """The decode step and the prefill of one loaded model; build with `for_model`."""

    def __init__(self, model: torch.nn.Module, packed_weights: bool = False) -> None:
        self._model = model
        self._decoder = model.model
        attention = self._decoder.layers[0].self_attn
        self._heads = model.config.num_attention_heads
        self._kv_heads = model.config.num_key_value_heads
        self._head_dim = attention.head_dim
        self._scaling = attention.scaling
        # Dynamic and LongRoPE recompute their frequencies from the positions in the module's
        # forward; every other rope type keeps them fixed, and its cos/sin are computed here.
        rope_type = getattr(self._decoder.rotary_emb, "rope_type", "default")
        self._fixed_rope = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) by position
        self._weights = call_threads.weights(model)  # a forward's size, for its CPU threads
        self._packs = packed_linear.PackedWeights() if packed_weights else None
        self.bind()

    def bind(self) -> None:
        """Take the model's parameters and target modules as they are now. Call it once peft
        has wrapped the model: its first adapter swaps the target linears for peft's own, and
        again whenever an adapter is added or deleted (each linear keeps its adapters' tensors
        once looked up). In-place changes to the tensors need no call: they are held, not
        copied (full fine-tuning's syncs, parking, a version copied into a reused adapter).

        Reading them once here rather than through the modules at every call (~60 lookups
        through `nn.Module.__getattr__` and 15 isinstance checks a step) took a decode step
        of the tiny Llama at 8 rows from ~1.7 ms to ~1.3 ms.
        """
        packs = self._packs
        linear_of = lambda module: _linear_of(module, packs)  # noqa: E731
        self._layers = [_layer(layer, linear_of) for layer in self._decoder.layers]
        self._embed = self._decoder.embed_tokens.weight
        self._final_norm = _norm(self._decoder.norm)
        self._lm_head = linear_of(self._model.lm_head)

    @property
    def packed_bytes(self) -> int:
        """The bytes of the weights held packed now (as dense float32)."""
        return self._packs.bytes if self._packs is not None else 0

    def drop_packed(self) -> int:
        """Give back the packed copies of the weights (a parked sampler holds none); the next
        forward packs them again. Returns their bytes."""
        if self._packs is None or not self._packs.is_packed:
            return 0
        dropped = self._packs.drop()
        self.bind()
        return dropped

    def _pack(self, packs: packed_linear.PackedWeights) -> None:
        """Pack every base weight the forward multiplies by, and bind the copies."""
        weights = [linear.weight for layer in self._layers for linear in _linears(layer)] + [self._lm_head.weight]
        released = packs.pack(weights, rows=8)  # a decode step's rows: oneDNN's hint, not a limit
        self.bind()
        logger.info("packed %d bytes of weights for oneDNN; %d bytes of mapped checkpoint released",
                    packs.bytes, released)

    @classmethod
    def for_model(cls, model: torch.nn.Module, packed_weights: bool = False) -> FusedForward | None:
        reason = unsupported_reason(model)
        if reason is not None:
            logger.info("fused forward off for this model: %s", reason)
            return None
        return cls(model, packed_weights)

    def decode(self, tokens: torch.Tensor, batch: KvBatch, adapters: list[str]) -> torch.Tensor:
        """One token per row; each layer of `batch` grows by one column (the caller then
        calls `batch.advance()`).

        Args:
            tokens: (B,) int64, each row's newest token (not yet cached).
            adapters: each row's peft adapter name, BASE_ADAPTER for none.

        Returns:
            (B, V) logits in the model's dtype.
        """
        attend, positions = batch.attend_and_positions()
        attend = attend[:, None, None, :]  # (B, 1, 1, W + 1): the same columns for every head and query
        rows = adapter_rows(adapters, tokens.device)
        end = max(batch.lengths) + 1
        return self._forward(tokens[:, None], positions, end, attend, batch.append, rows, keep=1)[:, 0]

    def prefill(
        self, tokens: torch.Tensor, cache: transformers.DynamicCache, adapter: str, keep: int
    ) -> torch.Tensor:
        """One chunk of one prompt, after the positions `cache` already holds, which it appends to.

        Args:
            tokens: (T,) int64.
            keep: how many of the chunk's last positions to compute logits for.

        Returns:
            (keep, V) logits in the model's dtype.
        """
        cached, length = cache.get_seq_length(), tokens.shape[0]
        positions = torch.arange(cached, cached + length, device=tokens.device)[None, :]  # (1, T)
        columns = torch.arange(cached + length, device=tokens.device)
        attend = (columns[None, :] <= positions[0, :, None])[None, None]  # (1, 1, T, L + T): causal
        rows = [(adapter, None)]
        append: Append = lambda layer, keys, values: cache.update(keys, values, layer)  # noqa: E731
        return self._forward(tokens[None, :], positions, cached + length, attend, append, rows, keep)[0]

    def prefill_many(
        self, prompts: list[torch.Tensor], adapters: list[str], keep: int, pasts: list[KvLayers | None] | None = None
    ) -> tuple[torch.Tensor, list[KvLayers]]:
        """Several whole prompts in one forward, left-padded to the longest, each after its own
        cached prefix (if any).

        Args:
            prompts: (P_r,) int64 each, none empty: the tokens to run.
            adapters: each prompt's peft adapter name.
            keep: logits for the batch's last `keep` positions (for a prompt shorter than
                that, the first rows are padding's and meaningless).
            pasts: each prompt's cached prefix, per layer (keys, values) (1, heads, M_r, D) for
                positions 0 .. M_r-1 (the prompt then sits at M_r ..), or None for none.

        Returns:
            (N, keep, V) logits in the model's dtype, and each prompt's KV cache, prefix included:
            per layer (keys, values), (1, heads, M_r + P_r, D); without a prefix, views of the
            batch's tensors.
        """
        device = prompts[0].device
        pasts = pasts if pasts is not None else [None] * len(prompts)
        past_lengths = [0 if past is None else _keys_values(past, 0)[0].shape[2] for past in pasts]
        past_width = max(past_lengths)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        pads = width - lengths  # (N,)
        tokens = torch.zeros((len(prompts), width), dtype=torch.int64, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt) :] = prompt
        columns = torch.arange(width, device=device)
        starts = torch.tensor(past_lengths, device=device)  # (N,): each prompt's first position
        positions = (columns[None, :] - pads[:, None]).clamp_(min=0) + starts[:, None]  # (N, T)
        causal = columns[None, :] <= columns[:, None]  # (T, T)
        real = columns[None, :] >= pads[:, None]  # (N, T): key column holds a prompt token
        # A padding query attends to itself alone, so that no row of the softmax is empty;
        # what it computes is never read.
        attend = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)  # (N, T, T)
        past_layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if past_width:
            # The prefixes, right-aligned in columns 0 .. past_width-1 before the prompts' columns;
            # a prompt's real queries attend to its prefix's real columns.
            past_real = torch.arange(past_width, device=device)[None, :] >= (past_width - starts)[:, None]  # (N, Wp)
            attend = torch.cat((past_real[:, None, :] & real[:, :, None], attend), dim=-1)  # (N, T, Wp + T)
            past_layers = [_padded_pasts(pasts, index, past_width) for index in range(len(self._layers))]
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []

        def append(layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if past_layers:
                keys = torch.cat((past_layers[layer][0], keys), dim=2)
                values = torch.cat((past_layers[layer][1], values), dim=2)
            layers.append((keys, values))
            return keys, values

        end = int((lengths + starts).max())
        rows = adapter_rows(adapters, device)
        logits = self._forward(tokens, positions, end, attend[:, None], append, rows, keep)
        total = past_width + width
        caches: list[KvLayers] = []
        for row, (prompt, past_length) in enumerate(zip(prompts, past_lengths)):
            own = total - len(prompt)  # the row's first prompt column
            if past_length == 0:
                caches.append([(k[row : row + 1, :, own:], v[row : row + 1, :, own:]) for k, v in layers])
                continue
            first = past_width - past_length  # the row's first prefix column
            caches.append([
                (torch.cat((k[row : row + 1, :, first:past_width], k[row : row + 1, :, own:]), dim=2),
                 torch.cat((v[row : row + 1, :, first:past_width], v[row : row + 1, :, own:]), dim=2))
                for k, v in layers
            ])
        return logits, caches

    def _forward(
        self, tokens, positions, end: int, attend, append: Append, rows: AdapterRows, keep: int
    ) -> torch.Tensor:
        """`end`: one past the largest position in `positions` (known without reading them)."""
        call_threads.compute_on(self._weights, tokens.numel())
        if self._packs is not None and not self._packs.is_packed:
            self._pack(self._packs)
        hidden = F.embedding(tokens, self._embed)  # (B, T, E)
        # Additive once here: attention would turn a bool mask into one in every layer.
        attend = torch.zeros(attend.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(~attend, -math.inf)
        cos, sin = self._rope(hidden, positions, end)  # (B, T, D) each
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, T, 1, D): broadcast over heads
        for index, layer in enumerate(self._layers):
            x = _rms(layer.input_norm, hidden)
            hidden = hidden + self._attention(index, layer, x, attend, cos, sin, append, rows)
            hidden = hidden + _mlp(layer, _rms(layer.post_norm, hidden), rows)
        return _linear(self._lm_head, _rms(self._final_norm, hidden[:, -keep:]), rows)

    def _rope(self, hidden: torch.Tensor, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self._decoder.rotary_emb
        if not self._fixed_rope:
            return rotary(hidden, positions)
        table = self._rope_table
        if table is None or (table[0].dtype, table[0].device) != (hidden.dtype, hidden.device) or table[0].shape[0] < end:
            rows = max(end, 2 * table[0].shape[0] if table is not None else 256)  # doubling: rebuilt rarely
            table = self._rope_table = self._rope_rows(rows)
        cos, sin = table
        return cos[positions], sin[positions]

    def _rope_rows(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions 0 .. count-1, (count, D): what the rotary module's forward
        computes for them, once, rather than on every call."""
        rotary = self._decoder.rotary_emb
        positions = torch.arange(count, device=rotary.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype = self._decoder.embed_tokens.weight.dtype
        return (angles.cos() * rotary.attention_scaling).to(dtype), (angles.sin() * rotary.attention_scaling).to(dtype)

    def _attention(self, index, layer: _Layer, x, attend, cos, sin, append: Append, rows) -> torch.Tensor:
        b, t = x.shape[:2]
        q = _linear(layer.q, x, rows).view(b, t, self._heads, self._head_dim)
        k = _linear(layer.k, x, rows).view(b, t, self._kv_heads, self._head_dim)
        v = _linear(layer.v, x, rows).view(b, t, self._kv_heads, self._head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = _rms(layer.q_norm, q), _rms(layer.k_norm, k)
        # One rotation for the query and key heads together: fewer calls than two.
        q, k = _rotate(torch.cat((q, k), dim=2), cos, sin).split((self._heads, self._kv_heads), dim=2)
        keys, values = append(index, k.transpose(1, 2), v.transpose(1, 2))  # (B, heads, T, D)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=attend, scale=self._scaling,
            enable_gqa=self._heads != self._kv_heads,
        )  # (B, H, T, D)
        return _linear(layer.o, out.transpose(1, 2).reshape(b, t, self._heads * self._head_dim), rows)


def _padded_pasts(pasts: list[KvLayers | None], layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (keys, values) of every row's prefix, (N, heads, width, D), right-aligned with
    zeros in front (and all zeros for a row without one)."""
    shape_of = _keys_values(next(past for past in pasts if past is not None), layer)
    keys, values = [], []
    for past in pasts:
        if past is None:
            keys.append(shape_of[0].new_zeros(shape_of[0].shape[:2] + (width,) + shape_of[0].shape[3:]))
            values.append(shape_of[1].new_zeros(shape_of[1].shape[:2] + (width,) + shape_of[1].shape[3:]))
            continue
        past_keys, past_values = _keys_values(past, layer)
        missing = width - past_keys.shape[2]
        keys.append(F.pad(past_keys, (0, 0, missing, 0)))
        values.append(F.pad(past_values, (0, 0, missing, 0)))
    return torch.cat(keys), torch.cat(values)


def _keys_values(past: KvLayers, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cached prefix's (keys, values) at `layer`. A model `for_model` takes has attention in
    every layer, so its caches have no empty (shared-KV) layer."""
    entry = past[layer]
    if entry is None:
        raise ValueError(f"layer {layer} of the cached prefix holds nothing; the fused forward needs keys and values")
    return entry


def _mlp(layer: _Layer, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    return _linear(layer.down, F.silu(_linear(layer.gate, x, rows)) * _linear(layer.up, x, rows), rows)


def _layer(layer: torch.nn.Module, linear_of: Callable[[torch.nn.Module], _Linear]) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qk_norm = hasattr(attention, "q_norm")
    return _Layer(
        input_norm=_norm(layer.input_layernorm),
        q=linear_of(attention.q_proj), k=linear_of(attention.k_proj), v=linear_of(attention.v_proj),
        o=linear_of(attention.o_proj),
        q_norm=_norm(attention.q_norm) if qk_norm else None, k_norm=_norm(attention.k_norm) if qk_norm else None,
        post_norm=_norm(layer.post_attention_layernorm),
        gate=linear_of(mlp.gate_proj), up=linear_of(mlp.up_proj), down=linear_of(mlp.down_proj),
    )


def _linears(layer: _Layer) -> tuple[_Linear, ...]:
    return layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down


def _linear_of(module: torch.nn.Module, packs: packed_linear.PackedWeights | None) -> _Linear:
    lora = module if isinstance(module, peft.tuners.lora.Linear) else None
    base = module.base_layer if lora is not None else module
    packed = packs.get(base.weight) if packs is not None else None
    return _Linear(base.weight, base.bias, lora, packed)


def _norm(module: torch.nn.Module) -> _Norm:
    return _Norm(module.weight, module.variance_epsilon)


def adapter_rows(adapters: list[str], device: torch.device) -> AdapterRows:
    """Group row indices by adapter; one adapter for the whole batch needs no index."""
    first = adapters[0]
    if all(name == first for name in adapters):
        return [(first, None)]
    groups: dict[str, list[int]] = {}
    for row, name in enumerate(adapters):
        groups.setdefault(name, []).append(row)
    return [(name, torch.tensor(index, dtype=torch.int64, device=device)) for name, index in groups.items()]


def _linear(linear: _Linear, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    if linear.packed is None:
        out = F.linear(x, linear.weight, linear.bias)
    else:
        out = packed_linear.linear(x, linear.packed, linear.bias)
    if linear.lora is None:
        return out
    for adapter, index in rows:
        if adapter == BASE_ADAPTER:
            continue
        # Looked up once per adapter, not through peft's modules at each of the ~200 calls a step.
        lora = linear.adapters[adapter] if adapter in linear.adapters else _look_up(linear, adapter)
        if lora is None:
            continue
        a, b, scaling = lora
        h = x if index is None else x.index_select(0, index)
        if h.dtype != a.dtype:
            h = h.to(a.dtype)
        down = F.linear(h, a)  # (..., rank)
        if index is None and b.dtype == out.dtype:
            # out += scaling * B(A x) as one call: 211 of these a SmolLM2 decode step, 4.7 ms as four
            # calls against 3.3 ms as one (bench/packed_linear.py); rounding as peft's, to an ulp.
            out.view(-1, out.shape[-1]).addmm_(down.view(-1, down.shape[-1]), b.t(), alpha=scaling)
            continue
        delta = F.linear(down, b).mul_(scaling)  # peft's order: B(A x), then the scaling
        if delta.dtype != out.dtype:
            delta = delta.to(out.dtype)
        if index is None:
            out += delta
        else:
            out.index_add_(0, index, delta)
    return out


def _look_up(linear: _Linear, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    module = linear.lora
    assert module is not None
    found = None
    if adapter in module.lora_A:
        assert adapter not in module.lora_variant, f"adapter {adapter!r} is not plain LoRA"
        found = module.lora_A[adapter].weight, module.lora_B[adapter].weight, module.scaling[adapter]
    linear.adapters[adapter] = found
    return found


def _rms(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    if x.dtype == torch.float32 and x.device.type != "cpu":  # nothing to cast: one fused call
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    normed = _normalised(x.float(), norm.eps)
    if x.dtype == torch.float32:
        return normed * norm.weight
    return norm.weight * normed.to(x.dtype)


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension."""
    width = x.shape[-1]
    if x.device.type != "cpu":
        return F.rms_norm(x, (width,), eps=eps)
    # On the CPU, torch's rms_norm is a composite of ~8 kernels (17 us at decode sizes) and
    # layer_norm is one (5 us). [x, -x] has mean 0 and variance mean(x^2), so its layer norm's
    # first half is x / sqrt(mean(x^2) + eps), exactly RMSNorm (to ~1e-7): ~8% of a decode step.
    return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * width,), eps=eps)[..., :width]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
