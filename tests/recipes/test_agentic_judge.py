"""The LLM judge's parts that need no model: its prompt, reading its verdict, agreement with the exact checks."""

from __future__ import annotations

from recipes.agentic.judge import agreement, judge_prompt, parse_verdict
from recipes.agentic.tasks import Family, Split, make_task


def test_the_prompt_holds_instruction_documents_and_deliverable():
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    prompt = judge_prompt(task, "2027-07-22")
    assert task.instruction in prompt
    assert "--- contract.txt\n" + task.documents["contract.txt"] in prompt
    assert "The file answer.txt it wrote:\n2027-07-22\n" in prompt
    assert prompt.endswith("Answer with one word: PASS or FAIL.")


def test_a_missing_deliverable_is_said_so_in_the_prompt():
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    assert "(the file was never written)" in judge_prompt(task, None)


def test_the_first_pass_or_fail_word_is_the_verdict():
    assert [parse_verdict(r) for r in ("PASS", "fail.", "It is a PASS", "Pass. Not FAIL", "maybe", "")] == [
        True, False, True, True, None, None]


def test_agreement_counts_matches_and_unparsed_replies_as_disagreements():
    result = agreement([True, False, None, True], [True, True, False, False])
    assert (result.episodes, result.agreed, result.judge_passed, result.exact_passed, result.unparsed) == (4, 1, 2, 2, 1)
    assert result.rate == 0.25
