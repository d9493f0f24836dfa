"""One text-to-SQL RL job through the tinker SDK: sample groups, score by execution, one step, repeat.

The loop is tinker-cookbook's synchronous RL loop built from its own pieces:
`do_group_rollout` runs each question's group of `SqlEnv`s with a
`TinkerTokenCompleter`, `compute_advantages` centres rewards within each
group, groups whose replies all scored the same are dropped (no direction to
move in), `assemble_training_data` turns trajectories into Datums, then one
`forward_backward` with the chosen loss and one Adam `optim_step`.

Why not `tinker_cookbook.rl.train.main` itself: it takes its tokenizer by
Hugging Face model name (the Hub is unreachable offline; the packaged
SmolLM2 GGUF's tokenizer is passed in here instead), fetches a pricing file
from the web at start, and writes checkpoints and HTML logs that a sweep of
short jobs does not want; and its test-set evaluator samples at the training
temperature and reports means, where the sweep's statistics need each
held-out question's greedy result. Nothing here is specific to openrld: any
Tinker service at `base_url` will do.

Held-out evaluation: every `eval_every` steps (and after the last), each
held-out question gets one greedy reply (temperature 0), scored by execution
match. The JSONL log holds `step` and `eval` records (tagged), flushed as they
come, so an interrupted job keeps its curve.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker import types
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages
from tinker_cookbook.rl.rollouts import do_group_rollout, do_single_rollout
from tinker_cookbook.rl.types import TrajectoryGroup

from recipes.quickstart.train import load_tokenizer
from recipes.sql.databases import make_schemas
from recipes.sql.env import SqlDataset, SqlEnv, SqlGrader, SqlGroupBuilder, fenced_stop_condition
from recipes.sql.questions import FAMILIES, QuestionSplit, make_questions, split_questions
from recipes.sql.reward import REWARDS
from recipes.sql.sandbox import QueryPool

logger = logging.getLogger(__name__)

LOSSES = ("importance_sampling", "ppo", "cispo")


class SqlTrainConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str
    api_key: str = "tml-sql"
    base_model: str = "SmolLM2-135M-Instruct"
    renderer: str = "qwen3_instruct"  # ChatML without a thinking block: SmolLM2's own chat format
    tokenizer: str | None = None  # a local tokenizer directory; None: the packaged GGUF's, else the SDK's
    steps: int = 8
    questions_per_step: int = 4
    group_size: int = 4  # replies per question
    learning_rate: float = 4e-4
    lora_rank: int = 16
    loss: str = "importance_sampling"  # one of LOSSES
    reward: str = "execution"  # a name in reward.REWARDS
    max_tokens: int = 48  # the longest gold query is ~40 tokens; longer replies are cut (and usually wrong)
    temperature: float = 1.0
    eval_every: int = 4  # steps between held-out evaluations; 0: only before the first and after the last
    eval_at_start: bool = True  # evaluate the base model (step 0); a sweep does it for one job, not all of them
    seed: int = 0  # the job's: LoRA init, sampling seeds, the order of train questions
    data_seed: int = 0  # the data's: rows, questions and split (the same for every job of a sweep)
    families: tuple[str, ...] = FAMILIES
    query_workers: int = 2
    log_path: Path = Path("sql_out/log.jsonl")


class StepRecord(msgspec.Struct, frozen=True, tag="step"):
    step: int
    mean_reward: float
    correct_fraction: float  # replies that matched by execution
    groups_used: int  # groups whose rewards differed
    tokens: int  # cumulative: prompt and sampled tokens of training rollouts and held-out evaluations
    elapsed_s: float  # since the model was created


class EvalRecord(msgspec.Struct, frozen=True, tag="eval"):
    step: int  # evaluated before this step's update; `steps` means after the last
    accuracy: float  # held-out execution accuracy, greedy
    correct: list[int]  # 1/0 per held-out question, in the order of `question_ids`
    question_ids: list[str]
    tokens: int
    elapsed_s: float


LogRecord = StepRecord | EvalRecord


def read_log(path: Path) -> list[LogRecord]:
    decoder = msgspec.json.Decoder(LogRecord)
    return [decoder.decode(line) for line in path.read_text().splitlines() if line.strip()]


def make_split(config: SqlTrainConfig) -> tuple[tuple, QuestionSplit]:
    schemas = make_schemas(config.data_seed)
    return schemas, split_questions(make_questions(schemas), config.data_seed, families=config.families)


def _trajectory_tokens(groups: list[TrajectoryGroup]) -> int:
    return sum(t.ob.length + len(t.ac.tokens) for g in groups for traj in g.trajectories_G for t in traj.transitions)


def _without_mask(datum: tinker.Datum) -> tinker.Datum:
    # The cookbook's Datums carry a "mask" for its own bookkeeping; losses take only their named inputs.
    return tinker.Datum(model_input=datum.model_input,
                        loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "mask"})


async def evaluate(sampler: tinker.SamplingClient, split: QuestionSplit, grader: SqlGrader, renderer,
                   stop_condition, max_tokens: int) -> tuple[list[int], int]:
    """Each held-out question's greedy execution match (1/0, in split order) and the tokens it took."""
    policy = TinkerTokenCompleter(sampler, max_tokens=max_tokens, temperature=0.0)
    envs = [SqlEnv(q, grader, renderer, "execution", stop_condition) for q in split.heldout]
    trajectories = await asyncio.gather(*[do_single_rollout(policy, env) for env in envs])
    correct = [int(t.transitions[0].metrics["correct"]) for t in trajectories]
    tokens = sum(t.transitions[0].ob.length + len(t.transitions[0].ac.tokens) for t in trajectories)
    return correct, tokens


