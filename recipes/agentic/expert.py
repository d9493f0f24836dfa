"""A scripted expert for the train tasks: what it calls next, given what the tools have answered.

`next_call(family, outputs)` is the expert: a pure function of the task's family
(which fixes the instruction) and the tools' answers so far, in order. It never
sees a task's expected answer: it reads the documents through the tools, as the
policy must, and copies the facts from what they showed.
- `termination_date`: read contract.txt, write the date it states to answer.txt, finish.
- `contract_terms`: list the files, read the agreement listed, write its termination
  date and notice period to answer.json, finish.
Other families have no expert (`COVERED`).

`ExpertCompleter` plays it as a policy: a tinker-cookbook `TokenCompleter` that
reads the tools' answers out of the observation (the renderer puts each inside
`<tool_response>` tags) and answers with the tokens of the next call, in the
renderer's tool-call format and less the reply's prefill where it has one
(`env.ToolCallPrefill`). Run through the recipe's own Env, the episode it plays is
the one the policy would see, token for token: same renderer, same tools, same sandbox.
"""

from __future__ import annotations

import json
import re

import msgspec
import tinker
from tinker_cookbook.completers import StopCondition, TokenCompleter, TokensWithLogprobs
from tinker_cookbook.renderers import Renderer

from recipes.agentic.tasks import Family

COVERED = (Family.TERMINATION_DATE, Family.CONTRACT_TERMS)

TERMINATION = re.compile(r"terminates on (\d{4}-\d{2}-\d{2})")
NOTICE = re.compile(r"on (\d+) days' written notice")
WROTE = re.compile(r"^wrote \d+ bytes to ", re.M)  # write_file's answer (tools.WorkspaceTools.write_file)
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, str]


def call_text(call: ToolCall) -> str:
    """The call as the renderer writes one: `<tool_call>`, its JSON, `</tool_call>`."""
    body = json.dumps({"name": call.name, "arguments": call.arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def _listed_agreement(outputs: list[str]) -> str | None:
    """The first listed file whose path names a contract or an agreement, from list_files' answers."""
    for output in outputs:
        for line in output.splitlines():
            if line.endswith(".txt") and ("contract" in line or "agreement" in line):
                return line.strip()
    return None


def _termination_date(outputs: list[str]) -> ToolCall:
    seen = "\n".join(outputs)
    if WROTE.search(seen):
        return ToolCall("finish", {})
    if found := TERMINATION.search(seen):
        return ToolCall("write_file", {"path": "answer.txt", "content": found.group(1)})
    return ToolCall("read_file", {"path": "contract.txt"})


def _contract_terms(outputs: list[str]) -> ToolCall:
    seen = "\n".join(outputs)
    if WROTE.search(seen):
        return ToolCall("finish", {})
    date, notice = TERMINATION.search(seen), NOTICE.search(seen)
    if date and notice:
        content = json.dumps({"termination_date": date.group(1), "notice_period_days": int(notice.group(1))})
        return ToolCall("write_file", {"path": "answer.json", "content": content})
    if (agreement := _listed_agreement(outputs)) is not None:
        return ToolCall("read_file", {"path": agreement})
    return ToolCall("list_files", {})


def next_call(family: Family, outputs: list[str]) -> ToolCall:
    """The expert's next call on a task of `family`, given the tools' answers so far (oldest first).

    Raises:
        ValueError: for a family the expert does not cover.
    """
    if family is Family.TERMINATION_DATE:
        return _termination_date(outputs)
    if family is Family.CONTRACT_TERMS:
        return _contract_terms(outputs)
    raise ValueError(f"the expert covers {', '.join(COVERED)}, not {family}")


def tool_outputs(observation: str) -> list[str]:
    """The tools' answers in a rendered conversation, oldest first."""
    return TOOL_RESPONSE.findall(observation)


class ExpertCompleter(TokenCompleter):
    """The expert as a policy over `renderer`'s tokens, on tasks of `family`.

    Its replies carry logprobs of 0 (they are not sampled) and stop as a sampled reply
    would: at the call's closing tag behind a prefill, else at the end-of-message token.
    """

    def __init__(self, family: Family, renderer: Renderer):
        if family not in COVERED:
            raise ValueError(f"the expert covers {', '.join(COVERED)}, not {family}")
        self.family = family
        self.renderer = renderer
        self.prefill: str = getattr(renderer, "prefill", "")  # env.ToolCallPrefill's; "" for a plain renderer

    def reply_tokens(self, observation: str) -> list[int]:
        """The tokens of the expert's reply to a conversation rendered as `observation`."""
        text = call_text(next_call(self.family, tool_outputs(observation)))
        assert text.startswith(self.prefill), f"the reply {text!r} does not begin with the prefill {self.prefill!r}"
        tokens = self.renderer.tokenizer.encode(text[len(self.prefill):], add_special_tokens=False)
        # Behind a prefill the sampler stops at the closing tag; a plain reply ends with the end-of-message token.
        return tokens if self.prefill else [*tokens, *self.renderer.get_stop_sequences()[:1]]

    async def __call__(self, model_input: tinker.ModelInput, stop: StopCondition, *,
                       max_tokens: int | None = None) -> TokensWithLogprobs:
        tokens = self.reply_tokens(self.renderer.tokenizer.decode(model_input.to_ints()))
        # The policy could never write a reply longer than its budget, so neither may its teacher.
        assert max_tokens is None or len(tokens) <= max_tokens, \
            f"the expert's reply is {len(tokens)} tokens, over the reply budget of {max_tokens}"
        return TokensWithLogprobs(tokens=tokens, maybe_logprobs=[0.0] * len(tokens), stop_reason="stop")
