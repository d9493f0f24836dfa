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
- the episodes' renderer: the model's own, with every reply begun as a tool
  call (`env.ToolCallPrefill`) unless `tool_call_prefill` is off; the judge
  gets the plain one;
- the held-out evaluator (`HeldOutEvaluator`): one episode per held-out task,
  success meaning every rubric check passed, and optionally the LLM judge's
  agreement with those checks. The loop calls it after 0, `eval_every`,
  2 x `eval_every`, ... steps and after the last one; each call's `EvalRecord`
  goes to the job's JSONL log as it comes.
When the loop is done the log gets one `StepRecord` per step from the cookbook's
metrics. Nothing here is specific to openrld: any Tinker-API service will do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.renderers import Renderer, get_renderer
from tinker_cookbook.rl import train as cookbook_train
from tinker_cookbook.rl.rollouts import do_group_rollout

from recipes.agentic import judge
from recipes.agentic.backends import pick_backend
from recipes.agentic.env import AgenticGroupBuilder, TaskDataset, ToolCallPrefill
from recipes.agentic.sandbox import SandboxLimits
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.cookbook_offline import cookbook_config, prepare_cookbook, rollout_rows

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
    eval_every: int = 5  # steps between held-out evaluations (also before the first and after the last)
    max_turns: int = 4  # read, write, finish, and one spare
    max_generation_tokens: int = 64  # the write_file call with a date is ~35 SmolLM2 tokens
    max_trajectory_tokens: int = 2048  # the system prompt and instruction are ~350
    learning_rate: float = 1e-3  # LoRA on SmolLM2 in the SQL sweep: 1e-3 and 2e-3 learned, 4e-3 collapsed
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
    log_path: Path = Path("agentic_out/records.jsonl")


class RunRecord(msgspec.Struct, frozen=True, tag="run"):
    sandbox_backend: str  # "bwrap" or "agent-sandbox"
    base_model: str
    families: list[str]


class EvalRecord(msgspec.Struct, frozen=True, tag="eval"):
    step: int  # training steps taken before this evaluation
    held_out_success: float  # held-out tasks whose one episode passed every check
    successes: list[bool]  # per held-out task, in task order
    judge_agreement: float | None  # the judge's verdicts equal to the exact checks' (None: no judge)
    elapsed_s: float


class StepRecord(msgspec.Struct, frozen=True, tag="step"):
    step: int
    mean_reward: float  # mean rubric score of the step's episodes
    success_rate: float  # episodes whose deliverable passed every check
    mean_turns: float
    elapsed_s: float  # the cookbook's time for the step


LogRecord = RunRecord | EvalRecord | StepRecord


def eval_steps(steps: int, eval_every: int) -> list[int]:
    """The steps after which the cookbook loop calls its evaluators, in order: multiples of eval_every, and the last."""
    return [s for s in range(steps + 1) if s % eval_every == 0 or s == steps]


class HeldOutEvaluator(SamplingClientEvaluator):
    """Held-out success (and the judge's agreement) at each of the loop's evaluation points."""

    def __init__(self, tasks: list[Task], make_builder: Callable[..., AgenticGroupBuilder], config: AgenticConfig,
                 renderer: Renderer, emit: Callable[[EvalRecord], None], started: float):
        self.tasks, self.make_builder, self.config, self.renderer = tasks, make_builder, config, renderer
        self.emit = emit
        self.started = started
        self.pending_steps = eval_steps(config.steps, config.eval_every)
        self.judge_sampler = None

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        step = self.pending_steps.pop(0)
        builders = [self.make_builder(task, 1) for task in self.tasks]
        policy = TinkerTokenCompleter(sampling_client, max_tokens=self.config.max_generation_tokens,
                                      temperature=self.config.temperature)
        await asyncio.gather(*[do_group_rollout(b, policy) for b in builders])
        successes = [b.grades[0].success for b in builders]  # every episode is graded (AgenticGroupBuilder)
        agreement = await self._judge([(b.task, b.deliverables[0]) for b in builders], successes)
        success = sum(successes) / len(successes)
        self.emit(EvalRecord(step, success, successes, agreement, time.monotonic() - self.started))
        metrics = {"held_out/success": success}
        return metrics if agreement is None else {**metrics, "held_out/judge_agreement": agreement}

    async def _judge(self, items: list[tuple[Task, str | None]], successes: list[bool]) -> float | None:
        if self.config.judge_model is None:
            return None
        if self.judge_sampler is None:
            service = tinker.ServiceClient(base_url=self.config.base_url, api_key=self.config.api_key)
            self.judge_sampler = await service.create_sampling_client(base_model=self.config.judge_model)
        agreed = judge.agreement(await judge.judge_all(self.judge_sampler, self.renderer, items), successes)
        logger.info("judge agreement %d/%d (judge passed %d, exact passed %d, unparsed %d)", agreed.agreed,
                    agreed.episodes, agreed.judge_passed, agreed.exact_passed, agreed.unparsed)
        return agreed.rate


