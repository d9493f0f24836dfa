"""Scoring a batch of training requests: what every trainer engine shares.

`BatchScorer` owns the forward pass of one model for training requests: it checks
model inputs, runs the datums of one or more requests as right-padded micro-batches
of at most `max_batch_tokens` padded tokens, computes lp = log_softmax(logits in
fp32)[target] over chunks of positions (the output layer recomputed in backward,
so full fp32 logits for every position never exist at once), calls each request's
loss (`gpu/losses.py`) and, when grad is enabled, backpropagates into whatever
parameters of the model require grad. The LoRA trainer (`torch_trainer`) and the
full fine-tuning trainer (`full_trainer`) both drive it.

Guarantees: a request is validated whole before any compute, and under
`gradients_set_aside` a failed request (bad input or a non-finite loss) leaves the
trainable tensors' accumulated gradients exactly as they were.

What it does not do: own parameters or optimizers, choose which tensors train,
ordering, locking, trio. Device and dtype are explicit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence

import msgspec
import numpy as np
import torch
import torch.utils.checkpoint

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu import losses
from openrld.gpu.models import max_context, vocab_size

logger = logging.getLogger(__name__)


class TrainerConfig(msgspec.Struct, frozen=True):
    """Memory knobs; the defaults suit one GPU with a ~150k vocabulary."""

    # Padded tokens (batch × longest datum) per micro-batch: bounds activation memory.
    max_batch_tokens: int = 16384
    # fp32 logits alive at once: positions per log-softmax chunk = budget / (4 B × vocab),
    # 256 MiB / (4 B × 152k) ≈ 440 positions; a small vocabulary fits in one chunk.
    logits_budget_bytes: int = 256 * 1024 * 1024
    # Positions per chunk, overriding the budget (tests use it to force many chunks).
    logprob_chunk_positions: int | None = None
    # Apply the output layer to hidden states chunk by chunk. Turned off (with a warning)
    # when that does not reproduce the model's own logits, e.g. an unknown logit transform.
    chunked_head: bool = True
    # Recompute each decoder layer's activations in backward instead of keeping them:
    # activation memory drops from O(layers × tokens) to about one layer's, for ~1/3 more
    # compute. For long sequences; off by default.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.logits_budget_bytes < 1 or (self.logprob_chunk_positions or 1) < 1:
            raise ValueError(f"TrainerConfig sizes must be >= 1; got {self}")


class BatchScorer:
    """Forward (and backward) of training requests through one model; one call at a time.

    Args:
        model: a causal LM in eval mode; the parameters that require grad are the ones
            that receive gradients (LoRA tensors, or every weight for full fine-tuning).
        device: where the model lives.
        config: memory knobs.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, config: TrainerConfig) -> None:
        self._model = model
        self.device = device
        self.config = config
        self.vocab_size = vocab_size(model)
        self._input_vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._max_tokens = max_context(model)
        self._softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self._chunked_head = config.chunked_head and self._head_reproduces_logits()
        self._checkpointed_layers = self._enable_activation_checkpointing() if config.activation_checkpointing else []

    def forward_backward_many(
        self, batches: Sequence[ForwardBackwardBatch], trainable: Iterable[torch.nn.Parameter]
    ) -> list[ForwardBackwardResult]:
        """Score several requests in one pass and, unless they are `forward_only`, add the
        gradient of the sum of their losses to `trainable`'s accumulated gradients.

        All requests must agree on `forward_only`. The call is atomic: if any request fails,
        nothing is added to `trainable` and the first error is raised.

        Returns:
            One ForwardBackwardResult per request, in order.
        Raises:
            BadRequest / NotSupportedYet: see `losses.validate_request`, plus bad model
            inputs and a non-finite loss.
        """
        forward_only = batches[0].forward_only
        assert all(b.forward_only == forward_only for b in batches), "forward_backward_many mixes forward_only"
        requests = []
        for batch in batches:
            self.check_model_inputs(batch.data)
            requests.append(
                losses.validate_request(batch.loss_fn, batch.data, batch.loss_config, vocab_size=self.vocab_size)
            )
        for layer in self._checkpointed_layers:
            # transformers checkpoints a layer only while its own `training` flag is set; only
            # the flag is set, not `.train()`, so dropout below it stays off (eval mode).
            layer.training = True
        if forward_only:
            guard: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            guard = gradients_set_aside(list(trainable))
        with guard, torch.set_grad_enabled(not forward_only):
            return self._run_micro_batches(batches, requests)

    def _run_micro_batches(
        self, batches: Sequence[ForwardBackwardBatch], requests: Sequence[losses.CheckedRequest]
    ) -> list[ForwardBackwardResult]:
        """lp, losses and (when grad is enabled) backward, one padded micro-batch at a time.

        A micro-batch may hold datums of several requests; within it each request's datums
        sit together, so its lp is one contiguous slice and its loss one call.
        """
        entries = [(r, i) for r, batch in enumerate(batches) for i in range(len(batch.data))]
        logprobs = [[np.empty(0, np.float32)] * len(batch.data) for batch in batches]
        metrics = [dict.fromkeys(request.spec.metric_keys, 0.0) for request in requests]
        lengths = [len(batches[r].data[i].tokens) for r, i in entries]
        for group in plan_micro_batches(lengths, self.config.max_batch_tokens):
            members = sorted(entries[k] for k in group)  # by request, then datum: contiguous per request
            total = self.score_micro_batch(batches, requests, members, logprobs, metrics)
            if torch.is_grad_enabled():
                total.backward()
        return [ForwardBackwardResult(logprobs=lp_list, metrics=m) for lp_list, m in zip(logprobs, metrics)]

    def score_micro_batch(
        self,
        batches: Sequence[ForwardBackwardBatch],
        requests: Sequence[losses.CheckedRequest],
        members: list[tuple[int, int]],
        logprobs: list[list[np.ndarray]] | list[list[np.ndarray | None]],
        metrics: list[dict[str, float]],
    ) -> torch.Tensor:
        """The summed loss of one micro-batch, `members` ((request, datum) pairs, sorted by request
        then datum); its lp are scattered into `logprobs` and its metrics added into `metrics`.

        Raises:
            BadRequest: a loss is not finite, raised before any backward, so a bad loss adds no gradient.
        """
        lp = self._target_logprobs(
            [batches[r].data[i].tokens for r, i in members],
            [requests[r].inputs[i]["target_tokens"] for r, i in members],
        )
        total: torch.Tensor | None = None
        offset = 0
        for r, indices in _by_request(members):
            request = requests[r]
            size = sum(int(request.inputs[i]["target_tokens"].size) for i in indices)
            part = lp[offset : offset + size]
            offset += size
            packed = losses.pack_inputs(request, indices, self.device)
            loss, part_metrics = request.spec.fn(part, packed.inputs, request.config, packed.segments)
            losses.check_finite_loss(loss, batches[r].loss_fn)
            total = loss if total is None else total + loss
            _scatter(part, indices, request, logprobs[r])  # type: ignore[arg-type]
            for key, value in part_metrics.items():
                metrics[r][key] += value
        assert total is not None and offset == lp.numel(), f"packed {offset} of {lp.numel()} log-probs"
        return total

    def check_model_inputs(self, data: Sequence[TrainDatum]) -> None:
        for index, datum in enumerate(data):
            tokens = np.asarray(datum.tokens)
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise BadRequest(
                    f"datum {index}: model_input tokens must be a 1-D integer array; "
                    f"got dtype {tokens.dtype} shape {list(tokens.shape)}",
                    key="model_input",
                )
            if len(tokens) == 0:
                raise BadRequest(f"datum {index}: model_input is empty; expected at least one token", key="model_input")
            if len(tokens) > self._max_tokens:
                raise BadRequest(
                    f"datum {index}: model_input has {len(tokens)} tokens; the model's context is {self._max_tokens}",
                    key="model_input",
                )
            if tokens.min() < 0 or tokens.max() >= self._input_vocab_size:
                bad = int(np.flatnonzero((tokens < 0) | (tokens >= self._input_vocab_size))[0])
                raise BadRequest(
                    f"datum {index}: model_input has token id {int(tokens[bad])} at position {bad}; "
                    f"expected ids in [0, {self._input_vocab_size})",
                    key="model_input",
                )

    def _target_logprobs(self, tokens: Sequence[np.ndarray], targets: Sequence[np.ndarray]) -> torch.Tensor:
        """lp of one micro-batch in the packed layout of losses.py: (M,) float32, M = Σ targets.size.

        Datums are right-padded into (B, T) with an attention mask; under causal attention the
        padding never reaches a real position.
        """
        lengths = [len(t) for t in tokens]
        ids = np.zeros((len(tokens), max(lengths)), np.int64)
        mask = np.zeros_like(ids)
        for row, (datum_tokens, n) in enumerate(zip(tokens, lengths)):
            ids[row, :n] = datum_tokens
            mask[row, :n] = 1
        input_ids = torch.from_numpy(ids).to(self.device)
        attention_mask = torch.from_numpy(mask).to(self.device)
        # Without padding, no mask: attention then takes its plain causal path, which is faster.
        model_mask = None if min(lengths) == max(lengths) else attention_mask
        chunk = self.config.logprob_chunk_positions or max(1, self.config.logits_budget_bytes // (4 * self.vocab_size))
        # One chunk holds every position: the model's own full logits are as cheap and simpler.
        head_chunks = self._chunked_head and sum(lengths) > chunk
        if head_chunks:
            decoder = self._model.get_decoder()
            out = decoder(input_ids=input_ids, attention_mask=model_mask, use_cache=False)
            features = out.last_hidden_state  # (B, T, H)
        else:
            features = self._model(input_ids=input_ids, attention_mask=model_mask, use_cache=False).logits
        if model_mask is None:  # every position is real: a view, where a mask would gather a copy
            rows = features.reshape(-1, features.shape[-1])  # (P, H) or (P, V), datum by datum
        else:
            rows = features[attention_mask.bool()]  # (P, H) or (P, V): real positions, datum by datum
        # (position, token) pairs in packed order: each position repeated K times for (N, K) targets.
        offsets = np.cumsum([0] + lengths)
        per_position = [1 if t.ndim == 1 else t.shape[1] for t in targets]
        pair_rows = np.concatenate(
            [np.repeat(np.arange(offsets[i], offsets[i + 1]), k) for i, k in enumerate(per_position)]
        )
        pair_tokens = np.concatenate([t.reshape(-1) for t in targets])
        starts = list(range(0, len(rows), chunk))
        # Recompute a chunk's logits in backward only when there are several chunks:
        # then keeping every chunk's (chunk, V) fp32 alive is what the budget forbids.
        recompute = torch.is_grad_enabled() and len(starts) > 1
        bounds = np.searchsorted(pair_rows, starts + [len(rows)])
        pair_rows_t = torch.from_numpy(pair_rows).to(self.device)
        pair_tokens_t = torch.from_numpy(pair_tokens).to(self.device)
        pieces = []
        for start, lo, hi in zip(starts, bounds[:-1], bounds[1:]):
            args = (rows[start : start + chunk], pair_rows_t[lo:hi] - start, pair_tokens_t[lo:hi], head_chunks)
            if recompute:
                pieces.append(torch.utils.checkpoint.checkpoint(self._chunk_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(self._chunk_logprobs(*args))
        return torch.cat(pieces)

    def _chunk_logprobs(
        self, features: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, head_chunks: bool
    ) -> torch.Tensor:
        """log_softmax in fp32 of one chunk's logits, read at (rows, tokens)."""
        if head_chunks:
            logits = self._model.get_output_embeddings()(features).float()  # (c, V)
            if self._softcap:
                logits = torch.tanh(logits / self._softcap) * self._softcap
        else:
            logits = features.float()
        return torch.log_softmax(logits, dim=-1)[rows, tokens]

    def _enable_activation_checkpointing(self) -> list[torch.nn.Module]:
        """Turn on transformers' per-layer checkpointing (non-reentrant, so a frozen base and
        LoRA inputs need no grad hooks); returns the layers whose flag must stay set."""
        if not self._model.supports_gradient_checkpointing:
            logger.warning(
                "activation checkpointing requested but model_type=%s does not support it; running without",
                getattr(self._model.config, "model_type", "?"),
            )
            return []
        self._model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return [m for m in self._model.modules() if getattr(m, "gradient_checkpointing", False)]

    def _head_reproduces_logits(self) -> bool:
        """Whether decoder + output layer (+ soft-cap) gives the model's own logits; run once."""
        ids = torch.arange(min(16, self.vocab_size), device=self.device).unsqueeze(0)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            expected = self._model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            hidden = self._model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            logits = self._model.get_output_embeddings()(hidden).float()
            if self._softcap:
                logits = torch.tanh(logits / self._softcap) * self._softcap
        tolerance = 1e-4 if expected.dtype == logits.dtype == torch.float32 and hidden.dtype == torch.float32 else 2e-2
        if torch.allclose(logits, expected, rtol=tolerance, atol=tolerance):
            return True
        logger.warning(
            "chunked output layer does not reproduce the model's logits (model_type=%s); computing full logits",
            getattr(self._model.config, "model_type", "?"),
        )
        return False


@contextlib.contextmanager
def gradients_set_aside(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Run one request's backward passes into fresh gradient buffers. On success the earlier
    buffers are added back in; on any failure they are put back untouched, so a failed
    request adds nothing (losses.md §1.6), even after some micro-batches backpropagated."""
    earlier = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        yield
    except BaseException:
        for param, grad in zip(params, earlier):
            param.grad = grad
        raise
    for param, grad in zip(params, earlier):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad.add_(grad)


def plan_micro_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Group datum indices so that batch size × longest length ≤ max_batch_tokens.

    Longest first, so that similar lengths share a batch and padding stays small; a datum
    longer than the budget gets a batch of its own. Every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        # Sorted longest first, so the group's first datum sets its padded length.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _by_request(members: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """[(request, [datum, ...]), ...] from (request, datum) pairs already sorted by request."""
    runs: list[tuple[int, list[int]]] = []
    for request, datum in members:
        if runs and runs[-1][0] == request:
            runs[-1][1].append(datum)
        else:
            runs.append((request, [datum]))
    return runs


def _scatter(lp: torch.Tensor, group: Sequence[int], request: losses.CheckedRequest, out: list[np.ndarray]) -> None:
    """Cut a micro-batch's packed lp back into per-datum float32 arrays shaped like the targets."""
    flat = lp.detach().to("cpu", torch.float32).numpy()
    offset = 0
    for index in group:
        shape = request.inputs[index]["target_tokens"].shape
        size = int(np.prod(shape))
        out[index] = flat[offset : offset + size].reshape(shape).copy()
        offset += size
