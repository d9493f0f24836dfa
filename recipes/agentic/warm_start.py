"""The warm start: demonstrations by the scripted expert, and supervised training on them before RL.

`demonstrations` plays the expert (`expert.ExpertCompleter`) on train tasks
through the recipe's own group builder (the renderer, the tools, a sandbox per
episode, the rubric) and keeps each episode whose deliverable passed every
check, as cross-entropy datums: the whole conversation the policy would see,
with weight 1 on the tokens of the assistant's replies and 0 on everything else
(system prompt, instruction, the reply prefill, tool answers). A held-out task is
refused, so nothing the recipe evaluates on is ever imitated.

`warm_start` trains a fresh LoRA adapter on them through the SDK
(`forward_backward` with `cross_entropy`, then an Adam `optim_step`, for a
number of steps over batches taken in turn), saves its state and returns the
`tinker://` path the RL loop starts from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import tinker
from tinker import TensorData
from tinker_cookbook.rl.data_processing import trajectory_to_data
from tinker_cookbook.rl.rollouts import do_group_rollout

from recipes.agentic.env import AgenticGroupBuilder
from recipes.agentic.expert import ExpertCompleter
from recipes.agentic.tasks import Split, Task

logger = logging.getLogger(__name__)


class WarmStartRecord(msgspec.Struct, frozen=True, tag="warm_start"):
    demonstrations: int  # N: expert episodes trained on, each a solved train task
    steps: int  # forward_backward + optim_step pairs
    batch_size: int  # demonstrations per step
    learning_rate: float
    losses: list[float]  # per step: the mean cross-entropy per weighted (assistant) token
    demo_s: float  # playing the expert in the sandboxes
    train_s: float  # the steps and the save
    state_path: str  # tinker:// path of the saved state the RL loop loads


def split_of(task: Task) -> Split:
    return Split(task.task_id.split("/", 1)[0])


def sft_datum(datum: tinker.Datum) -> tinker.Datum:
    """A cookbook RL datum (`trajectory_to_data`) as a cross-entropy one: its action mask becomes the weights."""
    return tinker.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"],
                        "weights": TensorData.from_torch(datum.loss_fn_inputs["mask"].to_torch().float())},
    )


async def demonstrations(tasks: list[Task], make_builder: Callable[[Task, int], AgenticGroupBuilder]) -> list[tinker.Datum]:
    """The expert's solved episode of each task, as cross-entropy datums (one per episode here).

    Raises:
        ValueError: for a held-out task.
        RuntimeError: when the expert fails a task (its episode is not a demonstration).
    """
    for task in tasks:
        if split_of(task) is not Split.TRAIN:
            raise ValueError(f"demonstrations come from train tasks only, got {task.task_id}")
    builders = [make_builder(task, 1) for task in tasks]
    groups = await asyncio.gather(*[
        do_group_rollout(builder, ExpertCompleter(builder.task.family, builder.renderer)) for builder in builders
    ])
    data: list[tinker.Datum] = []
    for builder, group in zip(builders, groups):
        grade = builder.grades[0]
        if grade is None or not grade.success:
            raise RuntimeError(f"the expert failed {builder.task.task_id}: {grade}, deliverable "
                               f"{builder.deliverables[0]!r}")
        # Advantage 1 on every reply: only the mask is kept, as the weights.
        data.extend(sft_datum(d) for d in trajectory_to_data(group.trajectories_G[0], 1.0, include_provenance=False))
    return data


async def warm_start(service: tinker.ServiceClient, base_model: str, data: list[tinker.Datum], *, steps: int,
                     batch_size: int, learning_rate: float, lora_rank: int, demo_s: float) -> WarmStartRecord:
    """Train a LoRA adapter of `lora_rank` on `data` for `steps` steps; save its state. Returns the record."""
    started = time.monotonic()
    client = await service.create_lora_training_client_async(base_model, rank=lora_rank)
    losses = []
    for step in range(steps):
        first = step * batch_size
        batch = [data[(first + k) % len(data)] for k in range(min(batch_size, len(data)))]
        backward = client.forward_backward(batch, "cross_entropy")
        optim = client.optim_step(tinker.AdamParams(learning_rate=learning_rate))  # queued behind it
        metrics = (await backward).metrics
        await optim
        losses.append(metrics["loss:sum"] / max(metrics["tokens:sum"], 1.0))
        logger.info("warm start step %d/%d loss_per_token %.4f", step + 1, steps, losses[-1])
    saved = await client.save_state("warm-start")
    return WarmStartRecord(len(data), steps, batch_size, learning_rate, losses, demo_s,
                           time.monotonic() - started, saved.path)
