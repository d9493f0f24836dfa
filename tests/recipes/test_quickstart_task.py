"""The quickstart's reward and advantages: exact values for each kind of reply."""

from __future__ import annotations

import random

import pytest

from recipes.quickstart import task

PROBLEM = task.Problem(9, 8)  # answer 17


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("17", 1.0),
        ("  17\n", 1.0),
        ("9 + 8 = 17", 1.0),
        ("The answer is 17.", 0.2),
        ("9 + 8 equals 17", 0.2),
        ("170", 0.0),
        ("1 7", 0.0),
        ("9 + 8 = 16", 0.0),
        ("", 0.0),
        (" 15 16 17 18", 0.0),
    ],
    ids=["bare", "whitespace", "equation", "sentence", "equation-with-words", "longer-number",
         "split-digits", "wrong", "empty", "a-list-holding-the-sum"],
)
def test_reward(reply: str, expected: float):
    assert task.reward(PROBLEM, reply) == expected


def test_the_question_asks_for_the_bare_number():
    assert PROBLEM.question == "What is 9 + 8? Reply with only the number."


def test_advantages_are_rewards_minus_the_group_mean():
    # mean of [1.0, 0.2, 0.0, 0.2] is 0.35
    assert task.group_advantages([1.0, 0.2, 0.0, 0.2]) == pytest.approx([0.65, -0.15, -0.35, -0.15], abs=1e-12)


def test_problems_are_single_digit_and_reproducible_from_the_seed():
    problems = task.make_problems(random.Random(7), 50)
    assert problems == task.make_problems(random.Random(7), 50)
    assert all(1 <= p.a <= 9 and 1 <= p.b <= 9 for p in problems)
