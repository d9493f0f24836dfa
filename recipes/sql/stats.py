"""The sweep's statistics: an exact McNemar test of two models' answers to the same held-out questions.

Both models answer the same questions, so their results are paired; what
tells them apart is only the discordant pairs: `b` questions the job got right
and the base got wrong, `c` the other way. Under "no difference" each
discordant pair goes either way with probability 1/2, so the two-sided exact
p-value is the binomial tail: min(1, 2 * P[X <= min(b, c)]) for
X ~ Binomial(b + c, 1/2).

The job compared is the best of the sweep's K, picked after seeing the
answers, so its own p-value overstates the evidence; `bonferroni` multiplies
it by K, which bounds the chance that any of the K would look this good by
luck. Pure functions; no I/O.
"""

from __future__ import annotations

from math import comb

import msgspec


class McNemar(msgspec.Struct, frozen=True):
    job_only: int  # b: questions the job answered right and the base wrong
    base_only: int  # c: questions the base answered right and the job wrong
    p_value: float  # two-sided, exact


def mcnemar_exact(job_correct: list[int], base_correct: list[int]) -> McNemar:
    """The exact two-sided McNemar test of two 0/1 vectors over the same questions, in the same order."""
    assert len(job_correct) == len(base_correct), f"{len(job_correct)} answers against {len(base_correct)}"
    b = sum(1 for j, r in zip(job_correct, base_correct) if j and not r)
    c = sum(1 for j, r in zip(job_correct, base_correct) if r and not j)
    n = b + c
    if n == 0:
        return McNemar(b, c, 1.0)
    tail = sum(comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return McNemar(b, c, min(1.0, 2 * tail))


def bonferroni(p_value: float, comparisons: int) -> float:
    """`p_value` adjusted for being the best of `comparisons` tests: min(1, K * p)."""
    assert comparisons >= 1, f"comparisons: expected >= 1, got {comparisons}"
    return min(1.0, p_value * comparisons)
