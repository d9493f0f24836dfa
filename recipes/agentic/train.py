"""The agentic RL loop: sandboxed multi-turn episodes, rubric rewards, importance-sampling steps.

Built from tinker-cookbook's pieces: `do_group_rollout` runs each group's Envs
(`env.AgenticGroupBuilder`) against a `TinkerTokenCompleter`, `compute_advantages`
centres rewards within each group, `remove_constant_reward_groups` drops groups
that carry no signal, and `assemble_training_data` turns trajectories into Datums
(only the model's own tokens carry advantages). Each step then sends one
`forward_backward` with the `importance_sampling` loss and one Adam `optim_step`
through the public tinker SDK, and appends a `StepRecord` to the JSONL log. Every
`eval_every` steps (and at step 0 and the last step) it samples one episode of each
held-out task and records the held-out success rate.

Why not the cookbook's `rl.train.main`: it resolves the tokenizer and renderer from
the model's Hub name (a download this offline machine cannot make), sets up its own
logging stores and checkpoint paths, and reads the dataset through a chz builder.
This loop passes the tokenizer, renderer and tasks in directly, and is otherwise
the same sync RL step. Nothing in it is specific to openrld: any Tinker-API
service at `base_url` serves it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker import types
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.rl.data_processing import (
    assemble_training_data,
    compute_advantages,
    remove_constant_reward_groups,
)
from tinker_cookbook.rl.rollouts import do_group_rollout

from recipes.agentic import judge
from recipes.agentic.backends import pick_backend
from recipes.agentic.env import AgenticGroupBuilder, TaskDataset
from recipes.agentic.sandbox import SandboxLimits
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.quickstart.train import load_tokenizer

logger = logging.getLogger(__name__)

# SmolLM2's chat format is ChatML, which the cookbook's Qwen3 instruct renderer writes
# (<|im_start|>role ... <|im_end|>), with tool calls as <tool_call>{json}</tool_call>.
RENDERER = "qwen3_instruct"


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
    eval_every: int = 5  # steps between held-out evaluations (also at the first and last step)
    max_turns: int = 4  # read, write, finish, and one spare
    max_generation_tokens: int = 64  # the write_file call with a date is ~35 SmolLM2 tokens
    max_trajectory_tokens: int = 2048  # the system prompt with the tools' schemas is ~700
    learning_rate: float = 4e-4
    lora_rank: int = 16
    # Below 1: at 1.0 SmolLM2-135M wrote no tool call in 28 episodes (rambling text instead).
    # The sampler's logprobs are then those of the tempered policy, a known bias of the
    # importance weights that a short run tolerates.
    temperature: float = 0.7
    seed: int = 0
    sandbox: str = "auto"  # "auto", "bwrap" or "agent-sandbox"
    time_limit_s: float | None = None  # the first step that starts past it is the last (and is evaluated)
    tokenizer: str | None = None  # a local tokenizer directory; None: the packaged GGUF's
    judge_model: str | None = None  # a base model on the same service to judge held-out deliverables
    log_path: Path = Path("agentic_out/records.jsonl")


class StepRecord(msgspec.Struct, frozen=True):
    step: int
    mean_reward: float  # mean rubric score of the step's episodes
    success_rate: float  # episodes whose deliverable passed every check
    mean_turns: float
    groups_used: int  # groups whose rewards differed, so they gave a gradient
    datums: int
    held_out_success: float | None  # None on steps without an evaluation
    judge_agreement: float | None  # the judge's verdicts equal to the exact checks' (None: no judge run)
    sandbox_backend: str
    elapsed_s: float


class EpisodeStats(msgspec.Struct, frozen=True):
    rewards: list[float]
    successes: list[bool]
    turns: list[int]


def _episode_stats(builders: list[AgenticGroupBuilder], groups) -> EpisodeStats:
    rewards, successes, turns = [], [], []
    for builder, group in zip(builders, groups):
        rewards += group.get_total_rewards()
        successes += [grade is not None and grade.success for grade in builder.grades]
        turns += [len(t.transitions) for t in group.trajectories_G]
    return EpisodeStats(rewards, successes, turns)


async def rollouts(builders: list[AgenticGroupBuilder], policy: TinkerTokenCompleter):
    """Every group's episodes, all in flight at once."""
    return await asyncio.gather(*[do_group_rollout(b, policy) for b in builders])


async def evaluate_held_out(
    sampler, make_builder: Callable[[Task, int], AgenticGroupBuilder], tasks: list[Task], config: AgenticConfig,
    judge_sampler=None, renderer=None,
) -> tuple[float, float | None]:
    """(share of held-out tasks whose one sampled episode passes every check, judge agreement or None)."""
    builders = [make_builder(task, 1) for task in tasks]
    policy = TinkerTokenCompleter(sampler, max_tokens=config.max_generation_tokens, temperature=config.temperature)
    stats = _episode_stats(builders, await rollouts(builders, policy))
    success = sum(stats.successes) / len(stats.successes)
    if judge_sampler is None:
        return success, None
    verdicts = await judge.judge_all(judge_sampler, renderer, [(b.task, b.deliverables[0]) for b in builders])
    agreed = judge.agreement(verdicts, stats.successes)
    logger.info("judge agreement %d/%d (judge passed %d, exact passed %d, unparsed %d)", agreed.agreed,
                agreed.episodes, agreed.judge_passed, agreed.exact_passed, agreed.unparsed)
    return success, agreed.rate


