"""An optional LLM judge of deliverables, and how often it agrees with the rubric's exact checks.

The judge is a sampling client of a base model on the same service (any
Tinker-API service). It reads the instruction, the workspace's documents and the
deliverable, and answers PASS or FAIL, greedily, in a few tokens. The exact checks
stay the reward: the judge is reported beside them (`Agreement`), which is the
number that says whether a judge could grade tasks that have no single answer.
A reply that is neither PASS nor FAIL counts as a disagreement and is also
counted on its own.
"""

from __future__ import annotations

import asyncio

import msgspec
from tinker import types
from tinker_cookbook.renderers import Renderer
from tinker_cookbook.renderers.base import Message

from recipes.agentic.tasks import Task

JUDGE_PROMPT = """You check a legal assistant's work against the documents it was given.

Instruction given to the assistant:
{instruction}

Documents:
{documents}

The file {deliverable} it wrote:
{content}

Does the file do exactly what the instruction asks, with facts that match the documents?
Answer with one word: PASS or FAIL."""
MAX_DOCUMENT_CHARS = 4000  # the judge's context is the base model's; documents here are ~300 chars each


class Agreement(msgspec.Struct, frozen=True):
    episodes: int
    agreed: int  # the judge's verdict equals the exact checks' success
    judge_passed: int
    exact_passed: int
    unparsed: int  # replies that were neither PASS nor FAIL

    @property
    def rate(self) -> float:
        return self.agreed / self.episodes if self.episodes else 0.0


def judge_prompt(task: Task, content: str | None) -> str:
    documents = "\n".join(f"--- {path}\n{text}" for path, text in task.documents.items())[:MAX_DOCUMENT_CHARS]
    return JUDGE_PROMPT.format(instruction=task.instruction, documents=documents, deliverable=task.deliverable,
                               content=content if content is not None else "(the file was never written)")


def parse_verdict(reply: str) -> bool | None:
    """True for PASS, False for FAIL (the first of them in the reply), None for neither."""
    words = reply.upper().replace(".", " ").split()
    for word in words:
        if word in ("PASS", "FAIL"):
            return word == "PASS"
    return None


def agreement(verdicts: list[bool | None], exact: list[bool]) -> Agreement:
    assert len(verdicts) == len(exact), (len(verdicts), len(exact))
    return Agreement(
        episodes=len(exact), agreed=sum(v is not None and v == e for v, e in zip(verdicts, exact)),
        judge_passed=sum(v is True for v in verdicts), exact_passed=sum(exact),
        unparsed=sum(v is None for v in verdicts),
    )


async def judge_one(sampler, renderer: Renderer, task: Task, content: str | None) -> bool | None:
    prompt = renderer.build_generation_prompt([Message(role="user", content=judge_prompt(task, content))])
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=renderer.get_stop_sequences())
    response = await sampler.sample(prompt, 1, params)
    return parse_verdict(renderer.tokenizer.decode(response.sequences[0].tokens, skip_special_tokens=True))


async def judge_all(sampler, renderer: Renderer, items: list[tuple[Task, str | None]]) -> list[bool | None]:
    return list(await asyncio.gather(*[judge_one(sampler, renderer, task, content) for task, content in items]))
