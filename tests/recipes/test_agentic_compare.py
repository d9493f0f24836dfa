"""The paired tests between stages: exact McNemar on success (the SQL recipe's), an exact paired permutation
test on the rubric reward, and which evaluations the recipe compares."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from recipes.agentic.compare import compare, figures, paired_permutation_test
from recipes.agentic.train import EvalRecord, comparisons, episode_budget, resume_from


def test_the_permutation_p_value_counts_sign_assignments_as_extreme():
    # Differences +1, +1, +0.5: of the 8 sign assignments, totals of absolute value >= 2.5 are
    # (+1 +1 +0.5) and (-1 -1 -0.5): p = 2/8.
    result = paired_permutation_test([1.0, 1.0, 0.5], [0.0, 0.0, 0.0])
    assert (result.p_value, result.nonzero, result.mean_difference) == (0.25, 3, pytest.approx(2.5 / 3))


def test_ties_do_not_move_the_permutation_test():
    # Eight tasks up by 1/3 and two unchanged: only the eight count, p = 2 / 2^8.
    result = paired_permutation_test([2 / 3] * 8 + [1.0, 0.0], [1 / 3] * 8 + [1.0, 0.0])
    assert (result.p_value, result.nonzero) == (2 / 256, 8)


def test_no_difference_has_p_one():
    assert paired_permutation_test([0.5, 1.0], [0.5, 1.0]).p_value == 1.0


def test_a_comparison_uses_the_sql_recipe_s_mcnemar_and_calls_a_rise_real_below_alpha():
    before, after = [False] * 8, [True] * 7 + [False]
    result = compare("termination_date", "base", "warm_start", (before, after), ([0.5] * 8, [1.0] * 7 + [0.5]))
    assert (result.success.job_only, result.success.base_only, result.success.p_value) == (7, 0, 2 / 2**7)
    assert (result.reward.p_value, result.is_real) == (2 / 2**7, True)


def test_a_fall_is_never_real():
    result = compare("termination_date", "warm_start", "rl", ([True] * 8, [False] * 8), ([1.0] * 8, [0.5] * 8))
    assert (result.reward.p_value, result.is_real) == (2 / 2**8, False)


def test_figures_are_the_means_over_the_family_s_tasks():
    stage = figures("contract_terms", "rl", [True, False], [1.0, 0.5], [4, 2])
    assert (stage.success, stage.mean_reward, stage.mean_turns) == (0.5, 0.75, 3.0)


def test_episodes_pair_up_across_stages_so_each_task_s_kth_episode_is_one_pair():
    # Two tasks, two episodes each: the tests run over the four pairs, in order.
    before = EvalRecord(0, 0.25, [False, False, True, False], None, 0.0, stage="warm_start",
                        task_ids=["a", "a", "b", "b"], families=["contract_terms"] * 4, scores=[0.0, 0.0, 1.0, 0.5],
                        turns=[4, 4, 4, 4], episodes_per_task=2)
    after = msgspec.structs.replace(before, stage="rl", step=10, successes=[True, True, True, True],
                                    scores=[1.0, 1.0, 1.0, 1.0])
    [pair] = comparisons([before, after])
    assert (pair.episodes, pair.success.job_only, pair.success.base_only, pair.reward.nonzero) == (4, 3, 0, 3)
    assert pair.reward.p_value == 2 / 2**3


def test_the_loop_resumes_from_the_warm_start_s_state_at_step_zero(tmp_path: Path):
    from tinker_cookbook import checkpoint_utils

    resume_from(tmp_path / "cookbook", "tinker://s-1:train:0/weights/warm-start")
    resumed = checkpoint_utils.get_last_checkpoint(str(tmp_path / "cookbook"))
    assert resumed is not None
    assert (resumed.batch, resumed.state_path) == (0, "tinker://s-1:train:0/weights/warm-start")


def _eval(stage: str, step: int, successes: list[bool], scores: list[float]) -> EvalRecord:
    return EvalRecord(step, sum(successes) / 2, successes, None, 0.0, stage=stage, task_ids=["a", "b"],
                      families=["termination_date", "contract_terms"], scores=scores, turns=[3, 4])


def test_three_stages_give_each_against_the_one_before_and_the_last_against_the_first():
    evals = [_eval("base", 0, [False, False], [0.5, 0.0]), _eval("warm_start", 0, [True, False], [1.0, 0.5]),
             _eval("rl", 5, [True, False], [1.0, 0.5]), _eval("rl", 10, [True, True], [1.0, 1.0])]
    pairs = [(c.family, c.before, c.after) for c in comparisons(evals)]
    assert pairs == [
        ("termination_date", "base", "warm_start"), ("termination_date", "warm_start", "rl@10"),
        ("termination_date", "base", "rl@10"),
        ("contract_terms", "base", "warm_start"), ("contract_terms", "warm_start", "rl@10"),
        ("contract_terms", "base", "rl@10"),
        ("all", "base", "warm_start"), ("all", "warm_start", "rl@10"), ("all", "base", "rl@10"),
    ]


@pytest.mark.parametrize(("asked", "context", "budget"), [(2048, 1024, 1024), (2048, 8192, 2048), (2048, None, 2048)],
                         ids=["clamped", "room-to-spare", "context-not-reported"])
def test_the_episode_budget_is_clamped_to_the_model_s_context(asked: int, context: int | None, budget: int):
    assert episode_budget(asked, context) == budget


def test_the_report_gives_each_family_s_figures_at_each_stage_then_the_tests():
    from recipes.agentic.report import report

    lines = report([_eval("base", 0, [False, False], [0.5, 0.0]), _eval("warm_start", 0, [True, False], [1.0, 0.5])])
    assert lines[0:4] == [
        "family             stage       episodes  success  reward  turns",
        "termination_date   base               1    0.000   0.500   3.00",
        "termination_date   warm start         1    1.000   1.000   3.00",
        "contract_terms     base               1    0.000   0.000   4.00",
    ]
    assert lines[7] == ("termination_date: base -> warm_start on 1 episode pairs: success +1/-0 (exact McNemar p 1); "
                        "reward +0.500 (exact paired permutation p 1)")


def test_the_report_gives_the_judge_s_agreement_at_each_evaluation_and_over_them_all():
    from recipes.agentic.judge import Agreement
    from recipes.agentic.report import report

    base, warm = _eval("base", 0, [False, False], [0.5, 0.0]), _eval("warm_start", 0, [True, False], [1.0, 0.5])
    lines = report([msgspec.structs.replace(base, judge_counts=Agreement(2, 1, 1, 0)),
                    msgspec.structs.replace(warm, judge_counts=Agreement(2, 2, 1, 1))])
    assert lines[-3:] == [
        "judge at base: agrees on 1/2 (0.500); judge passed 1, exact passed 0",
        "judge at warm start: agrees on 2/2 (1.000); judge passed 1, exact passed 1",
        "judge at every evaluation: agrees on 3/4 (0.750); judge passed 2, exact passed 1",
    ]


def test_a_run_asked_for_no_held_out_episodes_is_refused_before_it_starts(capsys):
    from recipes.agentic.__main__ import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--held-out-episodes", "0"])
    assert refused.value.code == 2
    assert "argument --held-out-episodes: expected 1 or more, got 0" in capsys.readouterr().err


def test_the_defaults_train_with_ppo_at_3e_4_and_one_held_out_episode_a_task():
    from recipes.agentic.__main__ import parse_args

    config, _ = parse_args([])
    assert (config.loss_fn, config.learning_rate, config.held_out_episodes) == ("ppo", 3e-4, 1)


def test_an_out_dir_that_holds_an_earlier_run_is_refused_before_the_service_is_touched(tmp_path: Path, capsys):
    from recipes.agentic.__main__ import main

    (tmp_path / "cookbook").mkdir()
    (tmp_path / "cookbook" / "checkpoints.jsonl").write_text('{"name": "final", "batch": 10}\n')
    assert main(["--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert f"refused: {tmp_path} holds an earlier run; use a new --out" in capsys.readouterr().err
