"""The agentic tools in a bubblewrap sandbox, and a scripted episode through the cookbook Env.

The episode test drives the Env with hand-written replies in the renderer's
tool-call format (the tiny tokenizer), so the path from tokens to tool to rubric
reward is checked without a model.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from tinker_cookbook.renderers.base import ToolCall
from tinker_cookbook.tool_use import ToolInput
from tinker_cookbook.tool_use.tools import handle_tool_call

from openrld.gpu.tiny_models import build_tokenizer
from recipes.agentic.env import AgenticGroupBuilder
from recipes.agentic.sandbox import BwrapSandbox, bwrap_works
from recipes.agentic.tasks import Family, Split, make_task
from recipes.agentic.tools import WorkspaceTools, read_deliverable
from recipes.chat_formats import renderer_for

pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here "
                                                          "(apt-get install bubblewrap)")
CONTRACT = "AGREEMENT\nMade between A and B.\n1. Term. This agreement terminates on 2027-07-22.\n2. Notice: 30 days.\n"


@pytest.fixture
def tools():
    sandbox = BwrapSandbox({"contract.txt": CONTRACT, "minutes/board.txt": "Renewal on 2030-07-06.\n"})
    yield WorkspaceTools(sandbox)
    sandbox.close()


def _call(tool, **arguments) -> str:
    result = asyncio.run(tool.run(ToolInput(arguments=arguments)))
    [message] = result.messages
    return message["content"]


def test_list_files_shows_the_documents_then_what_was_written(tools):
    assert _call(tools.list_files) == "contract.txt\nminutes/board.txt\n"
    _call(tools.write_file, path="answer.txt", content="x")
    assert _call(tools.list_files) == "contract.txt\nminutes/board.txt\n/scratch/answer.txt\n"


def test_read_file_whole_and_a_line_range(tools):
    assert _call(tools.read_file, path="contract.txt") == CONTRACT
    assert _call(tools.read_file, path="contract.txt", start_line=3, end_line=3) == (
        "1. Term. This agreement terminates on 2027-07-22.\n")


def test_search_gives_file_line_and_text_or_no_matches(tools):
    assert _call(tools.search, text="terminates") == "contract.txt:3:1. Term. This agreement terminates on 2027-07-22.\n"
    assert _call(tools.search, text="indemnity") == "no matches"
    assert _call(tools.search, text="Renewal", path="minutes") == "minutes/board.txt:1:Renewal on 2030-07-06.\n"


def test_write_file_puts_the_deliverable_in_scratch(tools):
    assert _call(tools.write_file, path="answer.txt", content="2027-07-22") == "wrote 10 bytes to /scratch/answer.txt"
    assert read_deliverable(tools.sandbox, "answer.txt") == "2027-07-22"


def test_a_deliverable_never_written_reads_as_none(tools):
    assert read_deliverable(tools.sandbox, "answer.txt") is None


def test_reading_outside_the_workspace_is_an_error_message(tools):
    assert _call(tools.read_file, path="/etc/hostname") == "error: sed: can't read /etc/hostname: No such file or directory"


def test_writing_over_a_document_is_an_error_message(tools):
    assert _call(tools.write_file, path="/workspace/contract.txt", content="forged") == (
        "error: sh: 1: cannot create /workspace/contract.txt: Read-only file system")
    assert _call(tools.read_file, path="contract.txt") == CONTRACT


def test_finish_stops_the_episode(tools):
    result = asyncio.run(tools.finish.run(ToolInput(arguments={})))
    assert (result.should_stop, tools.finished) == (True, True)


def test_an_unknown_tool_and_bad_arguments_come_back_as_errors_not_exceptions(tools):
    by_name = {t.name: t for t in tools.all()}
    unknown = asyncio.run(handle_tool_call(by_name, ToolCall(function=ToolCall.FunctionBody(name="rm", arguments="{}"))))
    assert json.loads(unknown.messages[0]["content"]) == {"error": "Tool 'rm' not found"}
    missing = asyncio.run(handle_tool_call(by_name, ToolCall(function=ToolCall.FunctionBody(name="read_file", arguments="{}"))))
    assert json.loads(missing.messages[0]["content"])["error"].startswith("Parameter validation failed")


def test_a_scripted_episode_recovers_from_a_malformed_call_and_earns_full_reward():
    tokenizer = build_tokenizer()
    renderer = renderer_for(tokenizer)
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    builder = AgenticGroupBuilder(task, renderer, BwrapSandbox, group_size=1, max_turns=5,
                                  max_trajectory_tokens=100_000, max_generation_tokens=100)
    replies = [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"</tool_call>',  # JSON cut short
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>',
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "2027-07-22"}}\n</tool_call>',
        '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>',
    ]

    async def play():
        [env] = await builder.make_envs()
        await env.initial_observation()
        results = [await env.step(tokenizer.encode(r + "<|im_end|>", add_special_tokens=False)) for r in replies]
        await builder.cleanup()
        return results

    malformed, read, write, finish = asyncio.run(play())
    assert (malformed.episode_done, malformed.metrics) == (False, {"parse_error": 1.0})
    assert "Error: Invalid JSON" in tokenizer.decode(malformed.next_observation.to_ints())
    assert "terminates on 2027-07-22." in tokenizer.decode(read.next_observation.to_ints())
    assert [r.episode_done for r in (read, write)] == [False, False]
    assert (finish.episode_done, finish.reward, finish.metrics["success"]) == (True, 1.0, 1.0)
    assert [g.success for g in builder.grades] == [True]
    assert builder.sandboxes == []  # cleaned up


def test_an_episode_cut_at_its_token_budget_is_still_graded_by_what_it_wrote():
    tokenizer = build_tokenizer()
    renderer = renderer_for(tokenizer)
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    builder = AgenticGroupBuilder(task, renderer, BwrapSandbox, group_size=1, max_turns=5,
                                  max_trajectory_tokens=100_000, max_generation_tokens=100)
    write = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "2027-07-22"}}\n</tool_call>'

    async def play():
        [env] = await builder.make_envs()
        await env.initial_observation()
        await env.step(tokenizer.encode(write + "<|im_end|>", add_special_tokens=False))
        cut = await env.step(tokenizer.encode("I will now", add_special_tokens=False), extra={"stop_reason": "length"})
        graded_before = list(builder.grades)
        group_rewards = await builder.compute_group_rewards([], [env])
        await builder.cleanup()
        return cut, graded_before, group_rewards

    cut, graded_before, group_rewards = asyncio.run(play())
    assert (cut.episode_done, cut.reward, graded_before) == (True, 0.0, [None])
    assert group_rewards == [(1.0, {"success": 1.0, "score": 1.0})]
