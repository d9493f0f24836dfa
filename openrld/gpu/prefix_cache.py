"""Prompt prefixes' KV, kept across requests: a block-hashed, byte-bounded LRU cache.

What it owns: the keys and values of token prefixes already run through the
model, in blocks of `block_tokens` positions, under a caller's key (the weight
version: the same tokens give other KV under other weights). A block is named
by a hash chained over the blocks before it (vLLM's scheme: a block's name
says its whole prefix), so prompts that share a prefix share its blocks, one
copy each, whoever computed them: the prompts of one RL group, prompts behind
one system or few-shot text, and a multi-turn episode whose next prompt extends
the last prompt and its completion.

Guarantees:
- `match` answers the longest prefix of whole blocks it holds, and never a
  block whose tokens or whose chain differ from the query's (the hash only
  finds a block; the tokens and the parent are compared before it is used).
- Bounded: the blocks' bytes stay within `budget_bytes`; least recently used
  blocks go first. A use touches a chain from its last block to its first, so
  a block is never older than a block after it in a chain: eviction takes a
  chain's tail before its head, and no cached block is ever unreachable.
- `drop(key)` frees every block of one key (a dropped weight version) and
  `clear()` all of them (a park, a change of the base weights, close).
- `resize(budget)` moves the bound at run time (the node's host-memory budget
  shared among its samplers: actors/host_memory.py), evicting at once down to
  it, and never past the bound it was built with (0 there: off for good).

Why it is written here: prefix caching exists inside serving engines (vLLM's
block pool, SGLang's radix tree), tied to their own paged KV layouts and
schedulers. Nothing offers it over a Hugging Face `DynamicCache` or our
left-padded `kv_batch.KvBatch`, which hold each row's KV as plain contiguous
(B, H, L, D) tensors; so this module keeps plain per-block tensors and hands
back plain tensors, and knows nothing else of the sampler. Layers may differ in
shape (Gemma 4's global layers have wider heads than its sliding ones), and a
layer that caches nothing (shared KV) is None in and out.

It never imports trio, holds no request, and is not thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

import msgspec
import torch

from openrld.gpu.kv_batch import KvLayers

DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size: small enough that a shared prefix loses < 16 tokens


class PrefixCacheStatistics(msgspec.Struct, frozen=True):
    lookups: int  # `match` calls
    hits: int  # lookups that reused at least one block
    hit_tokens: int  # positions served from the cache, over all lookups
    bytes_held: int  # bytes of the blocks held now
    blocks_held: int
    evictions: int  # blocks dropped to stay within the budget (drops and clears not counted)
    budget_bytes: int  # 0: caching is off


@dataclasses.dataclass(slots=True, eq=False)
class _Block:
    key: Hashable  # the caller's key (weight version) of the chain
    parent: _Block | None  # the block before it in its chain; None for a chain's first block
    tokens: tuple[int, ...]  # the block_tokens token ids it holds the KV of
    keys: tuple[torch.Tensor | None, ...]  # per layer (H, block_tokens, D); None: the layer caches nothing
    values: tuple[torch.Tensor | None, ...]  # per layer (H, block_tokens, Dv)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values if t is not None)


class PrefixCache:
    """KV of token prefixes, per key, in whole blocks.

    Args:
        budget_bytes: the most the blocks may hold; 0 turns caching off (nothing is kept,
            `match` answers 0).
        block_tokens: positions per block; prefixes are matched in whole blocks.
    """

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        assert budget_bytes >= 0 and block_tokens >= 1, f"budget {budget_bytes}, block {block_tokens}"
        self.budget_bytes = budget_bytes
        self.ceiling_bytes = budget_bytes  # what `resize` may raise the budget back to
        self.block_tokens = block_tokens
        self._blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # oldest use first
        self._by_key: dict[Hashable, set[int]] = {}
        self._bytes = 0
        self._lookups = 0
        self._hits = 0
        self._hit_tokens = 0
        self._evictions = 0

    @property
    def is_enabled(self) -> bool:
        return self.budget_bytes > 0

    def chain(self, key: Hashable, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """The chained hashes of the whole blocks of `tokens[:limit]` (`limit` None: all)."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        block, hashes = self.block_tokens, []
        name = hash(("prefix", key))
        for start in range(0, end - end % block, block):
            name = hash((name, tuple(tokens[start : start + block])))
            hashes.append(name)
        return hashes

    def match(self, key: Hashable, tokens: Sequence[int], limit: int) -> tuple[int, KvLayers | None]:
        """The longest cached prefix of `tokens[:limit]`, in whole blocks, and its KV.

        Returns:
            (positions reused, per layer (keys, values) of shape (1, H, positions, D), fresh
            tensors the caller may keep), or (0, None) when no block matches.
        """
        if not self.is_enabled:
            return 0, None
        self._lookups += 1
        found = self._walk(key, tokens, self.chain(key, tokens, limit))
        if not found:
            return 0, None
        self._touch([name for name, _ in found])
        positions = len(found) * self.block_tokens
        self._hits += 1
        self._hit_tokens += positions
        layers: KvLayers = []
        for i, held in enumerate(found[0][1].keys):
            if held is None:
                layers.append(None)
                continue
            keys = torch.cat([b.keys[i] for _, b in found], dim=1)[None]  # (1, H, positions, D)
            values = torch.cat([b.values[i] for _, b in found], dim=1)[None]
            layers.append((keys, values))
        return positions, layers

    def cached_tokens(self, key: Hashable, tokens: Sequence[int], limit: int) -> int:
        """How many positions `match` would reuse now, without using them or counting a lookup."""
        if not self.is_enabled:
            return 0
        return len(self._walk(key, tokens, self.chain(key, tokens, limit))) * self.block_tokens

    def insert(self, key: Hashable, tokens: Sequence[int], layers: KvLayers) -> int:
        """Keep the KV of the whole blocks of `tokens` (those already held are only touched).

        Args:
            tokens: the token ids at positions 0 .. len-1.
            layers: per layer (keys, values), (1, H, L, D) with L >= len(tokens): position p's
                KV at column p. Read only; blocks are copied out of them.

        Returns:
            How many blocks were new.
        """
        if not self.is_enabled:
            return 0
        hashes = self.chain(key, tokens)
        if not hashes:
            return 0
        per_block = self._block_bytes(layers)
        # A chain longer than the budget keeps its head, as much as fits.
        hashes = hashes[: self.budget_bytes // per_block]
        chain: list[int] = []
        parent, added = None, 0
        for index, name in enumerate(hashes):
            start = index * self.block_tokens
            block_tokens = tuple(tokens[start : start + self.block_tokens])
            block = self._blocks.get(name)
            if block is None or block.parent is not parent or block.tokens != block_tokens or block.key != key:
                if block is not None:  # a hash collision: the newer chain takes the name
                    self._remove(name)
                block = self._new_block(key, parent, block_tokens, layers, start)
                self._blocks[name] = block
                self._by_key.setdefault(key, set()).add(name)
                self._bytes += block.nbytes
                added += 1
            chain.append(name)
            parent = block
        self._touch(chain)
        self._evict_to_budget()
        return added

    def resize(self, budget_bytes: int) -> int:
        """Hold at most `budget_bytes` (capped at the ceiling) from now on, least recently used
        blocks out first; 0 turns caching off until a larger resize. The bytes held after."""
        assert budget_bytes >= 0, f"budget {budget_bytes}"
        self.budget_bytes = min(budget_bytes, self.ceiling_bytes)
        self._evict_to_budget()
        return self._bytes

    def drop(self, key: Hashable) -> int:
        """Free every block of `key`; the bytes freed."""
        freed = 0
        for name in list(self._by_key.get(key, ())):
            freed += self._remove(name)
        return freed

    def clear(self) -> int:
        """Free every block; the bytes freed."""
        freed = self._bytes
        self._blocks.clear()
        self._by_key.clear()
        self._bytes = 0
        return freed

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            lookups=self._lookups, hits=self._hits, hit_tokens=self._hit_tokens, bytes_held=self._bytes,
            blocks_held=len(self._blocks), evictions=self._evictions, budget_bytes=self.budget_bytes,
        )

    # -- internals ----------------------------------------------------------

    def _walk(self, key: Hashable, tokens: Sequence[int], hashes: list[int]) -> list[tuple[int, _Block]]:
        """The held blocks (name, block) that match `hashes` from the first on, checked token by token."""
        found: list[tuple[int, _Block]] = []
        parent = None
        for index, name in enumerate(hashes):
            block = self._blocks.get(name)
            start = index * self.block_tokens
            if block is None or block.parent is not parent or block.key != key:
                break
            if block.tokens != tuple(tokens[start : start + self.block_tokens]):
                break
            found.append((name, block))
            parent = block
        return found

    def _touch(self, names: list[int]) -> None:
        # Last block first: a chain's head ends up the most recent, so eviction takes tails first.
        for name in reversed(names):
            if name in self._blocks:
                self._blocks.move_to_end(name)

    def _evict_to_budget(self) -> None:
        while self._bytes > self.budget_bytes and self._blocks:
            name = next(iter(self._blocks))
            self._remove(name)
            self._evictions += 1

    def _remove(self, name: int) -> int:
        block = self._blocks.pop(name)
        names = self._by_key.get(block.key)
        if names is not None:
            names.discard(name)
            if not names:
                del self._by_key[block.key]
        self._bytes -= block.nbytes
        return block.nbytes

    def _new_block(
        self, key: Hashable, parent: _Block | None, tokens: tuple[int, ...], layers: KvLayers, start: int
    ) -> _Block:
        end = start + self.block_tokens
        # One copy per block (never a view of the caller's tensors, whose storage it would keep).
        keys = tuple(None if kv is None else kv[0][0, :, start:end].clone() for kv in layers)  # (H, block, D)
        values = tuple(None if kv is None else kv[1][0, :, start:end].clone() for kv in layers)
        return _Block(key=key, parent=parent, tokens=tokens, keys=keys, values=values)

    def _block_bytes(self, layers: KvLayers) -> int:
        per_position = sum(
            t.shape[1] * t.shape[3] * t.element_size() for kv in layers if kv is not None for t in kv
        )
        return max(1, per_position * self.block_tokens)
