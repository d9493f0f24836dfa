"""One text-to-SQL RL job: tinker-cookbook's own training loop (`rl.train.main`) on the SQL envs.

The loop is the cookbook's, unchanged: each step it samples a group of
replies to each of `questions_per_step` train questions (`SqlGroupBuilder`),
drops groups whose rewards are all the same, centres rewards within each
group, and takes one `forward_backward` with the chosen loss and one Adam
`optim_step`; it writes its per-step metrics to `<job>/cookbook/metrics.jsonl`
as it goes. What this module passes in, and why:
- the tokenizer and the API key, as `recipes/cookbook_offline.py` says (every
  job of a sweep uses one key);
- the held-out evaluator (`HeldoutEvaluator`): the cookbook's test-set
  evaluator samples at the training temperature and reports means, and the
  sweep's statistics need each held-out question's greedy (temperature 0)
  result. The loop calls it at steps 0, `eval_every`, 2 x `eval_every`, ...
  and after the last step, in that order; it writes one `EvalRecord` per
  call to the job's JSONL log as it comes.
Nothing here is specific to openrld: any Tinker service at `base_url` will do.

The cookbook loop seeds neither the LoRA initialisation nor sampling, so a
job's `seed` fixes the order of train questions only; the data (rows,
questions, split) come from `data_seed`.

When the loop is done, the job's log gets one `StepRecord` per step (from the
cookbook's metrics) and a `DoneRecord` with its tokens and wall time.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.completers import StopCondition, TinkerTokenCompleter
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.renderers import Renderer, get_renderer
from tinker_cookbook.rl import train as cookbook_train
from tinker_cookbook.rl.rollouts import do_single_rollout

from recipes.chat_formats import renderer_for
from recipes.cookbook_offline import LOSSES, cookbook_config, prepare_cookbook, rollout_rows
from recipes.sql.databases import Schema, make_schemas
from recipes.sql.env import SqlDataset, SqlEnv, SqlGrader, SqlGroupBuilder, fenced_stop_condition
from recipes.sql.questions import FAMILIES, QuestionSplit, make_questions, split_questions
from recipes.sql.reward import REWARDS
from recipes.sql.sandbox import QueryPool


class SqlTrainConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str
    api_key: str = "tml-sql"
    base_model: str = "SmolLM2-135M-Instruct"
    renderer: str | None = None  # a cookbook renderer's name; None: the model's own (chat_formats.renderer_for)
    tokenizer: str | None = None  # a local tokenizer directory; None: the packaged GGUF's, else the cookbook's
    steps: int = 8
    questions_per_step: int = 4
    group_size: int = 4  # replies per question
    learning_rate: float = 4e-4
    lora_rank: int = 16
    loss: str = "importance_sampling"  # one of LOSSES
    reward: str = "execution"  # a name in reward.REWARDS
    max_tokens: int = 48  # after the "SELECT" prefill; the longest gold query is ~40 tokens
    temperature: float = 1.0
    eval_every: int = 4  # steps between held-out evaluations (>= 1); the last step is always evaluated
    eval_at_start: bool = True  # evaluate the base model (step 0); a sweep does it for one job, not all of them
    seed: int = 0  # the order of train questions
    data_seed: int = 0  # rows, questions and split (the same for every job of a sweep)
    families: tuple[str, ...] = FAMILIES
    heldout_fraction: float = 0.25  # of each family's questions; more makes the sweep's test sharper, evals slower
    query_workers: int = 2
    log_path: Path = Path("sql_out/log.jsonl")


class EvalRecord(msgspec.Struct, frozen=True, tag="eval"):
    step: int  # weights after `step` updates
    accuracy: float  # held-out execution accuracy, greedy
    correct: list[int]  # 1/0 per held-out question, in the order of `question_ids`
    question_ids: list[str]
    tokens: int  # cumulative prompt and sampled tokens of held-out evaluations
    elapsed_s: float  # since the job started


class StepRecord(msgspec.Struct, frozen=True, tag="step"):
    step: int
    mean_reward: float
    correct_fraction: float  # training replies that matched by execution
    tokens: int  # cumulative prompt and sampled tokens of training rollouts
    step_s: float  # the cookbook's time/total for the step


class DoneRecord(msgspec.Struct, frozen=True, tag="done"):
    steps: int
    tokens: int  # training rollouts and held-out evaluations together
    wall_s: float  # the whole job, model creation included


LogRecord = EvalRecord | StepRecord | DoneRecord


def read_log(path: Path) -> list[LogRecord]:
    decoder = msgspec.json.Decoder(LogRecord)
    return [decoder.decode(line) for line in path.read_text().splitlines() if line.strip()]


def make_split(config: SqlTrainConfig) -> tuple[tuple[Schema, ...], QuestionSplit]:
    schemas = make_schemas(config.data_seed)
    return schemas, split_questions(
        make_questions(schemas), config.data_seed, heldout_fraction=config.heldout_fraction, families=config.families
    )


def eval_steps(steps: int, eval_every: int) -> list[int]:
    """The steps at which the cookbook loop calls its evaluators, in order: multiples of eval_every, and the last."""
    return [s for s in range(steps + 1) if s % eval_every == 0 or s == steps]


class HeldoutEvaluator(SamplingClientEvaluator):
    """Greedy execution accuracy on the held-out questions, one `EvalRecord` per call (see the module docstring)."""

    def __init__(self, split: QuestionSplit, grader: SqlGrader, renderer: Renderer, stop: StopCondition,
                 config: SqlTrainConfig, emit: Callable[[EvalRecord], None], started: float):
        self.split, self.grader, self.renderer, self.stop = split, grader, renderer, stop
        self.config = config
        self.emit = emit
        self.started = started
        self.pending_steps = eval_steps(config.steps, config.eval_every)
        self.tokens = 0

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        step = self.pending_steps.pop(0)
        if step == 0 and not self.config.eval_at_start:
            return {}
        policy = TinkerTokenCompleter(sampling_client, max_tokens=self.config.max_tokens, temperature=0.0)
        envs = [SqlEnv(q, self.grader, self.renderer, "execution", self.stop) for q in self.split.heldout]
        trajectories = await asyncio.gather(*[do_single_rollout(policy, env) for env in envs])
        correct = [int(t.transitions[0].metrics["correct"]) for t in trajectories]
        self.tokens += sum(t.transitions[0].ob.length + len(t.transitions[0].ac.tokens) for t in trajectories)
        accuracy = sum(correct) / len(correct)
        self.emit(EvalRecord(step, accuracy, correct, [q.id for q in self.split.heldout], self.tokens,
                             time.monotonic() - self.started))
        return {"heldout/execution_accuracy": accuracy}


def step_records(metrics_path: Path) -> list[StepRecord]:
    """The cookbook's per-step metrics (rows with rollout rewards) as StepRecords."""
    records = []
    for row in rollout_rows(metrics_path):
        tokens = sum(row.get(f"tokens/cumulative/{kind}", 0) for kind in ("prefill_cached", "prefill_uncached",
                                                                            "sampled"))
        records.append(StepRecord(row["step"], row["env/all/reward/total"], row["env/all/correct"], tokens,
                                  row.get("time/total", 0.0)))
    return records


