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

Activation checkpointing is chosen per round, alike on every rank: a round recomputes each
decoder layer in backward when its largest micro-batch (padded tokens per rank, `round_tokens`)
would keep more than `activation_budget_bytes` of activations (× the bytes a token keeps,
`_activation_cost`); the ranks running the empty pass in that round checkpoint too.
- Why per round, not per micro-batch as `BatchScorer` chooses: a round's ranks score
  different micro-batches, so each rank's own choice would hang on which datums it drew.
  As read in torch 2.13, FSDP2 gathers no weight again when a checkpointed layer recomputes
  (its pre-backward hook has gathered them; the recompute's own hooks return early), and a
  cp group's ranks share their micro-batch, so differing choices would not unbalance the
  collectives today; one choice per round keeps every rank's sequence of collectives the
  same whatever a recompute does, and the round waits for its slowest rank anyway.
- Why not one setting for the job (Automodel's own `activation_checkpointing`, which wraps
  layers before sharding): an RL step's short micro-batches would pay the recompute (about
  a third more compute) that only a long one needs.
- No message per round: the plan is the same on every rank, so every rank knows the round's
  micro-batches. The two figures a rank finds itself (bytes per token, measured; the budget,
  by default a quarter of its own device) are agreed once: the largest and the smallest.
- With cp > 1 the bytes per token are a plain forward's (the K/V each layer gathers from the
  whole pack are not counted), and a scored round's backward runs under its micro-batch's CP
  context, where a recomputed attention exchanges K/V as its forward did.

