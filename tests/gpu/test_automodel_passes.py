"""How the Automodel trainer's passes size a round and choose whether it checkpoints
(gpu/automodel_passes.py `round_tokens`, `rounds_over_budget`): every rank computes the same
answer from the same plan, so all of a round's ranks checkpoint their layers or none do. The
groups that run it are in test_automodel_trainer.py and test_automodel_cp.py; this is the
arithmetic alone, with no group.
"""

from __future__ import annotations

from openrld.gpu.automodel_passes import round_tokens, rounds_over_budget


def test_a_round_is_as_large_as_its_largest_micro_batch_on_any_rank():
    # dp = 2. Round 0: rank 0 runs datum 0 (20 tokens), rank 1 datums 1 and 2 right-padded to
    # 2 x 6 = 12: the round is 20 on both. Round 1: rank 0 runs datum 3 (7), rank 1 the empty pass.
    assert round_tokens([[0], [1, 2], [3]], [20, 6, 5, 7], dp_size=2, cp=1) == [20, 7]


def test_a_rank_whose_own_micro_batch_is_within_the_budget_checkpoints_with_its_round():
    # 64 bytes a token, a budget of 1,000 bytes. Round 0: rank 1's own 12 padded tokens would keep
    # 768 bytes and run plain, but rank 0's 20 keep 1,280, so the round checkpoints, rank 1 with it.
    # Round 1: 7 x 64 = 448 bytes, plain.
    rounds = round_tokens([[0], [1, 2], [3]], [20, 6, 5, 7], dp_size=2, cp=1)
    assert rounds_over_budget(rounds, 64.0, 1000) == [True, False]
    assert rounds_over_budget([12], 64.0, 1000) == [False]


def test_a_round_exactly_at_the_budget_runs_plain():
    # 16 x 64 = 1,024 bytes: at the budget, not over it; 17 x 64 = 1,088 is over.
    assert rounds_over_budget([16, 17], 64.0, 1024) == [False, True]


def test_a_packed_micro_batch_counts_its_share_on_each_cp_rank():
    # cp = 2, dp = 1: a pack of 41 tokens is 21 on each rank (rounded up), one of 6 + 9 = 15 is 8.
    assert round_tokens([[0], [1, 2]], [41, 6, 9], dp_size=1, cp=2) == [21, 8]


def test_two_cp_groups_take_the_larger_pack_of_their_round():
    # dp = 2 x cp = 2: round 0's packs hold 41 and 15 tokens, 21 and 8 a rank: the round is 21.
    assert round_tokens([[0], [1, 2]], [41, 6, 9], dp_size=2, cp=2) == [21]
