"""Training passes over the data-parallel ranks of a sharded (FSDP2) model, in lock step.

The Automodel trainer's counterpart of `train_steps.TrainingPasses`: the same validation
(`losses.validate_request`, `BatchScorer.check_model_inputs`), the same log-probabilities
(`BatchScorer`'s chunked fp32 log-softmax) and the same loss functions (`losses.LOSSES`,
called exactly as `scoring` calls them), but with the datums split over the ranks.

How a pass runs on N data-parallel ranks:
- every rank validates the whole request, so a bad request fails on every rank alike,
  before any compute;
- the datums are planned into micro-batches once (`plan_micro_batches`, the same plan
  on every rank), and micro-batch k goes to rank k mod N. Rounds follow: in each, every
  rank scores its micro-batch, or runs an empty one (one token, loss 0·Σlogits) when it
  has none left, because FSDP's all-gathers and reduce-scatters are collectives and
  every rank must run the same number of forwards and backwards;
- before each backward the ranks agree that every loss is finite: a rank whose loss is
  not raises its `BadRequest`; the others stop too and add nothing (every rank's earlier
  gradients are set aside and put back, `scoring.gradients_set_aside`), so a failed
  request adds no gradient anywhere;
- after every pass, every FSDP unit frees its gathered weights (`_reshard`): a forward
  with no backward after it would otherwise leave some units on stale whole weights;
- FSDP sums the ranks' gradients (its divide factor is set to 1 by the trainer), and
  every loss is a sum over datums, so the gradient is the one-process gradient; the
  metrics are summed over the ranks and the log-probabilities gathered to rank 0, in
  datum order. Only rank 0's results are whole; the worker returns only rank 0's.

With context parallelism (cp = C > 1, `automodel_cp`), the N ranks are N/C data-parallel
groups of C: a micro-batch goes to a cp group (dp rank = rank // C), whose C ranks score it
together, its datums packed into one sequence split over them; micro-batches are planned
by `plan_packed_micro_batches`, `max_batch_tokens` bounding each rank's part of a pack
(packed length / C), so a datum up to C times the budget fits. Every rank of a cp group
computes the same, whole loss and backpropagates 1/C of it (see `_backward`); empty rounds
are whole cp groups running the empty pass; only each cp group's first rank reports
metrics and log-probabilities (the others hold the same ones).

What it does not do: ordering, trio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult
from openrld.errors import BadRequest
from openrld.gpu import losses
from openrld.gpu.automodel_cp import ContextParallelScorer, plan_packed_micro_batches
from openrld.gpu.automodel_shards import gather_bytes
from openrld.gpu.scoring import BatchScorer, TrainerConfig, gradients_set_aside, plan_micro_batches

__all__ = ["ShardedPasses"]


class _PeerFailed(Exception):
    """Another rank's loss was not finite: this rank stops its pass too, adding nothing."""


class _RankLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """What one rank scored, for rank 0: (request, datum, shape, float32 bytes) per datum."""

    datums: list[tuple[int, int, list[int], bytes]]


