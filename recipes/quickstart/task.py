"""The quickstart's task: single-digit addition, answered without words.

Each problem asks "What is A + B? Reply with only the number." for A, B in
1..9. The reward is verifiable and needs no model: 1.0 when the reply ends
its numbers with the sum and holds no letters ("17", or "9 + 8 = 17"); 0.2
when the sum ends them among words ("The answer is 17."); 0.0 otherwise. The
sum must be the last number, not any: a base model (Gemma 3 270M) learned
within 10 steps to list numbers (" 5 6 7 9 6") when any one of them scored.
SmolLM2-135M-Instruct (Q4_1) at temperature 1 is chatty: measured here on 48
replies, about a third held the sum, nearly all of them among words, and none
was bare. So rewards start low but differ within a group, and group-relative
advantages push towards the terse, numbers-only replies the prompt asks for.

Pure functions and data; no I/O, no SDK.
"""

from __future__ import annotations

import random
import re

import msgspec

EXACT_REWARD = 1.0  # the sum, and no words
FORMAT_MISS_REWARD = 0.2  # the sum, among words
INSTRUCTION = "Reply with only the number."


class Problem(msgspec.Struct, frozen=True):
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}? {INSTRUCTION}"


def make_problems(rng: random.Random, n: int) -> list[Problem]:
    return [Problem(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(n)]


def reward(problem: Problem, reply: str) -> float:
    """1.0 for the sum without words, 0.2 for the sum among words, else 0.0; the sum is the last number."""
    # Whole digit runs, so that "123" does not count as holding "12".
    numbers = re.findall(r"\d+", reply)
    if not numbers or numbers[-1] != str(problem.answer):
        return 0.0
    return FORMAT_MISS_REWARD if re.search(r"[A-Za-z]", reply) else EXACT_REWARD


def group_advantages(rewards: list[float]) -> list[float]:
    """Each sample's reward minus its group's mean (GRPO without the std division, as rl_loop does)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]
