"""The prefix-aware routing policy of sampler replicas (actors/prefix_routing.py): pure, exact values.

Blocks are 16 tokens (the default) unless a test says otherwise; the load penalty is 16
tokens per request held and the load gap 8 requests.
"""

from __future__ import annotations

import numpy as np
import pytest

from openrld.actors.prefix_routing import PrefixRouter, RouteChoice, RouterStatistics, prefix_block_hashes


def tokens(start: int, count: int) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.int64)


def prompt(prefix: int, suffix: int, prefix_tokens: int = 32, suffix_tokens: int = 8) -> np.ndarray:
    """A family's shared prefix (`prefix` picks the family) and a short distinct suffix."""
    shared = tokens(1000 * prefix, prefix_tokens)
    return np.concatenate([shared, tokens(1000 * prefix + 500 + 10 * suffix, suffix_tokens)])


def blocks(p: np.ndarray, version: str | None = None) -> tuple[bytes, ...]:
    return prefix_block_hashes(version, p)


def test_only_full_blocks_are_hashed_and_each_hash_stands_for_its_whole_prefix():
    a = blocks(tokens(0, 40))  # 2 full blocks; the last 8 tokens are left out
    assert len(a) == 2
    assert blocks(tokens(0, 32)) == a  # the same 32 leading tokens, the same two hashes
    other = blocks(np.concatenate([tokens(0, 16), tokens(900, 16)]))
    assert other[0] == a[0] and other[1] != a[1]
    # Block 1 alike, block 0 not: the chain makes block 1's hash differ too.
    assert blocks(np.concatenate([tokens(900, 16), tokens(16, 16)]))[1] != a[1]
    assert blocks(tokens(0, 15)) == ()


def test_same_prefix_goes_to_the_replica_that_served_it():
    router = PrefixRouter(2)
    router.assign(1, blocks(prompt(7, 0)))
    # Replica 1 holds the request it took: 32 matched - 16 * 1 = 16 beats replica 0's 0 - 0 = 0.
    assert router.choose(blocks(prompt(7, 1)), loads=[0, 1], has_room=[True, True]) == RouteChoice(1, 32)


def test_an_episode_next_turn_goes_where_its_last_turn_went():
    router = PrefixRouter(2)
    last_turn = prompt(7, 0)  # 40 tokens: 2 full blocks
    router.assign(1, blocks(last_turn))
    next_turn = np.concatenate([last_turn, tokens(2000, 30)])  # the completion and the next message
    # 4 full blocks; the first 2 are the last turn's: 32 matched, - 16 for the one request held.
    assert router.choose(blocks(next_turn), loads=[0, 1], has_room=[True, True]) == RouteChoice(1, 32)


def test_a_prompt_that_matches_nowhere_goes_to_the_least_loaded_then_the_lowest_index():
    router = PrefixRouter(3)
    router.assign(0, blocks(prompt(7, 0)))
    assert router.choose(blocks(prompt(8, 0)), loads=[2, 1, 1], has_room=[True] * 3) == RouteChoice(1, 0)


def test_a_prompt_shorter_than_a_block_is_routed_by_load_alone():
    router = PrefixRouter(2)
    short = blocks(tokens(0, 15))
    router.assign(0, short)
    assert router.choose(short, loads=[1, 0], has_room=[True, True]) == RouteChoice(1, 0)


@pytest.mark.parametrize(
    ("busy_load", "expected"),
    [
        (3, RouteChoice(0, 64)),  # 64 - 16 * 3 = 16 > 0: the prefix wins
        (4, RouteChoice(1, 0)),  # 64 - 16 * 4 = 0 = 0: a tie, and the idle replica wins it
    ],
    ids=["prefix-wins-below-the-threshold", "idle-replica-wins-at-the-threshold"],
)
def test_load_penalty_sends_to_the_idle_replica_past_a_threshold(busy_load: int, expected: RouteChoice):
    router = PrefixRouter(2)
    router.assign(0, blocks(prompt(7, 0, prefix_tokens=64)))
    request = blocks(prompt(7, 1, prefix_tokens=64))
    assert router.choose(request, loads=[busy_load, 0], has_room=[True, True]) == expected


