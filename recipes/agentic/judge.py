"""An optional LLM judge of deliverables, and how often it agrees with the rubric's exact checks.

The judge is a sampling client of a base model on the same service (any
Tinker-API service). It reads the instruction, the workspace's documents and the
deliverable, and its verdict is a forced choice: of the two whole replies PASS
and FAIL (each word, then the end of the turn), the one the model gives the
higher log-probability (`compute_logprobs` on the prompt followed by the reply),
so every episode gets a verdict. Answering freely, SmolLM2-135M-Instruct wrote
neither word in 96 of 96 greedy replies. The exact checks stay the reward: the
judge is reported beside them (`Agreement`), which is the number that says
whether a judge could grade tasks that have no single answer.
"""

from __future__ import annotations

import asyncio

import msgspec
import tinker
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


VERDICTS = ("PASS", "FAIL")


class Agreement(msgspec.Struct, frozen=True):
    episodes: int
    agreed: int  # the judge's verdict equals the exact checks' success
    judge_passed: int
    exact_passed: int

    @property
    def rate(self) -> float:
        return self.agreed / self.episodes if self.episodes else 0.0


def judge_prompt(task: Task, content: str | None) -> str:
    documents = "\n".join(f"--- {path}\n{text}" for path, text in task.documents.items())[:MAX_DOCUMENT_CHARS]
    return JUDGE_PROMPT.format(instruction=task.instruction, documents=documents, deliverable=task.deliverable,
                               content=content if content is not None else "(the file was never written)")


def agreement(verdicts: list[bool], exact: list[bool]) -> Agreement:
    assert len(verdicts) == len(exact), (len(verdicts), len(exact))
    return Agreement(episodes=len(exact), agreed=sum(v == e for v, e in zip(verdicts, exact)),
                     judge_passed=sum(verdicts), exact_passed=sum(exact))


def reply_tokens(renderer: Renderer, word: str) -> list[int]:
    """The judge's whole reply `word`: its tokens, then the renderer's end-of-turn token."""
    [end, *_] = renderer.get_stop_sequences()
    assert isinstance(end, int), f"expected a renderer that stops on token ids, got {end!r}"
    return [*renderer.tokenizer.encode(word, add_special_tokens=False), end]


async def reply_logprob(sampler: tinker.SamplingClient, prompt: types.ModelInput, reply: list[int]) -> float:
    """log P(reply | prompt): the sum of the reply's token log-probabilities, with the prompt before them."""
    logprobs = await sampler.compute_logprobs(types.ModelInput.from_ints([*prompt.to_ints(), *reply]),
                                              prompt_logprobs_last_n=len(reply))
    scored = logprobs[-len(reply):]
    if any(lp is None for lp in scored):
        raise RuntimeError(f"the service scored {scored} for the reply's {len(reply)} tokens")
    return sum(lp for lp in scored if lp is not None)


async def judge_one(sampler: tinker.SamplingClient, renderer: Renderer, task: Task, content: str | None) -> bool:
    """PASS (True) when the judge's reply PASS is likelier than its reply FAIL, else FAIL (False)."""
    prompt = renderer.build_generation_prompt([Message(role="user", content=judge_prompt(task, content))])
    passed, failed = [await reply_logprob(sampler, prompt, reply_tokens(renderer, word)) for word in VERDICTS]
    return passed > failed


async def judge_all(sampler: tinker.SamplingClient, renderer: Renderer,
                    items: list[tuple[Task, str | None]]) -> list[bool]:
    return list(await asyncio.gather(*[judge_one(sampler, renderer, task, content) for task, content in items]))
