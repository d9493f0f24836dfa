"""The SQL recipe end to end on the tiny model: a 2-step job, and a sweep of 2 jobs at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.sql.__main__ import main
from recipes.sql.leaderboard import read_csv
from recipes.sql.train import read_log

pytest.importorskip("matplotlib", reason="the sweep's PNG needs matplotlib (pip install -e '.[recipes]')")

TINY_JOB = ["--api-key", "tml-test", "--base-model", "tiny-llama", "--renderer", "role_colon", "--steps", "2",
            "--questions-per-step", "2", "--max-tokens", "4", "--eval-every", "1", "--families", "filter"]


def test_training_entry_runs_two_cookbook_steps_with_evals_before_between_and_after(
    shared_daemon, tiny_llama: Path, tmp_path: Path, capsys,
):
    argv = ["train", "--url", shared_daemon.url, "--tokenizer", str(tiny_llama), *TINY_JOB, "--group-size", "2",
            "--loss", "ppo", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = read_log(tmp_path / "log.jsonl")
    # the evaluator's records come as the cookbook loop calls it; its step metrics and the summary follow
    assert [(type(r).__name__, getattr(r, "step", None)) for r in records] == [
        ("EvalRecord", 0), ("EvalRecord", 1), ("EvalRecord", 2), ("StepRecord", 0), ("StepRecord", 1),
        ("DoneRecord", None)]
    evals, steps, done = records[:3], records[3:5], records[5]
    assert all(len(e.correct) == len(e.question_ids) == 32 for e in evals)  # ceil(127 filter questions x 0.25)
    assert all(0.0 <= s.mean_reward <= 1.0 for s in steps) and 0 < steps[0].tokens < steps[1].tokens
    assert done.steps == 2 and done.tokens == steps[1].tokens + evals[2].tokens
    assert (tmp_path / "cookbook" / "metrics.jsonl").exists()
    assert "done: heldout accuracy" in capsys.readouterr().out


def test_sweep_runs_two_jobs_at_once_then_an_autoresearch_round_and_writes_leaderboard_and_curves(
    shared_daemon, tiny_llama: Path, tmp_path: Path,
):
    argv = ["sweep", "--url", shared_daemon.url, "--tokenizer", str(tiny_llama), *TINY_JOB, "--lr", "1e-4,1e-3",
            "--group-size", "2", "--loss", "importance_sampling", "--jobs", "2", "--autoresearch", "--rounds", "2",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = read_csv(tmp_path / "leaderboard.csv")
    assert [(r.round, r.point.loss) for r in rows] == [(0, "importance_sampling")] * 2 + [(1, "importance_sampling")] * 2
    assert [r.point.learning_rate for r in rows[:2]] == [1e-4, 1e-3]
    # only the sweep's first job evaluates the base model (step 0)
    assert [sorted(r.accuracy_by_step) for r in rows] == [[0, 1, 2], [1, 2], [1, 2], [1, 2]]
    assert all(r.tokens > 0 for r in rows)
    markdown = (tmp_path / "leaderboard.md").read_text()
    assert "Exact McNemar test (two-sided)" in markdown and "Seeds: job 0, data 0." in markdown
    assert "It is the best of 4 jobs, picked after seeing their answers" in markdown
    assert (markdown.count("| r0-j"), markdown.count("| r1-j")) == (2, 2)
    assert (tmp_path / "heldout_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
