"""The recipes' chat formats: Gemma 3's turns on the real Gemma 3 tokenizer, ChatML for SmolLM2's.

Gemma 3's chat template writes `<bos>`, then `<start_of_turn>user` with the system
prompt and a blank line before the first user message, `model` for the assistant's
turns, and `<end_of_turn>` and a newline after every turn; the renderer must write
those tokens exactly, stop on `<end_of_turn>`, and train on the replies alone.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import tinker
from gemma3_support import gemma3_conversion  # noqa: F401  (a fixture)
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.renderers.base import Message, ParseTermination, ToolCall
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from recipes.agentic.env import AgenticGroupBuilder, ToolCallPrefill
from recipes.agentic.sandbox import BwrapSandbox, bwrap_works
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.agentic.warm_start import demonstrations
from recipes.chat_formats import Gemma3Renderer, UnknownChatFormat, renderer_for

CALL = ToolCall(function=ToolCall.FunctionBody(name="read_file", arguments=json.dumps({"path": "contract.txt"})))
CONVERSATION = [
    Message(role="system", content="You are a legal assistant."),
    Message(role="user", content="Write the termination date."),
    Message(role="assistant", content="", tool_calls=[CALL]),
    Message(role="tool", content="This Agreement terminates on 2027-07-22.", tool_call_id="0"),
]
TEMPLATE_TEXT = (  # what Gemma 3's chat template writes for CONVERSATION, with the generation prompt
    "<bos><start_of_turn>user\nYou are a legal assistant.\n\nWrite the termination date.<end_of_turn>\n"
    '<start_of_turn>model\n<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n'
    "</tool_call><end_of_turn>\n"
    "<start_of_turn>user\n<tool_response>\nThis Agreement terminates on 2027-07-22.\n</tool_response><end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def gemma3_tokenizer(gemma3_conversion: Path):  # noqa: F811
    return AutoTokenizer.from_pretrained(gemma3_conversion)


@pytest.fixture(scope="module")
def gemma3(gemma3_tokenizer) -> Gemma3Renderer:
    renderer = renderer_for(gemma3_tokenizer)
    assert isinstance(renderer, Gemma3Renderer)
    return renderer


def test_gemma3s_tokenizer_gets_gemma3s_turns_and_smollm2s_gets_chatml(gemma3, tiny_llama: Path):
    chatml = renderer_for(AutoTokenizer.from_pretrained(tiny_llama))
    assert type(chatml).__name__ == "Qwen3InstructRenderer"
    assert type(gemma3).__name__ == "Gemma3Renderer"


def test_gemma3_is_a_cookbook_renderer_by_name(gemma3_tokenizer):
    assert isinstance(get_renderer("gemma3", gemma3_tokenizer), Gemma3Renderer)


def test_a_tokenizer_of_neither_format_is_refused():
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(UnknownChatFormat, match="neither Gemma's <start_of_turn>/<end_of_turn> nor ChatML's"):
        renderer_for(plain)


def test_the_generation_prompt_is_gemma3s_template_token_for_token(gemma3, gemma3_tokenizer):
    prompt = gemma3.build_generation_prompt(CONVERSATION).to_ints()
    assert gemma3_tokenizer.decode(prompt) == TEMPLATE_TEXT
    assert prompt == [gemma3_tokenizer.bos_token_id, *gemma3_tokenizer.encode(TEMPLATE_TEXT[len("<bos>"):],
                                                                              add_special_tokens=False)]


def test_sampling_stops_on_end_of_turn_and_the_reply_parses_to_its_call(gemma3, gemma3_tokenizer):
    end_of_turn = gemma3_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    reply = gemma3_tokenizer.encode('<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>',
                                    add_special_tokens=False)
    message, termination = gemma3.parse_response([*reply, end_of_turn])
    assert gemma3.get_stop_sequences() == [end_of_turn]
    assert termination is ParseTermination.STOP_SEQUENCE
    assert [(c.function.name, c.function.arguments) for c in message["tool_calls"]] == [("finish", "{}")]


def test_a_reply_without_end_of_turn_is_malformed(gemma3, gemma3_tokenizer):
    _, termination = gemma3.parse_response(gemma3_tokenizer.encode("<tool_call>\n{", add_special_tokens=False))
    assert termination is ParseTermination.MALFORMED


def test_a_supervised_example_trains_on_the_reply_and_its_end_of_turn_only(gemma3, gemma3_tokenizer):
    model_input, weights = gemma3.build_supervised_example(CONVERSATION[:3])
    tokens = model_input.to_ints()
    trained = gemma3_tokenizer.decode([t for t, w in zip(tokens, weights.tolist()) if w == 1.0])
    assert trained == '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n</tool_call><end_of_turn>'


def test_each_turns_prompt_extends_the_last(gemma3):
    first = gemma3.build_generation_prompt(CONVERSATION[:2]).to_ints()
    [with_reply, _] = gemma3.build_supervised_example(CONVERSATION[:3])
    second = gemma3.build_generation_prompt(CONVERSATION).to_ints()
    assert gemma3.has_extension_property
    assert with_reply.to_ints()[:len(first)] == first
    assert second[:with_reply.length] == with_reply.to_ints()


def test_a_system_prompt_after_the_first_message_is_refused(gemma3):
    late = [Message(role="user", content="hi"), Message(role="system", content="be brief")]
    with pytest.raises(ValueError, match="a system prompt only as a conversation's first message"):
        gemma3.build_generation_prompt(late)


@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here")
def test_the_experts_episode_in_gemma3s_turns_is_one_datum_trained_on_its_replies(gemma3, gemma3_tokenizer):
    renderer = ToolCallPrefill(gemma3)

    def make_builder(task: Task, group_size: int) -> AgenticGroupBuilder:
        return AgenticGroupBuilder(task, renderer, BwrapSandbox, group_size=group_size, max_turns=4,
                                   max_trajectory_tokens=2048, max_generation_tokens=64)

    [datum] = asyncio.run(demonstrations(make_tasks(0, Split.TRAIN, [Family.TERMINATION_DATE], 1), make_builder))
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().tolist()
    weights = datum.loss_fn_inputs["weights"].to_torch().tolist()
    assert isinstance(datum, tinker.Datum)
    assert gemma3_tokenizer.decode(datum.model_input.to_ints()).startswith(
        "<bos><start_of_turn>user\nYou are a legal assistant")
    assert gemma3_tokenizer.decode([t for t, w in zip(targets, weights) if w == 1.0]) == (
        'read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>'
        'write_file", "arguments": {"path": "answer.txt", "content": "2027-07-22"}}\n</tool_call>'
        'finish", "arguments": {}}\n</tool_call>'
    )
