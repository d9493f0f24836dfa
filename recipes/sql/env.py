"""The text-to-SQL task on tinker-cookbook's RL types: SqlEnv, SqlGroupBuilder, SqlDataset, and the grader.

- `SqlGrader` owns the databases' files and the query worker pool, runs every
  gold query once (through the same sandbox) and scores a reply's SQL against
  it with a reward variant from `reward.REWARDS`.
- `SqlEnv` is one single-turn episode. The prompt is one worked example on
  another schema (`EXAMPLE`, a user/assistant turn showing a query that names
  its column), then the schema's tables (one line each) and the question,
  asking for one query in a ```sql block. The reply is prefilled with
  "```sql\\nSELECT" (`PREFILL`): measured on the held-out questions,
  SmolLM2-135M-Instruct without it wrote CREATE TABLE statements or Python
  for every one (0 right), so RL would have had no signal. Sampling stops at
  the closing fence (`fenced_stop_condition`), because the explanation the
  model writes after its query would cost as many tokens again. The step
  scores PREFILL + the reply. Its metrics: `correct` (execution match,
  whatever the training reward) and `has_sql` (a statement was found).
- `SqlGroupBuilder` makes `group_size` envs on one question: the group whose
  mean reward is each reply's baseline.
- `SqlDataset` serves `questions_per_step` questions a step, in a seeded
  order.

Scoring blocks on a worker process, so `SqlEnv.step` runs it in a thread; the
pool bounds how many queries run at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tinker
from tinker_cookbook import renderers
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl.types import Action, ActionExtra, Env, EnvGroupBuilder, Observation, RLDataset, StepResult

from recipes.sql.databases import Schema, write_databases
from recipes.sql.questions import Question
from recipes.sql.reward import REWARDS, execution_reward, extract_sql
from recipes.sql.sandbox import QueryPool
from recipes.sql.sql_worker import QueryResult

FENCE = "```"
INSTRUCTION = "Write one SQLite query that answers the question. Reply with only the query in a ```sql block."
PREFILL = "```sql\nSELECT"  # the start of the reply, given: the model writes the rest of the query
EXAMPLE: list[renderers.Message] = [
    {"role": "user", "content": "Tables:\npets(id, name, kind, age)\n\n"
                                f"Question: List the names of pets that are cats.\n{INSTRUCTION}"},
    {"role": "assistant", "content": "```sql\nSELECT name FROM pets WHERE kind = 'cat'\n```"},
]
NO_SQL = QueryResult("error", message="no SQL statement in the reply")


def fenced_stop_condition(renderer: renderers.Renderer) -> StopCondition:
    """The renderer's stop sequences plus the closing fence: as token ids if the renderer stops on ids, else text."""
    stops = list(renderer.get_stop_sequences())
    if stops and isinstance(stops[0], int):
        tokenizer = renderer.tokenizer
        return stops + [i for i in range(len(tokenizer)) if FENCE in tokenizer.decode([i])]
    return stops + [FENCE]


class SqlGrader:
    """Scores SQL against each question's gold result, every query run in the sandbox."""

    def __init__(self, schemas: tuple[Schema, ...], db_dir: Path, pool: QueryPool, questions: Sequence[Question]):
        self.schemas = {s.name: s for s in schemas}
        self.db_paths = write_databases(schemas, db_dir)
        self.pool = pool
        self.gold: dict[str, list[list]] = {}
        for q in questions:
            result = pool.run(self.db_paths[q.schema], q.gold_sql)
            assert result.status == "ok" and result.rows, f"gold query of {q.id} gave {result.status}: {result.message}"
            self.gold[q.id] = result.rows

    def prompt(self, question: Question) -> str:
        return f"Tables:\n{self.schemas[question.schema].prompt_text()}\n\nQuestion: {question.text}\n{INSTRUCTION}"

    def run(self, question: Question, sql: str | None) -> QueryResult:
        return NO_SQL if sql is None else self.pool.run(self.db_paths[question.schema], sql)

    def score(self, question: Question, result: QueryResult, reward_name: str) -> tuple[float, bool]:
        """(the named reward, whether it is an execution match) for `result` on `question`."""
        gold = self.gold[question.id]
        reward = REWARDS[reward_name](gold, result, ordered=question.is_ordered)
        return reward, execution_reward(gold, result, ordered=question.is_ordered) == 1.0


class SqlEnv(Env):
    def __init__(self, question: Question, grader: SqlGrader, renderer: renderers.Renderer, reward_name: str,
                 stop_condition: StopCondition):
        self.question = question
        self.grader = grader
        self.renderer = renderer
        self.reward_name = reward_name
        self.stop_condition = stop_condition
        self.reply = ""  # PREFILL + the reply's text, once stepped (for logs)

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        messages = [*EXAMPLE, {"role": "user", "content": self.grader.prompt(self.question)}]
        return self.renderer.build_generation_prompt(messages, prefill=PREFILL), self.stop_condition

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        message, _termination = self.renderer.parse_response(action)
        self.reply = PREFILL + renderers.get_text_content(message)
        sql = extract_sql(self.reply)
        result = await asyncio.to_thread(self.grader.run, self.question, sql)
        reward, correct = self.grader.score(self.question, result, self.reward_name)
        return StepResult(
            reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.stop_condition,
            metrics={"correct": float(correct), "has_sql": float(sql is not None)},
        )


@dataclass(frozen=True)
class SqlGroupBuilder(EnvGroupBuilder):
    question: Question
    grader: SqlGrader
    renderer: renderers.Renderer
    reward_name: str
    group_size: int
    stop_condition: StopCondition

    async def make_envs(self) -> Sequence[Env]:
        return [SqlEnv(self.question, self.grader, self.renderer, self.reward_name, self.stop_condition)
                for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["sql", self.question.family]


class SqlDataset(RLDataset):
    """`questions_per_step` train questions per batch, in one seeded order (the cookbook replays it each epoch)."""

    def __init__(self, questions: Sequence[Question], make_builder: Callable[[Question], EnvGroupBuilder],
                 questions_per_step: int, seed: int):
        self.questions = list(questions)
        random.Random(f"{seed}:order").shuffle(self.questions)
        self.make_builder = make_builder
        self.questions_per_step = questions_per_step

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.questions_per_step
        return [self.make_builder(q) for q in self.questions[start:start + self.questions_per_step]]

    def __len__(self) -> int:
        return max(1, len(self.questions) // self.questions_per_step)
