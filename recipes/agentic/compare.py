"""Held-out figures per family at each stage, and paired tests between two stages.

Each held-out evaluation runs the same number of episodes of each task, in task
order; two stages (the base model, after the warm start, after RL) ran the same
tasks, so their episodes pair up: a task's k-th episode at one stage against its
k-th at the other. Under "no difference" the two episodes of a pair are two draws
from one policy, so each pair's outcomes are exchangeable, and pairs are independent:
both tests below hold over pairs of episodes as over pairs of tasks, with more power.
- Success (every rubric check passed) is compared with the exact two-sided McNemar
  test, the SQL recipe's (`recipes.sql.stats.mcnemar_exact`).
- The rubric reward (the fraction of checks passed) is compared with an exact
  two-sided paired permutation test: under "no difference" each task's two rewards
  are exchangeable, so each paired difference's sign is +/- with probability 1/2;
  the p-value is the share of the 2^n sign assignments whose total difference is
  at least as far from 0 as the one observed. Rewards are fractions of a few
  checks, so the totals, summed as exact fractions, take few values and the null
  distribution is counted exactly, one task at a time (no sampling, no seed).
A difference is called real at p < `ALPHA`. Pure functions; no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import msgspec

from recipes.sql.stats import McNemar, mcnemar_exact

ALPHA = 0.05
# A reward is a share of a few checks (k/2, k/3): as a fraction with at most this denominator it is exact.
_MAX_DENOMINATOR = 1000


class StageFigures(msgspec.Struct, frozen=True):
    family: str
    stage: str  # "base", "warm_start" or "rl"
    episodes: int  # held-out episodes: tasks x episodes per task
    success: float  # share of episodes that passed every check
    mean_reward: float  # mean rubric score
    mean_turns: float  # model replies per episode


class PairedReward(msgspec.Struct, frozen=True):
    mean_difference: float  # mean over pairs of (after - before)
    p_value: float  # exact two-sided paired permutation (sign-flip) test
    nonzero: int  # pairs whose two rewards differ (the rest do not move the test)


class Comparison(msgspec.Struct, frozen=True, tag="comparison"):
    family: str
    before: str  # stage
    after: str  # stage
    episodes: int  # pairs of held-out episodes compared
    success: McNemar  # job_only: pairs solved after and not before; base_only: the other way
    reward: PairedReward
    is_real: bool  # reward.p_value < ALPHA and the mean reward rose


def paired_permutation_test(after: list[float], before: list[float]) -> PairedReward:
    """The exact two-sided sign-flip test of the mean paired difference `after - before`."""
    assert len(after) == len(before), f"{len(after)} rewards against {len(before)}"
    exact = [Fraction(a).limit_denominator(_MAX_DENOMINATOR) - Fraction(b).limit_denominator(_MAX_DENOMINATOR)
             for a, b in zip(after, before)]
    nonzero = [d for d in exact if d != 0]
    observed = abs(sum(exact, Fraction(0)))
    counts: dict[Fraction, int] = {Fraction(0): 1}  # total -> sign assignments reaching it
    for d in nonzero:
        grown: dict[Fraction, int] = defaultdict(int)
        for total, ways in counts.items():
            grown[total + d] += ways
            grown[total - d] += ways
        counts = grown
    extreme = sum(ways for total, ways in counts.items() if abs(total) >= observed)
    mean = float(sum(exact, Fraction(0)) / len(exact)) if exact else 0.0
    return PairedReward(mean, extreme / 2 ** len(nonzero), len(nonzero))


def compare(family: str, before: str, after: str, successes: tuple[list[bool], list[bool]],
            rewards: tuple[list[float], list[float]]) -> Comparison:
    """Stage `after` against stage `before` on the same episodes of the same tasks, in the same order: (before's,
    after's) each."""
    success_before, success_after = successes
    reward_before, reward_after = rewards
    mcnemar = mcnemar_exact([int(s) for s in success_after], [int(s) for s in success_before])
    reward = paired_permutation_test(reward_after, reward_before)
    return Comparison(family, before, after, len(reward_after), mcnemar, reward,
                      reward.p_value < ALPHA and reward.mean_difference > 0)


def figures(family: str, stage: str, successes: list[bool], rewards: list[float], turns: list[int]) -> StageFigures:
    n = len(successes)
    assert n == len(rewards) == len(turns) and n > 0, (n, len(rewards), len(turns))
    return StageFigures(family, stage, n, sum(successes) / n, sum(rewards) / n, sum(turns) / n)
