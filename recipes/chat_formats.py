"""The chat formats the recipes render, as tinker-cookbook renderers: ChatML and Gemma 3's.

`renderer_for(tokenizer)` picks one by the special tokens the model's tokenizer has.
ChatML (SmolLM2's: `<|im_start|>role ... <|im_end|>`, tool calls in `<tool_call>` tags)
is the cookbook's Qwen3 instruct renderer. Gemma 3's is written here, by hand, because
tinker-cookbook 0.6 has no renderer for Gemma, and Gemma 3's tokenizer has none of
ChatML's special tokens (`<|im_end|>` is six tokens of text to it), so the Qwen3
renderer the recipes use for SmolLM2 cannot stop a Gemma reply. This renderer writes
what Gemma 3's chat template writes:

    <bos><start_of_turn>user
    {system}

    {user}<end_of_turn>
    <start_of_turn>model
    {reply}<end_of_turn>

- the system prompt opens the first user turn, followed by a blank line (Gemma 3 has no
  system role);
- the assistant's role is `model`, and every turn ends with `<end_of_turn>`, the one
  token sampling stops on;
- Gemma's template has no tool-call format, so calls and answers are the ones the
  recipes already use: `<tool_call>{json}</tool_call>` in the model's turn, and a tool's
  answer inside `<tool_response>` tags in a user turn (the Qwen3 renderer's, which this
  one inherits with its parsing and its sequence-extension property).

The newline after `<end_of_turn>` is written at the start of the next turn's header,
so a reply's last token is `<end_of_turn>` and each turn's prompt extends the last.
Importing this module registers it with the cookbook as `gemma3`.
"""

from __future__ import annotations

from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.renderers import Renderer
from tinker_cookbook.renderers.base import Message, RenderContext, RenderedMessage, ensure_text
from tinker_cookbook.renderers.qwen3 import Qwen3InstructRenderer

GEMMA3 = "gemma3"
CHATML = "qwen3_instruct"  # SmolLM2's format: <|im_start|>role ... <|im_end|>, tool calls in <tool_call> tags

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
ROLES = {"assistant": "model", "tool": "user", "user": "user", "system": "user"}


class Gemma3Renderer(Qwen3InstructRenderer):
    """Gemma 3's turns around the Qwen3 renderer's content, tool calls and parsing."""

    @property
    def _bos_tokens(self) -> list[int]:
        return [self.tokenizer.bos_token_id]

    @property
    def _end_message_token(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(END_OF_TURN)

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        if message["role"] == "system":
            if ctx.idx != 0:
                raise ValueError("Gemma 3 takes a system prompt only as a conversation's first message")
            # Its text and a blank line open the first user turn, which the next message ends.
            opening = self._content_tokenizer.encode(f"{ensure_text(message['content'])}\n\n", add_special_tokens=False)
            return RenderedMessage(header=self._header("system", ctx), output=[types.EncodedTextChunk(tokens=opening.ids)])
        rendered = super().render_message(message, ctx)
        if ctx.idx == 1 and ctx.prev_message is not None and ctx.prev_message["role"] == "system":
            return RenderedMessage(output=rendered.output)  # the system prompt wrote this turn's header
        return RenderedMessage(header=self._header(message["role"], ctx), output=rendered.output)

    def _header(self, role: str, ctx: RenderContext) -> types.EncodedTextChunk:
        newline = "\n" if ctx.idx > 0 else ""  # the newline after the last turn's <end_of_turn>
        text = f"{newline}{START_OF_TURN}{ROLES[role]}\n"
        return types.EncodedTextChunk(tokens=self.tokenizer.encode(text, add_special_tokens=False))


# By name too (a recipe's --renderer gemma3), and through the registry the renderer gets the
# cookbook's pickling metadata, as the built-in ones do.
renderers.register_renderer(GEMMA3, lambda tokenizer, image_processor=None: Gemma3Renderer(tokenizer))


class UnknownChatFormat(ValueError):
    """The model's tokenizer is made for a chat format the recipes do not render."""


def renderer_for(tokenizer) -> Renderer:
    """The renderer of the chat format `tokenizer` was made for: Gemma 3's or ChatML's, by the
    special tokens it has.

    Raises:
        UnknownChatFormat: for a tokenizer with neither format's tokens.
    """
    vocabulary = tokenizer.get_vocab()
    if START_OF_TURN in vocabulary and END_OF_TURN in vocabulary:
        return renderers.get_renderer(GEMMA3, tokenizer)
    if "<|im_start|>" in vocabulary and "<|im_end|>" in vocabulary:
        return renderers.get_renderer(CHATML, tokenizer)
    raise UnknownChatFormat("the model's tokenizer has neither Gemma's <start_of_turn>/<end_of_turn> nor ChatML's "
                            "<|im_start|>/<|im_end|> as tokens; the recipes render only those two chat formats")
