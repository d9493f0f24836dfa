"""The exact McNemar test, against values worked by hand."""

from __future__ import annotations

from recipes.sql.stats import McNemar, bonferroni, mcnemar_exact


def test_five_wins_and_no_losses_is_p_one_sixteenth():
    # n = 5 discordant, all for the job: 2 * P[X <= 0] = 2 / 32
    assert mcnemar_exact([1, 1, 1, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 1]) == McNemar(5, 0, 0.0625)


def test_eight_wins_one_loss_is_p_twenty_over_512():
    # n = 9: 2 * (C(9,0) + C(9,1)) / 2^9 = 2 * 10 / 512
    job = [1] * 8 + [0]
    base = [0] * 8 + [1]
    assert mcnemar_exact(job, base) == McNemar(8, 1, 20 / 512)


def test_equal_discordance_or_none_is_p_one():
    assert mcnemar_exact([1, 0], [0, 1]) == McNemar(1, 1, 1.0)
    assert mcnemar_exact([1, 0], [1, 0]) == McNemar(0, 0, 1.0)


def test_bonferroni_multiplies_the_p_value_by_the_jobs_compared():
    assert bonferroni(0.01, 4) == 0.04


def test_bonferroni_never_exceeds_one():
    assert bonferroni(0.3, 4) == 1.0
