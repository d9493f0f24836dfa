"""The training calls every trainer engine makes the same way, written once.

The LoRA trainer (`torch_trainer`) and the full fine-tuning trainer (`full_trainer`)
differ in which tensors train and how they are found (an adapter by name, or the
whole model); from there on their calls are one story:
- `TrainingPasses` runs a pass of several requests through the shared `BatchScorer`
  and keeps the counts both report (`forward_backward_calls`, `tokens`);
- `TrainsInPasses` is the engine's training calls over it: `forward_backward_many`, and
  `forward_backward` as the pass of one request; `optim_step`, which refuses params of
  another family than the model's optimizer (the gradient kept) and steps it; and
  `forward_backward_then_step` over these, every trainer's (`engine_types.StepsAfterPasses`),
  so that an engine behind a worker protocol makes one round trip a step.

What it does not do: choose the trainable tensors or the optimizer, check the engine is
resident, or own an optimizer's state; the engine names those (`_trainable`, `_stepper`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, OptimParams, OptimResult
from openrld.engine_types import StepsAfterPasses
from openrld.errors import BadRequest
from openrld.gpu import gated_mlp
from openrld.gpu.optim import Optimizer, family_of
from openrld.gpu.scoring import BatchScorer, TrainerConfig


class TrainingPasses:
    """One model's training passes, and what they counted."""

    def __init__(self, model: torch.nn.Module, device: torch.device, config: TrainerConfig) -> None:
        gated_mlp.fuse(model)  # before the scorer measures what a token keeps for backward
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


class TrainsInPasses(StepsAfterPasses):
    """`forward_backward`, `forward_backward_many`, `forward_backward_then_step` and
    `optim_step` of an engine whose `_passes` (a TrainingPasses) run its passes.

    A mixin with no state of its own, as `offload.ParksInSlot` is, so that the calls are
    written once: the engine names, for a model `name`, the tensors that train
    (`_trainable`) and the optimizer that steps them (`_stepper`), each after its own
    checks (the name is known, the engine is resident); these are its training calls.
    """

    _passes: TrainingPasses

    def _trainable(self, name: str) -> Iterable[torch.nn.Parameter]:
        """The tensors `name`'s pass adds gradients to, ready for it (checked, active).

        Raises:
            NotFound: no model `name`.  EngineParked: the engine is parked.
        """
        raise NotImplementedError

    def _stepper(self, name: str) -> tuple[str, Optimizer]:
        """`name`'s optimizer family and its optimizer, checked as `_trainable` is."""
        raise NotImplementedError

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        """Score every datum's targets and, unless `batch.forward_only`, add ∇ of the loss
        to `name`'s gradients. As `forward_backward_many` of one request."""
        return self.forward_backward_many(name, [batch])[0]

    def forward_backward_many(self, name: str, batches: Sequence[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        """Several requests of one model in one pass: their datums share micro-batches;
        atomic (`TrainingPasses.run`). Raises NotFound for an unknown model."""
        return self._passes.run(batches, self._trainable(name))

    # forward_backward_then_step: engine_types.StepsAfterPasses, over these.

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        """One step of `name`'s optimizer with its accumulated gradients.

        Returns:
            {"grad_norm:mean", "learning_rate:mean"}.
        Raises:
            NotFound; BadRequest for params of another family than the model's (gradients
            kept), invalid params or a non-finite gradient norm (optim.py).
        """
        family, optimizer = self._stepper(name)
        if family_of(params) != family:
            expected = "AdamParams" if family == "adamw" else "DimuonParams"
            version = " (version 1)" if family == "dimuon" else ""
            raise BadRequest(
                f"optimizer mismatch: model {name} uses {family!r}{version} but this optim_step sent "
                f"{type(params).__name__}; send {expected}",
                key="optimizer",
            )
        return OptimResult(metrics=optimizer.step(params))  # type: ignore[arg-type]
