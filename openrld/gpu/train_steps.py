"""The training calls every trainer engine makes the same way, written once.

The LoRA trainer (`torch_trainer`) and the full fine-tuning trainer (`full_trainer`)
differ in which tensors train and how they are found (an adapter by name, or the
whole model); from there on their calls are one story:
- `TrainingPasses` runs a pass of several requests through the shared `BatchScorer`
  and keeps the counts both report (`forward_backward_calls`, `tokens`);
- `forward_backward` is the pass of one request;
- `pass_then_step` is the pass and the optim_step after it in one engine call, so that
  an engine behind a worker protocol makes one round trip a step.

What it does not do: choose the trainable tensors, check the engine is resident, or
own an optimizer; the engine does those before and after.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, OptimParams, OptimResult
from openrld.engine_types import TrainerEngine
from openrld.gpu.scoring import BatchScorer, TrainerConfig


class TrainingPasses:
    """One model's training passes, and what they counted."""

    def __init__(self, model: torch.nn.Module, device: torch.device, config: TrainerConfig) -> None:
        self.scorer = BatchScorer(model, device, config)
        self.calls = 0  # requests run (forward_backward_calls)
        self.tokens = 0  # their model-input tokens

    def run(
        self, batches: Sequence[ForwardBackwardBatch], trainable: Iterable[torch.nn.Parameter]
    ) -> list[ForwardBackwardResult]:
        """Several requests in one pass, their gradients added to `trainable`; atomic.

        Each request keeps its own loss function, config, outputs and metrics; the
        gradient added is the sum of theirs. All requests must agree on `forward_only`.
        If any request fails, nothing is added and the first error is raised (the caller
        reruns the requests one by one to tell whose it was).

        Returns:
            One ForwardBackwardResult per request, in order: per datum, float32 lp with
            the shape of its target_tokens (pre-update weights), and the loss's metrics
            summed over the datums (`loss:sum` always).
        Raises:
            BadRequest / NotSupportedYet: see `losses.validate_request`, plus bad model
            inputs and a non-finite loss; no gradient is added in any of these cases.
        """
        results = self.scorer.forward_backward_many(batches, trainable)
        self.calls += len(batches)
        self.tokens += sum(len(datum.tokens) for batch in batches for datum in batch.data)
        return results


def forward_backward(engine: TrainerEngine, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
    """One request: the engine's `forward_backward_many` of it alone."""
    return engine.forward_backward_many(name, [batch])[0]


def pass_then_step(
    engine: TrainerEngine, name: str, batches: Sequence[ForwardBackwardBatch], params: OptimParams | None
) -> tuple[list[ForwardBackwardResult], OptimResult | Exception | None]:
    """An engine's `forward_backward_many`, then the `optim_step` after it (`params` not None).

    Returns (the pass's results, the step's OptimResult, or its exception, or None): a failed
    step leaves the pass's results standing. The pass's failure is raised.
    """
    results = engine.forward_backward_many(name, list(batches))
    if params is None:
        return results, None
    try:
        return results, engine.optim_step(name, params)
    except Exception as error:
        return results, error