class ShardedPasses:
    """One sharded model's training passes over `dp` data-parallel ranks, and what they counted.

    Args:
        model: the FSDP2 root module (a causal LM in eval mode).
        device: this rank's device.
        config: memory knobs; `chunked_head` must be off (the output layer is its own FSDP
            unit, so it runs only inside the root module's forward).
        dp_rank, dp_size: this rank's place among the data-parallel ranks.
        cp_mesh: this rank's cp group (`load_sharded`'s), when cp > 1; None scores each datum on one rank.
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, config: TrainerConfig, dp_rank: int, dp_size: int,
        cp_mesh: DeviceMesh | None = None,
    ) -> None:
        assert not config.chunked_head, "a sharded model's output layer runs inside its root forward only"
        if cp_mesh is None:
            self.scorer = BatchScorer(model, device, config)
        else:
            self.scorer = ContextParallelScorer(model, device, config, cp_mesh)
        self._cp = 1 if cp_mesh is None else cp_mesh.size()
        self._reports = cp_mesh is None or cp_mesh.get_local_rank() == 0  # metrics and lp, once per cp group
        self._model = model
        self._device = device
        self._dp_rank = dp_rank
        self._dp_size = dp_size
        self.calls = 0  # requests run (forward_backward_calls)
        self.tokens = 0  # their model-input tokens

    def run(
        self, batches: Sequence[ForwardBackwardBatch], trainable: Iterable[torch.nn.Parameter]
    ) -> list[ForwardBackwardResult]:
        """`train_steps.TrainingPasses.run`, with the datums split over the ranks (module docstring).

        Returns:
            On rank 0, one ForwardBackwardResult per request, whole; on the others, results
            that hold only their own datums' log-probabilities and metrics (never sent).
        Raises:
            BadRequest / NotSupportedYet: as `TrainingPasses.run`, on every rank for a bad
                request; for a non-finite loss, on the rank that computed it.
        """
        forward_only = batches[0].forward_only
        assert all(b.forward_only == forward_only for b in batches), "forward_backward_many mixes forward_only"
        requests = []
        for batch in batches:
            self.scorer.check_model_inputs(batch.data)
            requests.append(
                losses.validate_request(batch.loss_fn, batch.data, batch.loss_config, vocab_size=self.scorer.vocab_size)
            )
        guard = contextlib.nullcontext() if forward_only else gradients_set_aside(list(trainable))
        try:
            with guard, torch.set_grad_enabled(not forward_only):
                logprobs, metrics = self._rounds(batches, requests)
        except _PeerFailed:
            return [ForwardBackwardResult(logprobs=[], metrics={}) for _ in batches]
        finally:
            self._reshard()
        self.calls += len(batches)
        self.tokens += sum(len(datum.tokens) for batch in batches for datum in batch.data)
        return self._gathered(batches, requests, logprobs, metrics)

    def _rounds(
        self, batches: Sequence[ForwardBackwardBatch], requests: Sequence[losses.CheckedRequest]
    ) -> tuple[list[list[np.ndarray | None]], list[dict[str, float]]]:
        """Score this rank's micro-batches, one per round, with a backward after each agreed loss."""
        entries = [(r, i) for r, batch in enumerate(batches) for i in range(len(batch.data))]
        lengths = [len(batches[r].data[i].tokens) for r, i in entries]
        if self._cp == 1:
            plan = plan_micro_batches(lengths, self.scorer.config.max_batch_tokens)
        else:
            plan = plan_packed_micro_batches(lengths, self.scorer.config.max_batch_tokens, self._cp)
        logprobs: list[list[np.ndarray | None]] = [[None] * len(batch.data) for batch in batches]
        metrics = [dict.fromkeys(request.spec.metric_keys, 0.0) for request in requests]
        rounds = -(-len(plan) // self._dp_size)
        for round_index in range(rounds):
            slot = round_index * self._dp_size + self._dp_rank
            if slot < len(plan):
                members = sorted(entries[k] for k in plan[slot])  # by request, then datum
                total, error = self._score(batches, requests, members, logprobs, metrics)
            else:
                total, error = self._empty_pass(), None
            self._agree(error)
            if torch.is_grad_enabled():
                self._backward(total)
        return logprobs, metrics

    def _backward(self, total: torch.Tensor) -> None:
        """Backpropagate one round's loss. With cp = C > 1, every rank of a cp group holds the
        same loss, computed from the lp of every chunk (all-gathered); all_gather's backward sums
        the C ranks' gradients for each chunk's lp, so each rank backpropagates total / C and
        its chunk's lp receives exactly the loss's gradient. FSDP's sum over the dp × cp ranks
        (divide factor 1) then gives the one-process gradient. The loss and metrics reported
        stay unscaled."""
        if self._cp > 1:
            total = total / self._cp
        total.backward()

    def _score(
        self,
        batches: Sequence[ForwardBackwardBatch],
        requests: Sequence[losses.CheckedRequest],
        members: list[tuple[int, int]],
        logprobs: list[list[np.ndarray | None]],
        metrics: list[dict[str, float]],
    ) -> tuple[torch.Tensor, BadRequest | None]:
        """`BatchScorer.score_micro_batch`, with the non-finite loss's error returned instead of
        raised, for the ranks to agree on before backward (the loss is then not used)."""
        try:
            return self.scorer.score_micro_batch(batches, requests, members, logprobs, metrics), None
        except BadRequest as error:
            return torch.zeros(()), error

    def _reshard(self) -> None:
        """Free every unit's gathered weights. A unit that keeps them after its forward
        (reshard_after_forward off, as for the last layers) frees them in its backward; after a
        forward with no backward (forward_only, or a pass that stopped) they would stay, and the
        next forward would run on them after optim_step has moved the shards."""
        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _empty_pass(self) -> torch.Tensor:
        """A forward (and, with grad, a zero backward) through every FSDP unit: one token, loss 0."""
        ids = torch.zeros((1, 1), dtype=torch.int64, device=self._device)
        logits = self._model(input_ids=ids, use_cache=False).logits
        return logits.sum() * 0.0

    def _agree(self, error: BadRequest | None) -> None:
        """Raise `error` on its rank and `_PeerFailed` on the others if any rank's loss failed."""
        failed = torch.tensor([int(error is not None)], dtype=torch.int32)
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if int(failed) > 0:
            raise _PeerFailed()

    def _gathered(
        self,
        batches: Sequence[ForwardBackwardBatch],
        requests: Sequence[losses.CheckedRequest],
        logprobs: list[list[np.ndarray | None]],
        metrics: list[dict[str, float]],
    ) -> list[ForwardBackwardResult]:
        """Every rank's metrics summed and log-probabilities gathered, on rank 0."""
        if not self._reports:  # a cp group's other ranks hold the same values as its first
            metrics = [dict.fromkeys(request_metrics, 0.0) for request_metrics in metrics]
            logprobs = [[None] * len(lps) for lps in logprobs]
        flat = [value for request_metrics in metrics for value in request_metrics.values()]
        if flat:
            summed = torch.tensor(flat, dtype=torch.float64)
            dist.all_reduce(summed)
            values = iter(summed.tolist())
            metrics = [{key: next(values) for key in request_metrics} for request_metrics in metrics]
        mine = _RankLogprobs(
            [(r, i, list(lp.shape), lp.tobytes()) for r, lps in enumerate(logprobs) for i, lp in enumerate(lps) if lp is not None]
        )
        parts = gather_bytes(msgspec.msgpack.encode(mine))
        if parts is not None:
            for part in parts:
                for r, i, shape, data in msgspec.msgpack.decode(part, type=_RankLogprobs).datums:
                    logprobs[r][i] = np.frombuffer(data, dtype=np.float32).reshape(shape).copy()
        return [
            ForwardBackwardResult(logprobs=[lp for lp in lps if lp is not None], metrics=m)  # type: ignore[misc]
            for lps, m in zip(logprobs, metrics)
        ]
