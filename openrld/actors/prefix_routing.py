"""Which sampler replica serves a request: the one most likely to hold its prompt's prefix, weighed against load.

Each replica's engine keeps a prefix KV cache of its own (keyed by weight
version), so a request is cheap on the replica that already prefilled its
prompt's prefix: the other samples of a GRPO group, the next turn of a
multi-turn episode, prompts that share a long system prompt. `PrefixRouter`
guesses which replica holds what, without asking the engines: it remembers,
per replica, the block hashes of the prompts it routed there.

Block hashes are chained, as in vLLM's prefix caching: a prompt is cut into
blocks of `block_tokens` tokens (a last, partial block is left out), and block
i's hash covers block i's tokens and block i-1's hash, the first block's the
weight version. So one hash stands for the whole prefix up to its block, and a
prompt's match on a replica is its longest run of leading blocks found there.

Choosing: a replica's score is the tokens it matches minus `load_penalty_tokens`
for each request it holds; the highest score wins, ties going to the less
loaded replica, then the lower index. A replica holding `max_load_gap` more
requests than the least loaded one is never chosen, however long its match,
so an idle replica takes work when the preferred one is much busier. A prompt
shorter than one block matches nowhere, and is routed by load alone.

Records: each replica's record is an LRU of at most `max_blocks` hashes. A
routed prompt's blocks are touched last block first, so that its first block is
the most recently used, and eviction takes a prefix's tail before its head (a
chain whose head is gone can never match again). The record is a guess: the
engine's cache may have evicted more (`forget` clears a replica whose engine
dropped its cache: parked or rebuilt).

Pure: no trio, no I/O, no engine; the sampler actor (actors/sampler.py) asks it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np

BLOCK_TOKENS = 16  # tokens per hashed block (vLLM's default block size)
# Per replica: 4096 blocks of 16 tokens remember 64K prompt tokens, more than a small
# engine's cache holds and few enough to cost ~0.5 MB of hashes.
MAX_BLOCKS_PER_REPLICA = 4096
# A request a replica already holds costs as much as prefilling this many prompt tokens
# again: a 64-token shared prefix keeps its family on a replica while it holds fewer than 4
# requests more than an idle one (64 - 16 * 4 = 0 ties, and the less loaded wins ties).
LOAD_PENALTY_TOKENS = 16
# A replica holding more than this many requests beyond the least loaded one takes none,
# whatever it matches (longer prefixes stick up to here): a GRPO group of 8 requests of one
# prompt, arriving on an even load, still lands on one replica.
MAX_LOAD_GAP = 8

_DIGEST_BYTES = 16


class RouteChoice(msgspec.Struct, frozen=True):
    replica: int  # index of the chosen replica
    matched_tokens: int  # the prompt tokens its record holds (a multiple of the block size)


class RouterStatistics(msgspec.Struct, frozen=True):
    routed_by_prefix: int  # requests whose replica held at least one block of their prompt
    routed_by_load: int  # the others: no replica held any of it, or the one that did was too busy
    routed_prefix_tokens: int  # prompt tokens the chosen replicas' records held, summed
    recorded_blocks: tuple[int, ...]  # per replica, the block hashes its record holds


def prefix_block_hashes(version: str | None, prompt: np.ndarray, block_tokens: int = BLOCK_TOKENS) -> tuple[bytes, ...]:
    """The chained hashes of `prompt`'s full blocks under weight `version` (None: the base model).

    hash_0 = H(version tag, block_0), hash_i = H(hash_{i-1}, block_i), H = BLAKE2b-128 over
    the block's tokens as little-endian int64.
    """
    tag = b"\x00" if version is None else b"\x01" + version.encode()
    previous = hashlib.blake2b(tag, digest_size=_DIGEST_BYTES).digest()
    tokens = np.ascontiguousarray(prompt, dtype="<i8")
    hashes = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens].tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=_DIGEST_BYTES).digest()
        hashes.append(previous)
    return tuple(hashes)


class PrefixRouter:
    """Per replica, an LRU record of the prefix blocks routed there; picks a replica per request. Sync, no I/O."""

    def __init__(
        self,
        replicas: int,
        *,
        block_tokens: int = BLOCK_TOKENS,
        max_blocks: int = MAX_BLOCKS_PER_REPLICA,
        load_penalty_tokens: int = LOAD_PENALTY_TOKENS,
        max_load_gap: int = MAX_LOAD_GAP,
    ) -> None:
        assert block_tokens >= 1 and max_blocks >= 1, f"block_tokens={block_tokens} max_blocks={max_blocks}"
        self.block_tokens = block_tokens
        self._max_blocks = max_blocks
        self._load_penalty_tokens = load_penalty_tokens
        self._max_load_gap = max_load_gap
        self._records: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self._by_prefix = 0
        self._by_load = 0
        self._prefix_tokens = 0

    def add_replica(self) -> int:
        """Start the record of a new replica (empty); returns its index."""
        self._records.append(OrderedDict())
        return len(self._records) - 1

    def forget(self, replica: int) -> None:
        """The replica's engine dropped its prefix cache: its record starts empty."""
        self._records[replica].clear()

    def matched_tokens(self, replica: int, blocks: Sequence[bytes]) -> int:
        """Prompt tokens of the longest run of `blocks`' leading blocks held in `replica`'s record."""
        record = self._records[replica]
        matched = 0
        for block in blocks:
            if block not in record:
                break
            matched += 1
        return matched * self.block_tokens

    def choose(self, blocks: Sequence[bytes], loads: Sequence[int], has_room: Sequence[bool]) -> RouteChoice | None:
        """The replica a request of prompt `blocks` should go to; None when no replica has room.

        Args:
            blocks: the prompt's `prefix_block_hashes`.
            loads: per replica, the requests it holds now (running, or taken and being admitted).
            has_room: per replica, whether it can take one more request.
        """
        assert len(loads) == len(has_room) == len(self._records), (len(loads), len(has_room), len(self._records))
        open_loads = [load for load, room in zip(loads, has_room) if room]
        if not open_loads:
            return None
        ceiling = min(open_loads) + self._max_load_gap
        best: tuple[int, int, int] | None = None  # (score, -load, -index): the largest wins
        choice: RouteChoice | None = None
        for replica, (load, room) in enumerate(zip(loads, has_room)):
            if not room or load > ceiling:
                continue
            matched = self.matched_tokens(replica, blocks)
            rank = (matched - self._load_penalty_tokens * load, -load, -replica)
            if best is None or rank > best:
                best, choice = rank, RouteChoice(replica, matched)
        return choice

    def assign(self, replica: int, blocks: Sequence[bytes]) -> int:
        """Record that `replica` now serves a prompt of `blocks`; returns the tokens its record held before."""
        matched = self.matched_tokens(replica, blocks)
        if matched:
            self._by_prefix += 1
            self._prefix_tokens += matched
        else:
            self._by_load += 1
        record = self._records[replica]
        for block in reversed(blocks):  # the first block ends most recently used: tails are evicted first
            record[block] = None
            record.move_to_end(block)
        while len(record) > self._max_blocks:
            record.popitem(last=False)
        return matched

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            routed_by_prefix=self._by_prefix,
            routed_by_load=self._by_load,
            routed_prefix_tokens=self._prefix_tokens,
            recorded_blocks=tuple(len(record) for record in self._records),
        )
