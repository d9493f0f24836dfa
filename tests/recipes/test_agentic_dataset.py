"""A training step's figures come from every episode of its batch, as the task dataset's builders graded them."""

from __future__ import annotations

from recipes.agentic.env import AgenticGroupBuilder, TaskDataset
from recipes.agentic.rubric import Check, Grade
from recipes.agentic.tasks import Family, Split, Task, make_tasks

PASS, HALF, FAIL = Grade([Check("a", True), Check("b", True)]), Grade([Check("a", True), Check("b", False)]), \
    Grade([Check("a", False), Check("b", False)])


def _graded_first_step(*grades: list[Grade | None]) -> TaskDataset:
    """A dataset of two groups a step whose first step's groups were graded `grades`."""
    def make_builder(task: Task) -> AgenticGroupBuilder:
        return AgenticGroupBuilder(task, None, None, group_size=2, max_turns=4, max_trajectory_tokens=2048,  # type: ignore[arg-type]
                                   max_generation_tokens=64)

    dataset = TaskDataset(make_tasks(0, Split.TRAIN, (Family.TERMINATION_DATE,), 4), make_builder, groups_per_batch=2)
    dataset.get_batch(0)
    for builder, graded in zip(dataset.batches[0], grades, strict=True):
        builder.grades = graded
    return dataset


def test_a_step_s_reward_and_success_cover_both_groups_even_one_the_loop_did_not_train_on():
    # The first group's rewards are all equal (the loop drops it), the second's mixed.
    dataset = _graded_first_step([PASS, PASS], [HALF, FAIL])
    assert (dataset.mean_reward(0), dataset.success_rate(0)) == (0.625, 0.5)


def test_an_ungraded_episode_counts_as_zero_and_a_step_never_asked_for_has_no_figures():
    dataset = _graded_first_step([PASS, None], [PASS, PASS])
    assert (dataset.mean_reward(0), dataset.success_rate(0)) == (0.75, 0.75)
    assert (dataset.mean_reward(1), dataset.success_rate(1)) == (0.0, 0.0)