@pytest.mark.parametrize(
    ("busy_load", "expected"),
    [(8, RouteChoice(0, 1024)), (9, RouteChoice(1, 0))],
    ids=["gap-of-8-still-chosen", "gap-of-9-never-chosen"],
)
def test_a_replica_past_the_load_gap_is_never_chosen_however_long_its_match(busy_load: int, expected: RouteChoice):
    router = PrefixRouter(2)
    long_prompt = prompt(7, 0, prefix_tokens=1024)  # 1024 - 16 * 9 would still win on score
    router.assign(0, blocks(long_prompt))
    assert router.choose(blocks(long_prompt), loads=[busy_load, 0], has_room=[True, True]) == expected


def test_a_replica_without_room_is_never_chosen_and_none_when_no_replica_has_room():
    router = PrefixRouter(2)
    router.assign(0, blocks(prompt(7, 0)))
    assert router.choose(blocks(prompt(7, 1)), loads=[0, 5], has_room=[False, True]) == RouteChoice(1, 0)
    assert router.choose(blocks(prompt(7, 1)), loads=[0, 5], has_room=[False, False]) is None


def test_version_is_part_of_every_block_key():
    p = prompt(7, 0)
    assert not set(blocks(p, "v1")) & set(blocks(p, "v2"))
    assert not set(blocks(p, None)) & set(blocks(p, "v1"))
    router = PrefixRouter(2)
    router.assign(0, blocks(p, "v1"))
    assert router.matched_tokens(0, blocks(p, "v1")) == 32
    assert router.matched_tokens(0, blocks(p, "v2")) == 0
    # So a request of the new version goes by load: replica 1, the less loaded.
    assert router.choose(blocks(p, "v2"), loads=[1, 0], has_room=[True, True]) == RouteChoice(1, 0)


def test_lru_record_is_bounded_and_evicts_a_prefix_tail_first():
    router = PrefixRouter(1, max_blocks=4)
    first = blocks(tokens(0, 48))  # 3 blocks: f0 f1 f2
    router.assign(0, first)
    router.assign(0, blocks(tokens(5000, 32)))  # 2 more: 5 > 4, one goes
    # f0 was touched last of `first`, so the tail f2 went: `first` still matches its 2 leading blocks.
    assert router.statistics().recorded_blocks == (4,)
    assert router.matched_tokens(0, first) == 32
    router.assign(0, blocks(tokens(9000, 64)))  # 4 new blocks fill the record alone
    assert router.statistics().recorded_blocks == (4,)
    assert router.matched_tokens(0, first) == 0


def test_forget_empties_one_replica_record():
    router = PrefixRouter(2)
    p = blocks(prompt(7, 0))
    router.assign(0, p)
    router.assign(1, p)
    router.forget(0)
    assert (router.matched_tokens(0, p), router.matched_tokens(1, p)) == (0, 32)


def test_an_added_replica_starts_empty_and_is_chosen_by_load():
    router = PrefixRouter(1)
    router.assign(0, blocks(prompt(7, 0)))
    assert router.add_replica() == 1
    assert router.choose(blocks(prompt(8, 0)), loads=[1, 0], has_room=[True, True]) == RouteChoice(1, 0)


def test_statistics_count_routes_by_prefix_and_by_load():
    router = PrefixRouter(2)
    assert router.assign(0, blocks(prompt(7, 0))) == 0  # nothing held yet: by load
    assert router.assign(0, blocks(prompt(7, 1))) == 32  # the family's 2 prefix blocks: by prefix
    assert router.assign(1, blocks(prompt(7, 2))) == 0
    # prompt(7, s) is 40 tokens: 2 full blocks, both the shared prefix's.
    assert router.statistics() == RouterStatistics(
        routed_by_prefix=1, routed_by_load=2, routed_prefix_tokens=32, recorded_blocks=(2, 2)
    )