def step_records(metrics_path: Path, dataset: TaskDataset) -> list[StepRecord]:
    """The cookbook's per-step metrics (the rows with rollout rewards) as StepRecords, with each step's successes.

    Success comes from the step's own builders, not the metrics: the cookbook averages
    an episode metric only over the episodes that report it.
    """
    return [
        StepRecord(
            row["step"], row["env/all/reward/total"], dataset.success_rate(row["step"]),
            row.get("env/all/turns_per_episode", 0.0), row.get("time/total", 0.0),
        )
        for row in rollout_rows(metrics_path)
    ]


def _cookbook_config(config: AgenticConfig, dataset: TaskDataset, evaluator: HeldOutEvaluator,
                     log_dir: Path) -> cookbook_train.Config:
    return cookbook_config(
        dataset, evaluator, log_dir, steps=config.steps, learning_rate=config.learning_rate,
        model_name=config.base_model, recipe_name="openrld_agentic", max_tokens=config.max_generation_tokens,
        eval_every=config.eval_every, base_url=config.base_url, loss_fn="importance_sampling",
        lora_rank=config.lora_rank, temperature=config.temperature,
    )


def train(config: AgenticConfig, on_record: Callable[[LogRecord], None] | None = None) -> list[LogRecord]:
    """Run the job against the service at `config.base_url`; returns its records (also in the JSONL log)."""
    backend, make_sandbox = pick_backend(config.sandbox, SandboxLimits())
    logger.info("sandbox backend: %s", backend)
    started = time.monotonic()
    tokenizer = prepare_cookbook(config.base_model, config.tokenizer, config.api_key)
    renderer = get_renderer(RENDERER, tokenizer or tokenizer_utils.get_tokenizer(config.base_model))
    episode_renderer = ToolCallPrefill(renderer) if config.tool_call_prefill else renderer

    def make_builder(task: Task, group_size: int = config.group_size) -> AgenticGroupBuilder:
        return AgenticGroupBuilder(
            task, episode_renderer, make_sandbox, group_size=group_size, max_turns=config.max_turns,
            max_trajectory_tokens=config.max_trajectory_tokens, max_generation_tokens=config.max_generation_tokens,
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

        emit(RunRecord(backend, config.base_model, [f.value for f in config.families]))
        train_tasks = make_tasks(config.seed, Split.TRAIN, config.families, config.train_tasks)
        dataset = TaskDataset(train_tasks, make_builder, config.groups_per_step)
        held_out = make_tasks(config.seed, Split.HELD_OUT, config.families, config.held_out_tasks)
        evaluator = HeldOutEvaluator(held_out, make_builder, config, renderer, emit, started)
        cookbook_dir = config.log_path.parent / "cookbook"
        # The cookbook resumes from a checkpoint it finds there, which would make this another run.
        assert not (cookbook_dir / "checkpoints.jsonl").exists(), f"{cookbook_dir} holds an earlier run; use a new --out"
        asyncio.run(cookbook_train.main(_cookbook_config(config, dataset, evaluator, cookbook_dir)))
        for record in step_records(cookbook_dir / "metrics.jsonl", dataset):
            emit(record)
    return records
