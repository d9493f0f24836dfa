"""The LLM judge's parts that need no model: its prompt, its forced choice between PASS and FAIL, and agreement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tinker import types
from tinker_cookbook.renderers import Renderer
from tinker_cookbook.renderers.base import Message
from transformers import AutoTokenizer

from recipes.agentic.judge import agreement, judge_one, judge_prompt, reply_tokens
from recipes.agentic.tasks import Family, Split, make_task
from recipes.chat_formats import renderer_for


@pytest.fixture(scope="module")
def renderer(tiny_llama: Path) -> Renderer:
    return renderer_for(AutoTokenizer.from_pretrained(tiny_llama))


class ScriptedScorer:
    """A sampler whose `compute_logprobs` gives the reply `word` the log-probability `logprob[word]` (on its last
    token, 0 on the others), and records its calls."""

    def __init__(self, renderer: Renderer, logprob: dict[str, float]):
        self.by_reply = {tuple(reply_tokens(renderer, word)): lp for word, lp in logprob.items()}
        self.calls: list[tuple[list[int], int | None]] = []

    async def compute_logprobs(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None):
        tokens = prompt.to_ints()
        self.calls.append((tokens, prompt_logprobs_last_n))
        [(reply, lp)] = [(r, lp) for r, lp in self.by_reply.items() if tuple(tokens[-len(r):]) == r]
        return [None] * (len(tokens) - len(reply)) + [0.0] * (len(reply) - 1) + [lp]


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


def test_a_reply_is_the_word_then_the_end_of_the_turn(renderer: Renderer):
    end = renderer.get_stop_sequences()[0]
    assert reply_tokens(renderer, "PASS") == [*renderer.tokenizer.encode("PASS", add_special_tokens=False), end]
    assert renderer.tokenizer.decode(reply_tokens(renderer, "FAIL")) == "FAIL<|im_end|>"


@pytest.mark.parametrize(("pass_lp", "fail_lp", "verdict"), [(-0.5, -0.6, True), (-0.6, -0.5, False),
                                                             (-0.5, -0.5, False)])
def test_the_verdict_is_the_likelier_reply_and_a_tie_fails(renderer: Renderer, pass_lp, fail_lp, verdict):
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    scorer = ScriptedScorer(renderer, {"PASS": pass_lp, "FAIL": fail_lp})
    assert asyncio.run(judge_one(scorer, renderer, task, "2027-07-22")) is verdict


def test_each_reply_is_scored_after_the_generation_prompt_and_only_its_tokens(renderer: Renderer):
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    scorer = ScriptedScorer(renderer, {"PASS": -1.0, "FAIL": -2.0})
    asyncio.run(judge_one(scorer, renderer, task, None))
    prompt = renderer.build_generation_prompt([Message(role="user", content=judge_prompt(task, None))]).to_ints()
    assert scorer.calls == [([*prompt, *reply_tokens(renderer, word)], len(reply_tokens(renderer, word)))
                            for word in ("PASS", "FAIL")]


def test_agreement_counts_the_verdicts_that_match_the_exact_checks():
    result = agreement([True, False, False, True], [True, True, False, False])
    assert (result.episodes, result.agreed, result.judge_passed, result.exact_passed) == (4, 2, 2, 2)
    assert result.rate == 0.5
