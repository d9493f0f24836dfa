"""The text-to-SQL task on tinker-cookbook's RL types: SqlEnv, SqlGroupBuilder, SqlDataset, and the grader.

- `SqlGrader` owns the databases' files and the query worker pool, runs every
  gold query once (through the same sandbox) and scores a reply's SQL against
  it with a reward variant from `reward.REWARDS`.
- `SqlEnv` is one single-turn episode: the prompt is the schema's tables (one
  line each) and the question, asking for one query in a ```sql block; the
  step scores the reply. Its metrics: `correct` (execution match, whatever
  the training reward) and `has_sql` (a statement could be extracted).
- `SqlGroupBuilder` makes `group_size` envs on one question: the group whose
  mean reward is each reply's baseline.
- `SqlDataset` serves `questions_per_step` questions a step, reshuffled
  (seeded) each pass over the train set.

Scoring blocks on a worker process, so `SqlEnv.step` runs it in a thread; the
pool bounds how many queries run at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
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

INSTRUCTION = "Write one SQLite query that answers the question. Reply with only the query in a ```sql block."
NO_SQL = QueryResult("error", message="no SQL statement in the reply")


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
    def __init__(self, question: Question, grader: SqlGrader, renderer: renderers.Renderer, reward_name: str):
        self.question = question
        self.grader = grader
        self.renderer = renderer
        self.reward_name = reward_name
        self.reply = ""  # the reply's text, once stepped (for logs)

    @property
    def stop_condition(self) -> StopCondition:
        return self.renderer.get_stop_sequences()

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        messages = [{"role": "user", "content": self.grader.prompt(self.question)}]
        return self.renderer.build_generation_prompt(messages), self.stop_condition

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        message, _termination = self.renderer.parse_response(action)
        self.reply = renderers.get_text_content(message)
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

    async def make_envs(self) -> Sequence[Env]:
        return [SqlEnv(self.question, self.grader, self.renderer, self.reward_name) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["sql", self.question.family]


class SqlDataset(RLDataset):
    """`questions_per_step` train questions per batch; each pass over them in a new seeded order."""

    def __init__(self, questions: Sequence[Question], make_builder, questions_per_step: int, seed: int):
        self.questions = list(questions)
        self.make_builder = make_builder  # Question -> SqlGroupBuilder
        self.questions_per_step = questions_per_step
        self.seed = seed
        self.batches_per_pass = max(1, len(self.questions) // questions_per_step)

    def _pass_order(self, n: int) -> list[Question]:
        order = list(self.questions)
        random.Random(f"{self.seed}:pass:{n}").shuffle(order)
        return order

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        n_pass, offset = divmod(index, self.batches_per_pass)
        order = self._pass_order(n_pass)
        start = offset * self.questions_per_step
        return [self.make_builder(q) for q in order[start:start + self.questions_per_step]]

    def __len__(self) -> int:
        return self.batches_per_pass