async def train_step(training, sampler, builders: list[AgenticGroupBuilder], config: AgenticConfig):
    """One RL step on `builders`' groups; returns (episode stats, groups used, datums sent)."""
    policy = TinkerTokenCompleter(sampler, max_tokens=config.max_generation_tokens, temperature=config.temperature)
    groups = await rollouts(builders, policy)
    stats = _episode_stats(builders, groups)
    # The cookbook keeps one uniform group when all are uniform; that group has no signal either.
    informative = [g for g in remove_constant_reward_groups(groups) if len(set(g.get_total_rewards())) > 1]
    data, _ = assemble_training_data(informative, compute_advantages(informative)) if informative else ([], [])
    # The cookbook's own train step drops the mask: the loss takes advantages, not a mask.
    data = [dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})
            for d in data]
    if data:
        await training.forward_backward(data, "importance_sampling")
        await training.optim_step(types.AdamParams(learning_rate=config.learning_rate))
    return stats, len(informative), len(data)


class Run(msgspec.Struct, kw_only=True):
    """What a run holds once it is set up: clients, renderer, tasks, and how to build a group."""

    backend: str
    training: object  # tinker.TrainingClient
    renderer: object  # tinker_cookbook Renderer
    judge_sampler: object | None  # tinker.SamplingClient of config.judge_model
    make_builder: Callable[..., AgenticGroupBuilder]
    dataset: TaskDataset
    held_out: list[Task]


async def set_up(service: tinker.ServiceClient, config: AgenticConfig) -> Run:
    """Pick the sandbox backend, create the LoRA client (and the judge's), and generate the tasks."""
    backend, make_sandbox = pick_backend(config.sandbox, SandboxLimits())
    logger.info("sandbox backend: %s", backend)
    training = await service.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed)
    renderer = get_renderer(RENDERER, load_tokenizer(training, config.base_model, config.tokenizer))
    judge_sampler = None
    if config.judge_model is not None:  # the judge shares the renderer: a model of the same family
        judge_sampler = await service.create_sampling_client(base_model=config.judge_model)

    def make_builder(task: Task, group_size: int = config.group_size) -> AgenticGroupBuilder:
        return AgenticGroupBuilder(
            task, renderer, make_sandbox, group_size=group_size, max_turns=config.max_turns,
            max_trajectory_tokens=config.max_trajectory_tokens, max_generation_tokens=config.max_generation_tokens,
        )

    train_tasks = make_tasks(config.seed, Split.TRAIN, config.families, config.train_tasks)
    return Run(
        backend=backend, training=training, renderer=renderer, judge_sampler=judge_sampler,
        make_builder=make_builder, dataset=TaskDataset(train_tasks, make_builder, config.groups_per_step),
        held_out=make_tasks(config.seed, Split.HELD_OUT, config.families, config.held_out_tasks),
    )


async def run_step(run: Run, step: int, *, evaluate: bool, config: AgenticConfig, elapsed_s: Callable[[], float]):
    """One step: fresh sampler weights, the held-out evaluation if due, the RL update; its record."""
    sampler = await run.training.save_weights_and_get_sampling_client()
    evaluated, judged = None, None
    if evaluate:
        evaluated, judged = await evaluate_held_out(sampler, run.make_builder, run.held_out, config,
                                                    run.judge_sampler, run.renderer)
    stats, groups_used, datums = await train_step(run.training, sampler, run.dataset.get_batch(step), config)
    return StepRecord(
        step=step, mean_reward=sum(stats.rewards) / len(stats.rewards),
        success_rate=sum(stats.successes) / len(stats.successes), mean_turns=sum(stats.turns) / len(stats.turns),
        groups_used=groups_used, datums=datums, held_out_success=evaluated, judge_agreement=judged,
        sandbox_backend=run.backend, elapsed_s=elapsed_s(),
    )


async def train_async(config: AgenticConfig, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
    try:
        run = await set_up(service, config)
        records: list[StepRecord] = []
        config.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        elapsed_s = lambda: time.monotonic() - started  # noqa: E731
        with config.log_path.open("w") as log:
            for step in range(config.steps):
                # Out of time: this is the last step, so it carries the final held-out evaluation.
                out_of_time = config.time_limit_s is not None and elapsed_s() >= config.time_limit_s
                is_last = step == config.steps - 1 or out_of_time
                record = await run_step(run, step, evaluate=step % config.eval_every == 0 or is_last, config=config,
                                        elapsed_s=elapsed_s)
                records.append(record)
                log.write(msgspec.json.encode(record).decode() + "\n")
                log.flush()
                if on_step is not None:
                    on_step(record)
                if out_of_time:
                    logger.info("time limit %.0f s reached; step %d was the last", config.time_limit_s, step)
                    break
        return records
    finally:
        await service.close("success")


def train(config: AgenticConfig, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run the loop against the service at `config.base_url`; returns one record per step."""
    return asyncio.run(train_async(config, on_step))
