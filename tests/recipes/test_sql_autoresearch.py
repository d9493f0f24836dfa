"""The autoresearch rule on hand-written leaderboards: the exact next grid."""

from __future__ import annotations

from pathlib import Path

from recipes.sql.autoresearch import GridPoint, Result, best_result, next_grid
from recipes.sql.leaderboard import JobRow, read_csv, write_csv

IS, PPO = "importance_sampling", "ppo"


def _row(job: str, point: GridPoint, final: float, tokens: int, round_: int = 0) -> JobRow:
    return JobRow(round=round_, job=job, point=point, seed=0, accuracy_by_step={0: 0.2, 8: final}, tokens=tokens,
                  wall_s=100.0)


LEADERBOARD = [
    _row("a", GridPoint(2e-4, 16, 4, IS, "execution"), 0.244, 9000),
    _row("b", GridPoint(8e-4, 16, 4, IS, "execution"), 0.317, 9100),
    _row("c", GridPoint(2e-4, 16, 4, PPO, "execution"), 0.268, 9050),
    _row("d", GridPoint(8e-4, 16, 4, PPO, "execution"), 0.293, 9200),
]


def test_next_grid_halves_and_doubles_the_best_lr_then_moves_rank_keeping_its_loss(tmp_path: Path):
    rows = read_csv(write_csv(LEADERBOARD, tmp_path / "leaderboard.csv"))
    grid = next_grid([r.result() for r in rows], jobs=4)
    assert grid == [
        GridPoint(4e-4, 16, 4, IS, "execution"),
        GridPoint(1.6e-3, 16, 4, IS, "execution"),
        GridPoint(8e-4, 32, 4, IS, "execution"),
        GridPoint(8e-4, 8, 4, IS, "execution"),
    ]


def test_points_already_run_are_skipped_and_the_round_after_continues_around_the_new_best():
    second_round = [
        _row("e", GridPoint(4e-4, 16, 4, IS, "execution"), 0.341, 9000, round_=1),
        _row("f", GridPoint(1.6e-3, 16, 4, IS, "execution"), 0.195, 9000, round_=1),
        _row("g", GridPoint(8e-4, 32, 4, IS, "execution"), 0.300, 9000, round_=1),
        _row("h", GridPoint(8e-4, 8, 4, IS, "execution"), 0.280, 9000, round_=1),
    ]
    grid = next_grid([r.result() for r in LEADERBOARD + second_round], jobs=4)
    # best is e (lr 4e-4, IS): its lr halved is a's point and doubled is b's, both run, so rank and group move
    assert grid == [
        GridPoint(4e-4, 32, 4, IS, "execution"),
        GridPoint(4e-4, 8, 4, IS, "execution"),
        GridPoint(4e-4, 16, 8, IS, "execution"),
        GridPoint(4e-4, 16, 2, IS, "execution"),
    ]


def test_a_tie_goes_to_fewer_tokens_then_to_the_earlier_job():
    p, q = GridPoint(1e-4, 16, 4, IS, "execution"), GridPoint(2e-4, 16, 4, IS, "execution")
    assert best_result([Result(p, 0.5, 100), Result(q, 0.5, 90)]).point == q
    assert best_result([Result(p, 0.5, 100), Result(q, 0.5, 100)]).point == p


def test_bounds_drop_rank_and_group_size_neighbours_outside_them():
    edge = GridPoint(1e-4, 64, 2, PPO, "partial")
    assert next_grid([Result(edge, 0.5, 1)], jobs=10) == [
        GridPoint(5e-5, 64, 2, PPO, "partial"),
        GridPoint(2e-4, 64, 2, PPO, "partial"),
        GridPoint(1e-4, 32, 2, PPO, "partial"),
        GridPoint(1e-4, 64, 4, PPO, "partial"),
        GridPoint(1e-4, 64, 2, PPO, "execution"),
    ]