async def train_step(training, sampler, dataset: SqlDataset, step: int, config: SqlTrainConfig):
    """One step's rollouts and update: (mean reward, correct fraction, groups used, tokens)."""
    policy = TinkerTokenCompleter(sampler, max_tokens=config.max_tokens, temperature=config.temperature)
    groups = list(await asyncio.gather(*[do_group_rollout(b, policy) for b in dataset.get_batch(step)]))
    rewards = [r for g in groups for r in g.get_total_rewards()]
    correct = [t.transitions[0].metrics["correct"] for g in groups for t in g.trajectories_G]
    informative = [g for g in groups if len(set(g.get_total_rewards())) > 1]
    if informative:
        data, _ = assemble_training_data(informative, compute_advantages(informative), include_provenance=False)
        # Both requests are queued before either is awaited, as the cookbook's loop does.
        backward = training.forward_backward([_without_mask(d) for d in data], config.loss)
        update = training.optim_step(types.AdamParams(learning_rate=config.learning_rate))
        await backward
        await update
    return sum(rewards) / len(rewards), sum(correct) / len(correct), len(informative), _trajectory_tokens(groups)


async def train_async(config: SqlTrainConfig, on_record: Callable[[LogRecord], None] | None = None) -> list[LogRecord]:
    """Run the job against the service at `config.base_url`; returns its records (also in the JSONL log)."""
    assert config.loss in LOSSES, f"loss: expected one of {LOSSES}, got {config.loss!r}"
    assert config.reward in REWARDS, f"reward: expected one of {tuple(REWARDS)}, got {config.reward!r}"
    schemas, split = make_split(config)
    service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
    records: list[LogRecord] = []
    with tempfile.TemporaryDirectory(prefix="sql-dbs-") as db_dir, QueryPool(config.query_workers) as pool:
        grader = SqlGrader(schemas, Path(db_dir), pool, split.train + split.heldout)
        try:
            training = await service.create_lora_training_client(
                base_model=config.base_model, rank=config.lora_rank, seed=config.seed)
            renderer = get_renderer(config.renderer, load_tokenizer(training, config.base_model, config.tokenizer))
            stop = fenced_stop_condition(renderer)
            dataset = SqlDataset(split.train, lambda q: SqlGroupBuilder(q, grader, renderer, config.reward,
                                                                        config.group_size, stop),
                                 config.questions_per_step, config.seed)
            config.log_path.parent.mkdir(parents=True, exist_ok=True)
            started, tokens = time.monotonic(), 0
            with config.log_path.open("w") as log:
                def emit(record: LogRecord) -> None:
                    records.append(record)
                    log.write(msgspec.json.encode(record).decode() + "\n")
                    log.flush()
                    if on_record is not None:
                        on_record(record)

                for step in range(config.steps + 1):
                    sampler = await training.save_weights_and_get_sampling_client()
                    is_last = step == config.steps
                    if is_last or (step == 0 and config.eval_at_start) or (
                            step > 0 and config.eval_every and step % config.eval_every == 0):
                        correct, used = await evaluate(sampler, split, grader, renderer, stop, config.max_tokens)
                        tokens += used
                        emit(EvalRecord(step, sum(correct) / len(correct), correct, [q.id for q in split.heldout],
                                        tokens, time.monotonic() - started))
                    if is_last:
                        break
                    mean_reward, correct_fraction, groups_used, used = await train_step(
                        training, sampler, dataset, step, config)
                    tokens += used
                    emit(StepRecord(step, mean_reward, correct_fraction, groups_used, tokens,
                                    time.monotonic() - started))
        finally:
            await service.close("success")
    return records


def train(config: SqlTrainConfig, on_record: Callable[[LogRecord], None] | None = None) -> list[LogRecord]:
    return asyncio.run(train_async(config, on_record))
