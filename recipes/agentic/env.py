"""The tasks as tinker-cookbook environments: one sandboxed episode per Env, a group per task.

`AgenticGroupBuilder.make_envs` gives each of `group_size` episodes its own sandbox
(from `make_sandbox`) and tools, and builds the Env with the cookbook's
`build_agent_tool_env`: the renderer's tool-call format, up to `max_turns` turns,
a trajectory token budget, and tool calls that do not parse answered with a
corrective message (`ParseErrorPolicy`) rather than ending the episode. The episode
ends when the model calls finish, replies without a tool call, or runs out of
turns or tokens; the deliverable is then graded by the rubric, and its score is
the reward. The cookbook's Env grades only the first three endings; an episode
that ended on a reply cut at its token budget (or a broken reply) is graded in
`compute_group_rewards`, so every episode is judged by what it left in scratch.
`cleanup` closes the sandboxes.

`TaskDataset` is the cookbook's `RLDataset` over a fixed list of tasks, taken in
order, `groups_per_batch` at a time, wrapping around.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from tinker_cookbook.renderers import Renderer
from tinker_cookbook.renderers.base import Message
from tinker_cookbook.rl.rollout_limits import ParseErrorPolicy
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset
from tinker_cookbook.tool_use import build_agent_tool_env

from recipes.agentic import rubric
from recipes.agentic.sandbox import Sandbox
from recipes.agentic.tasks import Task
from recipes.agentic.tools import WorkspaceTools, read_deliverable

SandboxFactory = Callable[[dict[str, str]], Sandbox]

SYSTEM_PROMPT = (
    "You are a legal assistant working in a workspace of documents. Use the tools to read the documents "
    "and to write the deliverable, then call finish. Call one tool per reply, like this:\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>'
)


def tool_signature(spec: dict) -> str:
    """`name(arg, arg=default): description`, from a tool's JSON schema."""
    properties = spec["parameters"].get("properties", {})
    required = set(spec["parameters"].get("required", []))
    args = [name if name in required else f"{name}={properties[name].get('default')!r}" for name in properties]
    return f"{spec['name']}({', '.join(args)}): {spec['description'].strip()}"


def initial_messages(renderer: Renderer, tools: WorkspaceTools, task: Task, *, full_schemas: bool) -> list[Message]:
    """The system prompt with the tools, then the task's instruction.

    `full_schemas` gives the renderer's own tool preamble (every JSON schema, ~700
    tokens). Without it the tools are one line each: SmolLM2-135M, given the full
    schemas, wrote no tool call at all in 16 sampled episodes.
    Either way the calls are the renderer's format, and parsed by it.
    """
    specs = [t.to_spec() for t in tools.all()]
    if full_schemas:
        prefix = renderer.create_conversation_prefix_with_tools(specs, SYSTEM_PROMPT)
    else:
        listing = "\n".join(f"- {tool_signature(spec)}" for spec in specs)
        prefix = [Message(role="system", content=f"{SYSTEM_PROMPT}\n\nTools:\n{listing}")]
    return [*prefix, Message(role="user", content=task.instruction)]


# Every reply starts as a tool call, its name left to the model. SmolLM2-135M-Instruct,
# shown the tools and an example call, wrote prose instead of a call in 28 of 28 sampled
# episodes: a group with no call has equal rewards, so RL has nothing to learn from.
TOOL_CALL_PREFILL = '<tool_call>\n{"name": "'
TOOL_CALL_END = "</tool_call>"


class ToolCallPrefill:
    """A renderer whose assistant replies begin with `prefill`, given rather than sampled,
    and end with the call.

    The prefill's tokens end the generation prompt (the observation), so the
    policy is trained on the rest of the reply only. Sampling also stops at the
    call's closing tag: left to run, SmolLM2 went on after it with prose or a
    second call until its token budget cut the reply, which ends the episode.
    `parse_response` puts the prefill back in front of the sampled tokens, and the
    end-of-message token after them when the closing tag stopped the reply, before
    the wrapped renderer parses the call. Everything else is the wrapped renderer's.
    """

    def __init__(self, renderer: Renderer, prefill: str = TOOL_CALL_PREFILL):
        self.renderer = renderer
        self.prefill = prefill
        self.prefill_tokens: list[int] = renderer.tokenizer.encode(prefill, add_special_tokens=False)
        self.end_tokens: list[int] = list(renderer.get_stop_sequences())
        assert self.end_tokens and all(isinstance(t, int) for t in self.end_tokens), \
            f"expected a renderer that stops on token ids, got {self.end_tokens!r}"

    def __getattr__(self, name: str):
        return getattr(self.renderer, name)

    def build_generation_prompt(self, messages: list[Message], role: str = "assistant", prefill: str | None = None):
        if prefill is None and role == "assistant":
            prefill = self.prefill
        return self.renderer.build_generation_prompt(messages, role, prefill)

    def get_stop_sequences(self) -> list[str]:
        # A stop list is all strings or all ids: the end-of-message tokens go in as their text.
        return [TOOL_CALL_END, *(self.renderer.tokenizer.decode([t]) for t in self.end_tokens)]

    def parse_response(self, response: list[int]):
        # A reply cut by its token budget gets no end token: the wrapped renderer calls it malformed.
        stopped_at_tag = (bool(response) and response[-1] not in self.end_tokens
                          and TOOL_CALL_END in self.renderer.tokenizer.decode(response))
        tail = [self.end_tokens[0]] if stopped_at_tag else []
        return self.renderer.parse_response([*self.prefill_tokens, *response, *tail])


