"""The agentic episodes' renderer: every reply begins as a tool call and ends with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tinker_cookbook.renderers.base import Message
from transformers import AutoTokenizer

from recipes.agentic.env import TOOL_CALL_PREFILL, ToolCallPrefill
from recipes.chat_formats import renderer_for


@pytest.fixture(scope="module")
def prefilled(tiny_llama: Path) -> ToolCallPrefill:
    return ToolCallPrefill(renderer_for(AutoTokenizer.from_pretrained(tiny_llama)))


def _encode(renderer: ToolCallPrefill, text: str) -> list[int]:
    return renderer.tokenizer.encode(text, add_special_tokens=False)


def test_the_generation_prompt_ends_with_the_prefill(prefilled: ToolCallPrefill):
    prompt = prefilled.build_generation_prompt([Message(role="user", content="Read contract.txt.")])
    assert prompt.to_ints()[-len(prefilled.prefill_tokens):] == _encode(prefilled, TOOL_CALL_PREFILL)


def test_sampling_stops_at_the_closing_tag_or_the_end_of_message(prefilled: ToolCallPrefill):
    assert prefilled.get_stop_sequences() == ["</tool_call>", "<|im_end|>"]


def test_a_reply_stopped_by_the_closing_tag_parses_as_the_call_with_the_prefilled_name_start(
    prefilled: ToolCallPrefill,
):
    sampled = _encode(prefilled, 'read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>')
    message, termination = prefilled.parse_response(sampled)
    assert termination.is_clean
    [call] = message["tool_calls"]
    assert (call.function.name, json.loads(call.function.arguments)) == ("read_file", {"path": "contract.txt"})


def test_a_reply_cut_by_the_token_budget_is_not_a_clean_message(prefilled: ToolCallPrefill):
    sampled = _encode(prefilled, 'read_file", "arguments": {"path": "contr')
    _message, termination = prefilled.parse_response(sampled)
    assert not termination.is_clean


def test_a_judge_prompt_built_for_another_role_gets_no_prefill(prefilled: ToolCallPrefill):
    messages = [Message(role="user", content="Grade this.")]
    assert prefilled.build_generation_prompt(messages, "user").to_ints() == \
        prefilled.renderer.build_generation_prompt(messages, "user").to_ints()
