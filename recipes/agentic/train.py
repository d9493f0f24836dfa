"""The agentic RL job: tinker-cookbook's own training loop (`rl.train.main`) on sandboxed tool-use episodes.

The loop is the cookbook's, unchanged: each step it runs `groups_per_step` groups
of `group_size` episodes (`env.AgenticGroupBuilder`: one sandbox per episode,
the rubric's score as the reward), drops groups whose rewards are all the same,
centres rewards within each group, and takes one `forward_backward` with the
`importance_sampling` loss and one Adam `optim_step`; it writes its per-step
metrics to `<out>/cookbook/metrics.jsonl` as it goes. What this module passes in,
and why:
- the tokenizer and the API key, as `recipes/cookbook_offline.py` says;
- the dataset, built beforehand (`TaskDataset`) and handed over by a trivial
  `RLDatasetBuilder` (`cookbook_offline.PrebuiltDatasetBuilder`), since its builders hold the renderer and the sandbox factory;
- the episodes' renderer: the model's own chat format (`chat_formats.renderer_for`:
  ChatML for SmolLM2, Gemma 3's turns for Gemma), with every reply begun as a tool
  call (`env.ToolCallPrefill`) unless `tool_call_prefill` is off; the judge
  gets the plain one;
- the held-out evaluator (`HeldOutEvaluator`): `held_out_episodes` episodes of
  each held-out task, each one's success (every rubric check passed), rubric
  score and turns, and optionally the LLM judge's agreement with those checks.
  The loop calls it after 0, `eval_every`, 2 x `eval_every`, ... steps and after
  the last one; each call's `EvalRecord` goes to the job's JSONL log as it comes;
- with `warm_start` N > 0, the loop starts from the state `warm_start.warm_start`
  saved: N expert demonstrations on train tasks, trained on with cross-entropy
  first. The loop resumes from it as from a checkpoint of its own at step 0
  (`resume_from`), so RL keeps the warm start's Adam moments as well as its
  weights; `load_checkpoint_path` would load the weights alone, and a fresh
  Adam's first steps move every parameter by about the learning rate whatever the
  gradient's size. The base model is evaluated on the same held-out tasks before
  it, so the log holds three stages: base, warm start, RL;
- the loss: `ppo` by default, whose clipped ratio bounds each token's step:
  episodes are sampled at `temperature` < 1 and trained at 1, so the sampler's
  logprobs are not the policy's and the ratios of its rare tokens run above 1
  (chosen with the learning rate, 3e-4, and measured with it, not apart);
- the episode token budget, clamped to the model's context as the service reports it.
When the loop is done the log gets one `StepRecord` per step from the cookbook's
metrics, then one `compare.Comparison` per family and pair of stages (paired tests).
Nothing here is specific to openrld: any Tinker-API service will do.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker_cookbook import checkpoint_utils, tokenizer_utils
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.renderers import Renderer
from tinker_cookbook.rl import train as cookbook_train
from tinker_cookbook.rl.rollouts import do_group_rollout

from recipes.agentic import judge, rubric
from recipes.agentic.backends import pick_backend
from recipes.agentic.compare import Comparison, compare
from recipes.agentic.env import AgenticGroupBuilder, TaskDataset, ToolCallPrefill
from recipes.agentic.sandbox import SandboxLimits
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.agentic.warm_start import WarmStartRecord, demonstrations, warm_start
from recipes.chat_formats import renderer_for
from recipes.cookbook_offline import cookbook_config, prepare_cookbook, rollout_rows

logger = logging.getLogger(__name__)

class AgenticConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str
    api_key: str = "tml-agentic"
    base_model: str = "SmolLM2-135M-Instruct"
    families: tuple[Family, ...] = (Family.TERMINATION_DATE,)
    steps: int = 30
    groups_per_step: int = 4  # tasks per step
    group_size: int = 4  # episodes per task: the group whose mean is each episode's baseline
    train_tasks: int = 200
    held_out_tasks: int = 16
    held_out_episodes: int = 1  # episodes of each held-out task at each evaluation (pairs for the tests)
    eval_every: int = 5  # steps between held-out evaluations (also before the first and after the last)
    max_turns: int = 4  # list, read, write, finish (termination_date's expert needs three)
    max_generation_tokens: int = 64  # contract_terms' write_file call is 58 SmolLM2 tokens, less the prefill
    max_trajectory_tokens: int = 2048  # clamped to the model's context; the expert's episodes are ~620
    # From the warm start, SmolLM2 at 1e-3 lost held-out success within 5 steps (with and without the
    # warm start's Adam state, at temperature 0.7 and 1.0); at 3e-4 with ppo it gained.
    learning_rate: float = 3e-4
    loss_fn: str = "ppo"  # one of cookbook_offline.LOSSES
    lora_rank: int = 16
    # Below 1: at 1.0, before replies were prefilled as tool calls, SmolLM2-135M wrote none
    # in 28 episodes; 0.7 keeps its calls' arguments coherent. The sampler's logprobs are
    # then those of the tempered policy, a known bias of the importance weights that a
    # short run tolerates.
    temperature: float = 0.7
    seed: int = 0  # the tasks' (the cookbook loop seeds neither the LoRA init nor sampling)
    sandbox: str = "auto"  # "auto", "bwrap" or "agent-sandbox"
    tokenizer: str | None = None  # a local tokenizer directory; None: the packaged GGUF's, else the cookbook's
    judge_model: str | None = None  # a base model on the same service to judge held-out deliverables
    tool_call_prefill: bool = True  # begin every reply as a tool call (env.ToolCallPrefill)
    warm_start: int = 0  # N expert demonstrations (the first N train tasks) to train on before RL; 0: none
    warm_start_steps: int = 8
    warm_start_batch: int = 4  # demonstrations per step (~620 SmolLM2 tokens each)
    warm_start_learning_rate: float = 1e-3
    log_path: Path = Path("agentic_out/records.jsonl")


class RunRecord(msgspec.Struct, frozen=True, tag="run"):
    sandbox_backend: str  # "bwrap" or "agent-sandbox"
    base_model: str
    families: list[str]
    max_trajectory_tokens: int = 0  # the episode budget used: the asked one, clamped to max_context
    max_context: int | None = None  # the model's positions as the service reports them (None: not reported)


ALL_FAMILIES = "all"  # the family name of comparisons over every held-out task


class Stage(enum.StrEnum):
    BASE = "base"
    WARM_START = "warm_start"
    RL = "rl"


class EvalRecord(msgspec.Struct, frozen=True, tag="eval"):
    step: int  # RL steps taken before this evaluation
    held_out_success: float  # held-out episodes that passed every check
    # The per-episode lists below run in task order, `episodes_per_task` episodes of each task.
    successes: list[bool]
    judge_agreement: float | None  # the judge's verdicts equal to the exact checks' (None: no judge)
    elapsed_s: float
    stage: str = Stage.RL.value  # which model: the base, after the warm start, or after `step` RL steps
    task_ids: list[str] = []  # per episode
    families: list[str] = []  # per episode
    scores: list[float] = []  # per episode: the rubric reward, the fraction of checks passed
    turns: list[int] = []  # per episode: the model's replies
    judge_counts: judge.Agreement | None = None  # the judge's verdicts in detail, when there is one
    episodes_per_task: int = 1


class StepRecord(msgspec.Struct, frozen=True, tag="step"):
    step: int
    mean_reward: float  # mean rubric score of the step's episodes
    success_rate: float  # episodes whose deliverable passed every check
    mean_turns: float
    elapsed_s: float  # the cookbook's time for the step


LogRecord = RunRecord | EvalRecord | StepRecord | WarmStartRecord | Comparison


def episode_budget(asked: int, max_context: int | None) -> int:
    """The episode's token budget: the one asked, clamped to the model's context when the service says it.

    An episode stops before a reply could outgrow its budget (the cookbook's Env keeps a
    reply's budget in hand), so a budget within the context never makes a request the
    model cannot take: a model with fewer positions gets shorter episodes, not a 400.
    """
    return asked if max_context is None else min(asked, max_context)


def eval_steps(steps: int, eval_every: int) -> list[int]:
    """The steps after which the cookbook loop calls its evaluators, in order: multiples of eval_every, and the last."""
    return [s for s in range(steps + 1) if s % eval_every == 0 or s == steps]


class HeldOutEpisode(msgspec.Struct, frozen=True):
    task: Task
    grade: rubric.Grade
    deliverable: str | None  # what the grader read
    turns: int  # the model's replies


async def evaluate_held_out(tasks: list[Task], make_builder: Callable[..., AgenticGroupBuilder],
                            sampling_client: tinker.SamplingClient, config: AgenticConfig) -> list[HeldOutEpisode]:
    """`config.held_out_episodes` episodes of each held-out task with the policy `sampling_client` samples, graded,
    in task order."""
    builders = [make_builder(task, config.held_out_episodes) for task in tasks]
    policy = TinkerTokenCompleter(sampling_client, max_tokens=config.max_generation_tokens,
                                  temperature=config.temperature)
    groups = await asyncio.gather(*[do_group_rollout(b, policy) for b in builders])
    episodes = []
    for builder, group in zip(builders, groups):
        for grade, deliverable, trajectory in zip(builder.grades, builder.deliverables, group.trajectories_G):
            if grade is None:  # every episode is graded (AgenticGroupBuilder): this is a bug, not an input
                raise RuntimeError(f"an episode of {builder.task.task_id} was never graded")
            episodes.append(HeldOutEpisode(builder.task, grade, deliverable, len(trajectory.transitions)))
    return episodes


class HeldOutEvaluator(SamplingClientEvaluator):
    """Held-out success, rubric reward and turns (and the judge's agreement) at each of the loop's evaluation points."""

    def __init__(self, tasks: list[Task], make_builder: Callable[..., AgenticGroupBuilder], config: AgenticConfig,
                 renderer: Renderer, emit: Callable[[EvalRecord], None], started: float, *, first_stage: Stage):
        self.tasks, self.make_builder, self.config, self.renderer = tasks, make_builder, config, renderer
        self.emit = emit
        self.started = started
        self.first_stage = first_stage  # the loop's step 0: the base model, or the warm start's state
        self.pending_steps = eval_steps(config.steps, config.eval_every)
        self.judge_sampler = None

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        step = self.pending_steps.pop(0)
        record = await self.evaluate(sampling_client, step, self.first_stage if step == 0 else Stage.RL)
        metrics = {"held_out/success": record.held_out_success}
        return metrics if record.judge_agreement is None else {**metrics, "held_out/judge_agreement": record.judge_agreement}

    async def evaluate(self, sampling_client: tinker.SamplingClient, step: int, stage: Stage) -> EvalRecord:
        episodes = await evaluate_held_out(self.tasks, self.make_builder, sampling_client, self.config)
        successes = [e.grade.success for e in episodes]
        counts = await self._judge([(e.task, e.deliverable) for e in episodes], successes)
        record = EvalRecord(
            step, sum(successes) / len(successes), successes, None if counts is None else counts.rate,
            time.monotonic() - self.started, stage=stage.value, task_ids=[e.task.task_id for e in episodes],
            families=[e.task.family.value for e in episodes], scores=[e.grade.score for e in episodes],
            turns=[e.turns for e in episodes], judge_counts=counts, episodes_per_task=self.config.held_out_episodes,
        )
        self.emit(record)
        return record

    async def _judge(self, items: list[tuple[Task, str | None]], successes: list[bool]) -> judge.Agreement | None:
        if self.config.judge_model is None:
            return None
        if self.judge_sampler is None:
            service = tinker.ServiceClient(base_url=self.config.base_url, api_key=self.config.api_key)
            self.judge_sampler = await service.create_sampling_client_async(base_model=self.config.judge_model)
        agreed = judge.agreement(await judge.judge_all(self.judge_sampler, self.renderer, items), successes)
        logger.info("judge agreement %d/%d (judge passed %d, exact passed %d)", agreed.agreed, agreed.episodes,
                    agreed.judge_passed, agreed.exact_passed)
        return agreed


def comparisons(evals: list[EvalRecord]) -> list[Comparison]:
    """Per family, then over all tasks (`ALL_FAMILIES`, with several families): each stage against the one before
    it, and the last against the first (with three stages).

    The stages are the first evaluation of each stage in order, and the last evaluation of RL.
    """
    firsts = {e.stage: e for e in reversed(evals)}
    points = [firsts[s.value] for s in (Stage.BASE, Stage.WARM_START) if s.value in firsts]
    rl = [e for e in evals if e.stage == Stage.RL.value]
    points += rl[-1:]
    pairs = list(itertools.pairwise(points)) + ([(points[0], points[-1])] if len(points) > 2 else [])
    out = []
    families = list(dict.fromkeys(evals[0].families))
    for family in [*families, *([ALL_FAMILIES] if len(families) > 1 else [])]:
        for before, after in pairs:
            assert before.task_ids == after.task_ids, "stages must run the same held-out tasks in the same order"
            rows = [i for i, f in enumerate(before.families) if family in (f, ALL_FAMILIES)]
            out.append(compare(
                family, before.stage if before.stage != Stage.RL.value else f"rl@{before.step}",
                after.stage if after.stage != Stage.RL.value else f"rl@{after.step}",
                ([before.successes[i] for i in rows], [after.successes[i] for i in rows]),
                ([before.scores[i] for i in rows], [after.scores[i] for i in rows]),
            ))
    return out


def step_records(metrics_path: Path, dataset: TaskDataset) -> list[StepRecord]:
    """The cookbook's per-step metrics (the rows with rollout rewards) as StepRecords, with each step's successes
    and mean reward.

    Success and reward come from the step's own builders, not the metrics: the cookbook
    averages an episode metric only over the episodes that report it, and its metrics
    cover only the groups it trained on (it drops groups of equal rewards, and keeps one
    when all are), so its reward said 1.0 for a step whose other group all scored 0.
    """
    return [
        StepRecord(
            row["step"], dataset.mean_reward(row["step"]), dataset.success_rate(row["step"]),
            row.get("env/all/turns_per_episode", 0.0), row.get("time/total", 0.0),
        )
        for row in rollout_rows(metrics_path)
    ]


def _cookbook_config(config: AgenticConfig, dataset: TaskDataset, evaluator: HeldOutEvaluator,
                     log_dir: Path) -> cookbook_train.Config:
    return cookbook_config(
        dataset, evaluator, log_dir, steps=config.steps, learning_rate=config.learning_rate,
        model_name=config.base_model, recipe_name="openrld_agentic", max_tokens=config.max_generation_tokens,
        eval_every=config.eval_every, base_url=config.base_url, loss_fn=config.loss_fn,
        lora_rank=config.lora_rank, temperature=config.temperature,
    )


def resume_from(cookbook_dir: Path, state_path: str) -> None:
    """Make the cookbook loop in `cookbook_dir` start from `state_path`, weights and optimizer state, at step 0.

    The loop resumes from the last record of its `checkpoints.jsonl` with the optimizer
    state (`create_training_client_from_state_with_optimizer`), at that record's batch;
    this writes that record, in the cookbook's own format, for a state the loop did not save.
    """
    cookbook_dir.mkdir(parents=True, exist_ok=True)
    record = checkpoint_utils.CheckpointRecord(name="warm-start", batch=0, state_path=state_path)
    with (cookbook_dir / checkpoint_utils.CHECKPOINTS_BASE_NAME).open("a") as f:
        f.write(msgspec.json.encode(record.to_dict()).decode() + "\n")


def model_context(config: AgenticConfig) -> int | None:
    """The base model's positions, as the service's capabilities list them (None: not listed)."""
    service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
    for model in service.get_server_capabilities().supported_models:
        if model.model_name == config.base_model:
            return model.max_context_length
    return None


async def _warm_start_and_train(config: AgenticConfig, make_builder: Callable[..., AgenticGroupBuilder],
                                evaluator: HeldOutEvaluator, dataset: TaskDataset, cookbook_dir: Path,
                                emit: Callable[[LogRecord], None]) -> None:
    """With a warm start: the base model's held-out evaluation, the demonstrations and the supervised steps; then
    the cookbook loop, from the warm start's state when there is one."""
    if config.warm_start > 0:
        service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
        base = await service.create_sampling_client_async(base_model=config.base_model)
        await evaluator.evaluate(base, 0, Stage.BASE)
        started = time.monotonic()
        data = await demonstrations(make_tasks(config.seed, Split.TRAIN, config.families, config.warm_start),
                                    make_builder)
        record = await warm_start(
            service, config.base_model, data, steps=config.warm_start_steps, batch_size=config.warm_start_batch,
            learning_rate=config.warm_start_learning_rate, lora_rank=config.lora_rank,
            demo_s=time.monotonic() - started,
        )
        emit(record)
        resume_from(cookbook_dir, record.state_path)
    await cookbook_train.main(_cookbook_config(config, dataset, evaluator, cookbook_dir))


def train(config: AgenticConfig, on_record: Callable[[LogRecord], None] | None = None) -> list[LogRecord]:
    """Run the job against the service at `config.base_url`; returns its records (also in the JSONL log).

    Raises:
        NoSandbox: when there is no sandbox to run the episodes in (`backends.pick_backend`).
        FileExistsError: when the log's directory holds an earlier run's cookbook checkpoints.
        UnknownChatFormat: when the model's chat format is neither ChatML nor Gemma 3's.
    """
    # The cookbook resumes from a checkpoint it finds there, which would make this another run.
    if (config.log_path.parent / "cookbook" / checkpoint_utils.CHECKPOINTS_BASE_NAME).exists():
        raise FileExistsError(f"{config.log_path.parent} holds an earlier run; use a new --out")
    backend, make_sandbox = pick_backend(config.sandbox, SandboxLimits())
    logger.info("sandbox backend: %s", backend)
    started = time.monotonic()
    tokenizer = prepare_cookbook(config.base_model, config.tokenizer, config.api_key)
    renderer = renderer_for(tokenizer or tokenizer_utils.get_tokenizer(config.base_model))
    episode_renderer = ToolCallPrefill(renderer) if config.tool_call_prefill else renderer
    max_context = model_context(config)
    budget = episode_budget(config.max_trajectory_tokens, max_context)

    def make_builder(task: Task, group_size: int = config.group_size) -> AgenticGroupBuilder:
        return AgenticGroupBuilder(
            task, episode_renderer, make_sandbox, group_size=group_size, max_turns=config.max_turns,
            max_trajectory_tokens=budget, max_generation_tokens=config.max_generation_tokens,
        )

    records: list[LogRecord] = []
    config.log_path.parent.mkdir(parents=True, exist_ok=True)
    with config.log_path.open("w") as log:
        def emit(record: LogRecord) -> None:
            records.append(record)
            log.write(msgspec.json.encode(record).decode() + "\n")
            log.flush()
            if on_record is not None:
                on_record(record)

        emit(RunRecord(backend, config.base_model, [f.value for f in config.families], budget, max_context))
        train_tasks = make_tasks(config.seed, Split.TRAIN, config.families, config.train_tasks)
        dataset = TaskDataset(train_tasks, make_builder, config.groups_per_step)
        held_out = make_tasks(config.seed, Split.HELD_OUT, config.families, config.held_out_tasks)
        first_stage = Stage.WARM_START if config.warm_start > 0 else Stage.BASE
        evaluator = HeldOutEvaluator(held_out, make_builder, config, renderer, emit, started, first_stage=first_stage)
        cookbook_dir = config.log_path.parent / "cookbook"
        asyncio.run(_warm_start_and_train(config, make_builder, evaluator, dataset, cookbook_dir, emit))
        for step in step_records(cookbook_dir / "metrics.jsonl", dataset):
            emit(step)
        for comparison in comparisons([r for r in records if isinstance(r, EvalRecord)]):
            emit(comparison)
    return records