def _cookbook_config(config: SqlTrainConfig, dataset: SqlDataset, evaluator: HeldoutEvaluator,
                     log_dir: Path) -> cookbook_train.Config:
    return cookbook_config(
        dataset, evaluator, log_dir, steps=config.steps, learning_rate=config.learning_rate,
        model_name=config.base_model, recipe_name="openrld_sql", max_tokens=config.max_tokens,
        eval_every=config.eval_every, base_url=config.base_url, loss_fn=config.loss, lora_rank=config.lora_rank,
        temperature=config.temperature,
    )


def train(config: SqlTrainConfig, on_record: Callable[[LogRecord], None] | None = None) -> list[LogRecord]:
    """Run the job against the service at `config.base_url`; returns its records (also in the JSONL log)."""
    assert config.loss in LOSSES, f"loss: expected one of {LOSSES}, got {config.loss!r}"
    assert config.reward in REWARDS, f"reward: expected one of {tuple(REWARDS)}, got {config.reward!r}"
    assert config.eval_every >= 1, f"eval_every: expected >= 1, got {config.eval_every}"
    started = time.monotonic()
    schemas, split = make_split(config)
    tokenizer = prepare_cookbook(config.base_model, config.tokenizer, config.api_key)
    tokenizer = tokenizer or tokenizer_utils.get_tokenizer(config.base_model)
    renderer = renderer_for(tokenizer) if config.renderer is None else get_renderer(config.renderer, tokenizer)
    stop = fenced_stop_condition(renderer)
    records: list[LogRecord] = []
    config.log_path.parent.mkdir(parents=True, exist_ok=True)
    with (tempfile.TemporaryDirectory(prefix="sql-dbs-") as db_dir, QueryPool(config.query_workers) as pool,
          config.log_path.open("w") as log):
        def emit(record: LogRecord) -> None:
            records.append(record)
            log.write(msgspec.json.encode(record).decode() + "\n")
            log.flush()
            if on_record is not None:
                on_record(record)

        grader = SqlGrader(schemas, Path(db_dir), pool, split.train + split.heldout)
        dataset = SqlDataset(split.train, lambda q: SqlGroupBuilder(q, grader, renderer, config.reward,
                                                                    config.group_size, stop),
                             config.questions_per_step, config.seed)
        evaluator = HeldoutEvaluator(split, grader, renderer, stop, config, emit, started)
        cookbook_dir = config.log_path.parent / "cookbook"
        # The cookbook resumes from a checkpoint it finds there, which would make this a different job.
        assert not (cookbook_dir / "checkpoints.jsonl").exists(), f"{cookbook_dir} holds an earlier run; use a new --out"
        asyncio.run(cookbook_train.main(_cookbook_config(config, dataset, evaluator, cookbook_dir)))
        steps = step_records(cookbook_dir / "metrics.jsonl")
        for record in steps:
            emit(record)
        rollout_tokens = steps[-1].tokens if steps else 0
        emit(DoneRecord(len(steps), rollout_tokens + evaluator.tokens, time.monotonic() - started))
    return records
