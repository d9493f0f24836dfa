"""Autoresearch: the next grid of a sweep, proposed from its leaderboard by a fixed rule (no model).

The rule keeps the best region and refines around it:
1. The best job is the one with the highest final held-out accuracy; ties go
   to fewer tokens, then to the earlier job.
2. Its loss is kept. Candidates are its neighbours, one setting changed at a
   time, in this order: learning rate halved, learning rate doubled; LoRA
   rank doubled, rank halved; group size doubled, group size halved; the
   other reward variant.
3. A candidate already on the leaderboard, or outside the bounds (rank 4-64,
   group size 2-16), is skipped; the first `jobs` remaining make the grid.
   Everything else (other losses, far learning rates) is dropped.

So a sweep first moves the learning rate, the setting RL on a small model is
most sensitive to, and widens to the others only when those points are taken.
Pure functions of the leaderboard; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from recipes.sql.reward import REWARDS

RANK_BOUNDS = (4, 64)
GROUP_BOUNDS = (2, 16)


class GridPoint(msgspec.Struct, frozen=True):
    learning_rate: float
    lora_rank: int
    group_size: int
    loss: str
    reward: str


class Result(msgspec.Struct, frozen=True):
    point: GridPoint
    final_accuracy: float
    tokens: int


def best_result(results: Sequence[Result]) -> Result:
    """The highest final accuracy; ties to fewer tokens, then to the earlier result."""
    return min(enumerate(results), key=lambda ir: (-ir[1].final_accuracy, ir[1].tokens, ir[0]))[1]


def _neighbours(p: GridPoint) -> list[GridPoint]:
    other_rewards = [r for r in REWARDS if r != p.reward]
    return [
        msgspec.structs.replace(p, learning_rate=p.learning_rate / 2),
        msgspec.structs.replace(p, learning_rate=p.learning_rate * 2),
        msgspec.structs.replace(p, lora_rank=p.lora_rank * 2),
        msgspec.structs.replace(p, lora_rank=p.lora_rank // 2),
        msgspec.structs.replace(p, group_size=p.group_size * 2),
        msgspec.structs.replace(p, group_size=p.group_size // 2),
        *[msgspec.structs.replace(p, reward=r) for r in other_rewards],
    ]


def _in_bounds(p: GridPoint) -> bool:
    return RANK_BOUNDS[0] <= p.lora_rank <= RANK_BOUNDS[1] and GROUP_BOUNDS[0] <= p.group_size <= GROUP_BOUNDS[1]


def next_grid(results: Sequence[Result], jobs: int) -> list[GridPoint]:
    """Up to `jobs` new points around the best result (see the module docstring); [] when none is left."""
    best = best_result(results).point
    seen = {r.point for r in results}
    grid: list[GridPoint] = []
    for candidate in _neighbours(best):
        if candidate not in seen and _in_bounds(candidate) and candidate not in grid:
            grid.append(candidate)
    return grid[:jobs]