What it does not do: ordering, trio.
"""

from __future__ import annotations

import contextlib
import logging
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

__all__ = ["ShardedPasses", "round_tokens", "rounds_over_budget"]

logger = logging.getLogger(__name__)


def round_tokens(plan: Sequence[Sequence[int]], lengths: Sequence[int], dp_size: int, cp: int) -> list[int]:
    """The padded tokens per rank of each round's largest micro-batch: round k runs micro-batches
    k·dp_size .. k·dp_size + dp_size - 1 of `plan` (datum indices into `lengths`), one per dp rank.

    A right-padded micro-batch (cp = 1) is rows × its longest datum; a packed one (cp > 1) is its
    datums' total length split over the cp ranks, rounded up. A round's ranks with no micro-batch
    left run the one-token empty pass, never the largest.
    """
    if cp == 1:
        sizes = [len(group) * max(lengths[i] for i in group) for group in plan]
    else:
        sizes = [-(-sum(lengths[i] for i in group) // cp) for group in plan]
    return [max(sizes[start : start + dp_size]) for start in range(0, len(sizes), dp_size)]


def rounds_over_budget(sizes: Sequence[int], bytes_per_token: float, budget_bytes: int) -> list[bool]:
    """Which rounds checkpoint: those whose largest micro-batch (`round_tokens`) would keep more
    than `budget_bytes` of activations."""
    return [size * bytes_per_token > budget_bytes for size in sizes]


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
        self._cp_scorer: ContextParallelScorer | None = None
        if cp_mesh is None:
            self.scorer = BatchScorer(model, device, config)
        else:
            self._cp_scorer = ContextParallelScorer(model, device, config, cp_mesh)
            self.scorer = self._cp_scorer
        self._cp = 1 if cp_mesh is None else cp_mesh.size()
        self._reports = cp_mesh is None or cp_mesh.get_local_rank() == 0  # metrics and lp, once per cp group
        self._model = model
        self._device = device
        self._dp_rank = dp_rank
        self._dp_size = dp_size
        self.calls = 0  # requests run (forward_backward_calls)
        self.tokens = 0  # their model-input tokens
        self.backward_rounds = 0  # rounds run with a backward
        self.checkpointed_rounds = 0  # those of them whose layers were checkpointed
        # (bytes a token keeps, budget), agreed over the ranks at the first pass with grad
        # (`_activation_cost`); None before, and always when the layers cannot be checkpointed.
        self._cost: tuple[float, int] | None = None

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
        checkpointed = self._checkpointed_rounds(round_tokens(plan, lengths, self._dp_size, self._cp))
        for round_index, is_checkpointed in enumerate(checkpointed):
            slot = round_index * self._dp_size + self._dp_rank
            # Backward runs inside too: it recomputes the checkpointed layers.
            with self.scorer.checkpointing(is_checkpointed):
                if slot < len(plan):
                    members = sorted(entries[k] for k in plan[slot])  # by request, then datum
                    total, error = self._score(batches, requests, members, logprobs, metrics)
                else:
                    total, error = self._empty_pass(), None
                self._agree(error)
                if torch.is_grad_enabled():
                    self._backward(total, is_scored=slot < len(plan))
                    self.backward_rounds += 1
                    self.checkpointed_rounds += int(is_checkpointed)
        return logprobs, metrics

    @property
    def activation_bytes_per_token(self) -> float:
        """The bytes a padded token keeps, agreed over the ranks; 0.0 until the first pass with grad."""
        return self._cost[0] if self._cost is not None else 0.0

    def _checkpointed_rounds(self, tokens: list[int]) -> list[bool]:
        """Whether each round, of `tokens` padded tokens per rank at most, checkpoints its layers:
        the same answer on every rank (module docstring). Without grad no round does."""
        if not (torch.is_grad_enabled() and self.scorer.can_checkpoint):
            return [False] * len(tokens)
        return rounds_over_budget(tokens, *self._activation_cost())

    def _activation_cost(self) -> tuple[float, int]:
        """(bytes a token keeps, budget), agreed over the ranks, measured at the first call: every
        rank calls it in the same pass (its probes are FSDP collectives)."""
        if self._cost is None:
            mine = torch.tensor([self._measure_bytes_per_token(), -self.scorer.activation_budget], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the largest bytes a token, and (negated) the smallest budget
            self._cost = (float(mine[0]), int(-mine[1]))
            logger.info(
                "activations kept for backward: %.1f KiB a token; rounds over %d bytes are checkpointed",
                self._cost[0] / 1024, self._cost[1],
            )
        return self._cost

    def _measure_bytes_per_token(self) -> float:
        """The bytes the autograd graph keeps per token of the whole model's forward (logits
        included, as the passes run it), as `BatchScorer` measures its decoder's: two empty passes,
        of 32 and 64 tokens, each storage the graph saved counted once, then the difference per token.

        Storages are counted after the forward, not as they are saved: FSDP frees each unit's
        gathered weights after its forward (the graph's copies of them are then empty), and a
        later allocation may take a freed address, which would merge two storages' counts. What
        is still alive at the end has one address each. Each probe backpropagates its zero loss,
        so FSDP's units end it as they end any pass."""
        sizes = []
        for length in (32, 64):
            kept: list[torch.Tensor] = []

            def keep(tensor: torch.Tensor, kept: list[torch.Tensor] = kept) -> torch.Tensor:
                kept.append(tensor)
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                total = self._empty_pass(length)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
            sizes.append(sum(storages.values()))  # freed storages count 0 bytes
            total.backward()
            kept.clear()
        return max(0.0, (sizes[1] - sizes[0]) / 32)

    def _backward(self, total: torch.Tensor, is_scored: bool) -> None:
        """Backpropagate one round's loss. With cp = C > 1, every rank of a cp group holds the
        same loss, computed from the lp of every chunk (all-gathered); all_gather's backward sums
        the C ranks' gradients for each chunk's lp, so each rank backpropagates total / C and
        its chunk's lp receives exactly the loss's gradient. FSDP's sum over the dp × cp ranks
        (divide factor 1) then gives the one-process gradient. The loss and metrics reported
        stay unscaled.

        A scored cp round backpropagates under its micro-batch's CP context: a checkpointed
        layer recomputes its attention there, exchanging K/V as its forward did."""
        if self._cp_scorer is None:
            total.backward()
            return
        context = self._cp_scorer.recompute_context() if is_scored else contextlib.nullcontext()
        with context:
            (total / self._cp).backward()

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

    def _empty_pass(self, length: int = 1) -> torch.Tensor:
        """A forward (and, with grad, a zero backward) through every FSDP unit: `length` tokens, loss 0."""
        ids = torch.zeros((1, length), dtype=torch.int64, device=self._device)
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
            ForwardBackwardResult(logprobs=[lp for lp in lps if lp is not None], metrics=m)
            for lps, m in zip(logprobs, metrics)
        ]
