"""The agentic recipe's code path, end to end on the tiny model in bubblewrap: two steps, the JSONL log, the PNG."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from recipes.agentic.__main__ import main
from recipes.agentic.compare import Comparison
from recipes.agentic.sandbox import bwrap_works
from recipes.agentic.train import EvalRecord, LogRecord, RunRecord, StepRecord

pytest.importorskip("matplotlib", reason="the recipe's PNG needs matplotlib (pip install -e '.[recipes]')")
pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here "
                                                          "(apt-get install bubblewrap)")


def test_two_steps_through_the_cookbook_loop_write_run_eval_and_step_records_and_a_png(
    shared_daemon, tiny_llama: Path, tmp_path: Path, capsys,
):
    argv = [
        "--url", shared_daemon.url, "--api-key", "tml-test", "--base-model", "tiny-llama",
        "--tokenizer", str(tiny_llama), "--steps", "2", "--groups-per-step", "2", "--group-size", "2",
        "--held-out-tasks", "2", "--held-out-episodes", "2", "--max-turns", "2", "--max-generation-tokens", "8", "--sandbox", "bwrap",
        "--judge-model", "tiny-llama",
        "--out", str(tmp_path),
    ]
    assert main(argv) == 0
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    records = [msgspec.json.decode(line, type=LogRecord) for line in lines]
    run, *rest = records
    # The tiny Llama has 1024 positions, under the default budget of 2048: before the budget was clamped to
    # them, an episode whose second prompt outgrew 1024 tokens (its replies are random) got a 400.
    assert run == RunRecord("bwrap", "tiny-llama", ["termination_date"], max_trajectory_tokens=1024, max_context=1024)
    evals = [r for r in rest if isinstance(r, EvalRecord)]
    steps = [r for r in rest if isinstance(r, StepRecord)]
    # Evaluated before the first step and after the last (eval_every 5 > 2 steps): 2 episodes of each of the
    # 2 held-out tasks, in task order, so that the two evaluations' episodes pair up.
    assert [r.step for r in evals] == [0, 2]
    assert all(r.task_ids == ["held_out/termination_date/0"] * 2 + ["held_out/termination_date/1"] * 2 for r in evals)
    assert all(len(r.successes) == len(r.scores) == len(r.turns) == 4 for r in evals)
    assert all(r.held_out_success == sum(r.successes) / 4 for r in evals)
    assert all(r.judge_agreement in (0.0, 0.25, 0.5, 0.75, 1.0) for r in evals)
    assert [c.episodes for c in rest if isinstance(c, Comparison)] == [4]
    assert [r.step for r in steps] == [0, 1]
    assert all(0.0 <= r.mean_reward <= 1.0 and 0.0 <= r.success_rate <= 1.0 for r in steps)
    assert (tmp_path / "held_out_success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "done: 2 steps" in capsys.readouterr().out

