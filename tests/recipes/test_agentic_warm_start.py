"""The warm start's data: the expert's episodes through the recipe's Env in bubblewrap, as cross-entropy datums.

Each datum is the conversation the policy sees (the tiny Llama's tokenizer, the
recipe's renderer with its tool-call prefill), with weight 1 on exactly the
tokens of the assistant's replies and 0 on the rest.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tinker
from transformers import AutoTokenizer

from recipes.agentic.env import TOOL_CALL_PREFILL, AgenticGroupBuilder, ToolCallPrefill
from recipes.agentic.sandbox import BwrapSandbox, bwrap_works
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.agentic.warm_start import demonstrations
from recipes.chat_formats import renderer_for

pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here "
                                                          "(apt-get install bubblewrap)")
FAMILIES = [Family.TERMINATION_DATE, Family.CONTRACT_TERMS]


@pytest.fixture(scope="module")
def renderer(tiny_llama: Path) -> ToolCallPrefill:
    return ToolCallPrefill(renderer_for(AutoTokenizer.from_pretrained(tiny_llama)))


@pytest.fixture(scope="module")
def two_demonstrations(renderer: ToolCallPrefill) -> list[tinker.Datum]:
    def make_builder(task: Task, group_size: int) -> AgenticGroupBuilder:
        # The tiny tokenizer spells most characters as a token: ~1,500 tokens an episode, 80 a reply.
        return AgenticGroupBuilder(task, renderer, BwrapSandbox, group_size=group_size, max_turns=4,
                                   max_trajectory_tokens=4096, max_generation_tokens=160)

    return asyncio.run(demonstrations(make_tasks(0, Split.TRAIN, FAMILIES, 2), make_builder))


def _weighted_text(renderer: ToolCallPrefill, datum: tinker.Datum, weight: float) -> str:
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().tolist()
    weights = datum.loss_fn_inputs["weights"].to_torch().tolist()
    return renderer.tokenizer.decode([t for t, w in zip(targets, weights) if w == weight])


def test_each_solved_episode_is_one_datum_of_the_whole_conversation(two_demonstrations, renderer):
    assert len(two_demonstrations) == 2
    first = two_demonstrations[0]
    text = renderer.tokenizer.decode(first.model_input.to_ints())
    assert text.startswith("<|im_start|>system\nYou are a legal assistant")
    assert "terminates on 2027-07-22" in text  # the tool's answer, read in the sandbox
    assert first.model_input.length == len(first.loss_fn_inputs["weights"].to_torch())


def test_the_weights_are_one_on_the_replies_exactly(two_demonstrations, renderer):
    # Each reply is what the model writes after the prefill, up to the call's closing tag.
    assert _weighted_text(renderer, two_demonstrations[0], 1.0) == (
        'read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>'
        'write_file", "arguments": {"path": "answer.txt", "content": "2027-07-22"}}\n</tool_call>'
        'finish", "arguments": {}}\n</tool_call>'
    )
    assert _weighted_text(renderer, two_demonstrations[1], 1.0).startswith(
        'list_files", "arguments": {}}\n</tool_call>read_file", "arguments": {"path": "contracts/agreement.txt"}}')


def test_the_prompt_prefill_and_tool_answers_weigh_zero(two_demonstrations, renderer):
    unweighted = _weighted_text(renderer, two_demonstrations[0], 0.0)
    # Three in the examples of the system prompt and the instruction, then one before each of the three replies.
    assert unweighted.count(TOOL_CALL_PREFILL) == 6
    assert unweighted.endswith(f"<|im_start|>assistant\n{TOOL_CALL_PREFILL}")
    assert "<tool_response>\nwrote 10 bytes to /scratch/answer.txt\n</tool_response>" in unweighted
    assert {float(w) for d in two_demonstrations for w in d.loss_fn_inputs["weights"].to_torch()} == {0.0, 1.0}


def test_a_held_out_task_is_never_demonstrated(renderer):
    held_out = make_tasks(0, Split.HELD_OUT, FAMILIES, 1)
    with pytest.raises(ValueError, match="train tasks only, got held_out/termination_date/0"):
        asyncio.run(demonstrations(held_out, lambda task, size: pytest.fail("no episode may start")))