class AgenticGroupBuilder(EnvGroupBuilder):
    """`group_size` episodes of one task, each in a sandbox of its own.

    Args:
        task: the task.
        renderer: renders messages and parses tool calls.
        make_sandbox: documents -> a fresh sandbox holding them.
        group_size: episodes of this task (the group whose mean reward is the baseline).
        max_turns: model replies per episode.
        max_trajectory_tokens: the whole episode's token budget, prompt included.
        max_generation_tokens: one reply's token budget.
        full_schemas: show the tools as the renderer's JSON-schema preamble (see `initial_messages`).
    """

    def __init__(
        self, task: Task, renderer: Renderer, make_sandbox: SandboxFactory, *, group_size: int, max_turns: int,
        max_trajectory_tokens: int, max_generation_tokens: int, full_schemas: bool = False,
    ):
        self.task = task
        self.renderer = renderer
        self.make_sandbox = make_sandbox
        self.group_size = group_size
        self.max_turns = max_turns
        self.max_trajectory_tokens = max_trajectory_tokens
        self.max_generation_tokens = max_generation_tokens
        self.full_schemas = full_schemas
        self.sandboxes: list[Sandbox] = []
        self.grades: list[rubric.Grade | None] = []  # per env, set when its episode is graded
        self.deliverables: list[str | None] = []  # per env, what the grader read

    def _grade(self, index: int) -> rubric.Grade:
        content = read_deliverable(self.sandboxes[index], self.task.deliverable)
        grade = rubric.grade(self.task.expected, content)
        self.grades[index], self.deliverables[index] = grade, content
        return grade

    def _reward_fn(self, index: int):
        async def reward(_history: list[Message]) -> tuple[float, dict[str, float]]:
            grade = await asyncio.to_thread(self._grade, index)
            return grade.score, {"success": float(grade.success), "score": grade.score}

        return reward

    async def compute_group_rewards(self, trajectory_group, env_group) -> list[tuple[float, dict[str, float]]]:
        """The rubric's score for episodes the Env ended without grading (their step rewards are 0); 0 for the rest."""
        rewards = []
        for index in range(len(env_group)):
            if self.grades[index] is not None:
                rewards.append((0.0, {}))
                continue
            grade = await asyncio.to_thread(self._grade, index)
            rewards.append((grade.score, {"success": float(grade.success), "score": grade.score}))
        return rewards

    async def make_envs(self) -> Sequence[Env]:
        envs = []
        for index in range(self.group_size):
            sandbox = self.make_sandbox(self.task.documents)
            self.sandboxes.append(sandbox)
            self.grades.append(None)
            self.deliverables.append(None)
            tools = WorkspaceTools(sandbox)
            envs.append(build_agent_tool_env(
                renderer=self.renderer, tools=tools.all(),
                initial_messages=initial_messages(self.renderer, tools, self.task, full_schemas=self.full_schemas),
                reward_fn=self._reward_fn(index), max_turns=self.max_turns,
                max_trajectory_tokens=self.max_trajectory_tokens, max_generation_tokens=self.max_generation_tokens,
                # A reply cut at its token budget still ends the episode and is graded by what it left.
                failed_parse_reward=0.0, context_overflow_reward=0.0,
                parse_error_policy=ParseErrorPolicy(max_consecutive=2),
            ))
        return envs

    async def cleanup(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.close()
        self.sandboxes = []

    def logging_tags(self) -> list[str]:
        return ["agentic", self.task.family.value]


class TaskDataset(RLDataset):
    """Batches of group builders over `tasks`, in order, wrapping around.

    It keeps each batch's builders in the order asked for (`batches`: the training
    loop asks once per step), whose grades say which episodes of that step
    succeeded; a builder holds no sandbox once its group is cleaned up.
    """

    def __init__(self, tasks: list[Task], make_builder: Callable[[Task], AgenticGroupBuilder], groups_per_batch: int):
        self.tasks = tasks
        self.make_builder = make_builder
        self.groups_per_batch = groups_per_batch
        self.batches: list[list[AgenticGroupBuilder]] = []

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.groups_per_batch
        builders = [self.make_builder(self.tasks[(start + k) % len(self.tasks)]) for k in range(self.groups_per_batch)]
        self.batches.append(builders)
        return builders

    def _grades(self, step: int) -> list[rubric.Grade | None]:
        builders = self.batches[step] if step < len(self.batches) else []
        return [grade for builder in builders for grade in builder.grades]

    def success_rate(self, step: int) -> float:
        """The share of the `step`-th batch's episodes whose deliverable passed every check."""
        grades = self._grades(step)
        return sum(g is not None and g.success for g in grades) / len(grades) if grades else 0.0

    def mean_reward(self, step: int) -> float:
        """The mean rubric score of the `step`-th batch's episodes (an ungraded one scores 0)."""
        grades = self._grades(step)
        return sum(g.score for g in grades if g is not None) / len(grades) if grades else 0.0

    def __len__(self) -> int:
        return max(1, len(self.tasks) // self.groups_per_batch)
