"""Scoring a batch of training requests: what every trainer engine shares.

`BatchScorer` owns the forward pass of one model for training requests: it checks
model inputs, runs the datums of one or more requests as right-padded micro-batches
of at most `max_batch_tokens` padded tokens, computes lp = log_softmax(logits in
fp32)[target] over chunks of positions (the output layer recomputed in backward,
so full fp32 logits for every position never exist at once), calls each request's
loss (`gpu/losses.py`) and, when grad is enabled, backpropagates into whatever
parameters of the model require grad. The LoRA trainer (`torch_trainer`) and the
full fine-tuning trainer (`full_trainer`) both drive it.

Datums that share a prefix of at least `min_shared_prefix` tokens (a GRPO group's prompt)
run it once (`gpu/shared_prefix.py`): `plan_passes` puts such groups in micro-batches of
their own, costed as prefixes + suffixes, and `score_micro_batch(..., shared=...)` runs
them in two passes. That path is opt-in per micro-batch: `score_micro_batch` without
`shared` runs every datum whole, as the Automodel trainer's passes call it. It steps aside
(every datum whole) for a micro-batch that activation checkpointing takes (a checkpointed
layer would append to the cache again when it recomputes), and for a model with a sliding
window, a cache that cannot select rows, or one whose two passes do not reproduce its
single pass.

Activation checkpointing is chosen per micro-batch by its size: one whose kept activations
(the model's bytes per token, measured once on two probe forwards, times its padded tokens)
would pass `activation_budget_bytes` recomputes each decoder layer in backward, so a long
datum keeps about one layer's activations instead of all of them; short RL micro-batches
run plain and pay no recompute. The Automodel trainer's passes choose per round of their ranks
instead, one answer for all of them (`automodel_passes`), and apply it with `checkpointing`.

A datum whose step would not fit in the memory the device can give (`gpu/memory_fit.py`'s
estimate, measured once on short probes of this scorer's own step, against
`TrainerConfig.available_memory_bytes` or what the device reports) is refused with a 400 before
any compute, not run into an out-of-memory kill.

Guarantees: a request is validated whole before any compute, and under
`gradients_set_aside` a failed request (bad input or a non-finite loss) leaves the
trainable tensors' accumulated gradients exactly as they were. Shared prefixes change no
result beyond fp32 rounding: log-probabilities, losses, metrics and gradients equal those
of running every datum whole.

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
from openrld.gpu import call_threads, losses, memory_fit, shared_prefix
from openrld.gpu.long_attention import QUERY_BLOCK
from openrld.gpu.models import max_context, vocab_size
from openrld.gpu.shared_prefix import SharedPrefixes
from openrld.gpu.token_logprobs import token_logprobs

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
    # Recompute each decoder layer's activations in backward instead of keeping them, in a
    # micro-batch whose kept activations would pass `activation_budget_bytes` (the autograd
    # graph's bytes per token, measured on the model, times its padded tokens): activation
    # memory drops from O(layers × tokens) to about one layer's, for about a third more
    # compute. False: never.
    activation_checkpointing: bool = True
    # 0: the device's default (`default_activation_budget`); 1 checkpoints every micro-batch.
    activation_budget_bytes: int = 0
    # Datums whose kept activations together would pass this split into micro-batches (each
    # still run plain up to the activation budget). 0: the device's default
    # (`default_micro_batch_budget`).
    micro_batch_budget_bytes: int = 0
    # Datums sharing at least this many leading tokens (a GRPO group's prompt) run them once,
    # then their suffixes as one batch on the prefix's cache; 0 runs every datum whole. Below
    # ~32 tokens the saving is smaller than the second pass's overhead.
    min_shared_prefix: int = 32
    # The memory one datum's training step may use, against `memory_fit`'s estimate of it: a
    # datum over it is refused with a 400, not run into an out-of-memory kill. 0: what the
    # device can give when the request comes (`memory_fit.available_memory`).
    available_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.logits_budget_bytes < 1 or (self.logprob_chunk_positions or 1) < 1:
            raise ValueError(f"TrainerConfig sizes must be >= 1; got {self}")
        if self.activation_budget_bytes < 0 or self.micro_batch_budget_bytes < 0:
            raise ValueError(f"TrainerConfig's activation and micro-batch budgets must be >= 0; got {self}")
        if self.available_memory_bytes < 0:
            raise ValueError(f"TrainerConfig.available_memory_bytes must be >= 0; got {self}")
        if self.min_shared_prefix < 0:
            raise ValueError(f"TrainerConfig.min_shared_prefix must be >= 0; got {self.min_shared_prefix}")


def default_activation_budget(device: torch.device) -> int:
    """The activations a micro-batch may keep before its layers are checkpointed.

    CPU: 2 GiB. SmolLM2 keeps about 1.0 MB a token (`gated_mlp`), so a datum of up to ~2,100
    tokens runs plain and a longer one is checkpointed (bench/long_context.py has the figures). A
    checkpointed step costs about a third more: SmolLM2's 4 x 1,024-token SFT step took 60 CPU
    seconds at a budget of 512 MiB (each datum checkpointed) against 44 at 2 GiB.
    CUDA: a quarter of the device's memory, the rest being weights, optimizer state, the
    logits chunks and the sampler that time-slices with the trainer.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return 2 * 1024**3


def default_micro_batch_budget(device: torch.device, activation_budget: int) -> int:
    """The activations several datums may keep together before `_plan` splits them into micro-batches.

    CPU: 512 MiB (a micro-batch of up to ~520 of SmolLM2's tokens), or the activation budget
    where that is smaller. Splitting costs no CPU time (SmolLM2's 8 x 128 SFT step: 7.7-8.7 CPU
    seconds in three micro-batches, 8.0-8.4 in one) but some wall time on two threads, each
    micro-batch waking the second thread as often as a whole step does: through the SDK, 0.75
    of the bare loop's speed against 0.88 unsplit in one paired run, 0.93 against 0.94 in
    another. It stays because what a micro-batch keeps the allocator keeps again after it: one
    plain micro-batch of 8 SQL answers (1,512 padded tokens) raised the daemon's resident set
    by 3.7 GB (bench/sql_memory.py).
    CUDA: the activation budget, since larger matmuls run faster there.
    """
    if device.type == "cuda":
        return activation_budget
    return min(activation_budget, 512 * 1024**2)


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
        self._weights = call_threads.weights(model)  # a pass's size, for its CPU threads
        self.vocab_size = vocab_size(model)
        self._input_vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._max_tokens = max_context(model)
        self._softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self._chunked_head = config.chunked_head and self._head_reproduces_logits()
        self._checkpointed_layers = self._enable_activation_checkpointing() if config.activation_checkpointing else []
        budget = config.activation_budget_bytes
        self._activation_budget = budget or default_activation_budget(device)
        self._micro_batch_budget = config.micro_batch_budget_bytes or default_micro_batch_budget(
            device, self._activation_budget)
        # The autograd graph's bytes per token of a forward with grad; measured at the first
        # request with grad (`check_fits`, `_checkpoints`), when the trainable tensors exist.
        self._activation_bytes_per_token: float | None = None
        self._step_fit: memory_fit.StepFit | None = None  # `memory_fit`'s probes, run at the first `step_bytes`
        self._checkpointed = False  # whether the micro-batch running now is checkpointed (`checkpointing`)
        # Whether groups may share prefixes; None: not checked yet (`_plan` checks on first use, so
        # that a caller that never plans shared groups, such as the Automodel trainer's passes,
        # runs nothing extra).
        self._shares_prefixes: bool | None = None if config.min_shared_prefix else False

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
            if not forward_only:  # without a graph to keep, a forward holds about one layer at a time
                self.check_fits(batch.data)
            requests.append(
                losses.validate_request(batch.loss_fn, batch.data, batch.loss_config, vocab_size=self.vocab_size)
            )
        call_threads.compute_on(self._weights, sum(len(datum.tokens) for batch in batches for datum in batch.data))
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
        tokens = [np.asarray(batches[r].data[i].tokens) for r, i in entries]
        for micro in self._plan(tokens):
            # entries are in (request, datum) order, so ascending indices keep each request contiguous
            members = [entries[k] for k in micro.indices]
            with self.checkpointing(micro.shared is None and self._checkpoints(micro_tokens(micro, tokens))):
                total = self.score_micro_batch(batches, requests, members, logprobs, metrics, shared=micro.shared)
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
        shared: SharedPrefixes | None = None,
    ) -> torch.Tensor:
        """The summed loss of one micro-batch, `members` ((request, datum) pairs, sorted by request
        then datum); its lp are scattered into `logprobs` and its metrics added into `metrics`.

        With `shared` (from `plan_passes`), the members' shared prefixes run once; without it,
        every member runs whole.

        Raises:
            BadRequest: a loss is not finite, raised before any backward, so a bad loss adds no gradient.
        """
        tokens = [batches[r].data[i].tokens for r, i in members]
        targets = [requests[r].inputs[i]["target_tokens"] for r, i in members]
        if shared is None:
            lp = self._target_logprobs(tokens, targets)
        else:
            lp = self._shared_target_logprobs(tokens, targets, shared)
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

    def check_fits(self, data: Sequence[TrainDatum]) -> None:
        """Refuse a datum whose training step would not fit in the memory the device can give
        (`memory_fit`): a 400 that names its tokens, the estimate and the limit.

        Raises:
            BadRequest: the first datum over the limit.
        """
        limit = self.config.available_memory_bytes or memory_fit.available_memory(self.device)
        for index, datum in enumerate(data):
            tokens = len(datum.tokens)
            refusal = memory_fit.fit_refusal(index, tokens, self.step_bytes(tokens), limit)
            if refusal is not None:
                raise BadRequest(refusal, key="model_input")

    def step_bytes(self, tokens: int) -> int:
        """`memory_fit`'s estimate of one datum's training step over `tokens` tokens on this model,
        in the regime `_would_checkpoint` chooses for it; the first call runs the probes."""
        if self._step_fit is None:
            self._step_fit = self._measure_step_fit()
        checkpointed = self._would_checkpoint(tokens)
        margin = memory_fit.allocator_margin(self.device, checkpointed)
        return self._step_fit.step_bytes(tokens, checkpointed, self._chunk_positions(checkpointed), margin)

    def _measure_step_fit(self) -> memory_fit.StepFit:
        """`memory_fit.measure_step_fit` through this scorer's own step; the probes' gradients are
        dropped, so the trainable tensors' accumulated gradients are as they were."""
        trainable = [p for p in self._model.parameters() if p.requires_grad]
        element_size = self._model.get_input_embeddings().weight.element_size()
        with gradients_set_aside(trainable, keep=False), torch.enable_grad():
            fit = memory_fit.measure_step_fit(
                self.device,
                self._probe_step,
                self._probe_chunk,
                self.can_checkpoint,
                memory_fit.window_block_bytes(self._model.config, QUERY_BLOCK, element_size),
            )
        logger.info("training step memory, measured: %s", fit)
        return fit

    def _probe_step(self, tokens: int, checkpointed: bool) -> None:
        """One datum's forward and backward over `tokens` tokens, as a request runs it, with
        log-softmax chunks of `memory_fit.PROBE_CHUNK` positions."""
        ids = np.arange(tokens, dtype=np.int64) % self._input_vocab_size
        with self.checkpointing(checkpointed):
            lp = self._target_logprobs([ids], [np.roll(ids, -1)], chunk=memory_fit.PROBE_CHUNK)
            (-lp.sum()).backward()

    def _probe_chunk(self, positions: int) -> None:
        """One log-softmax chunk of `positions` rows, forward and backward, on hidden states (or
        logits, when the output layer is not chunked) that need grad."""
        width = self._model.config.get_text_config().hidden_size if self._chunked_head else self.vocab_size
        dtype = self._model.get_input_embeddings().weight.dtype
        features = torch.randn(positions, width, device=self.device, dtype=dtype, requires_grad=True)
        rows = torch.arange(positions, device=self.device)
        lp = self._chunk_logprobs(features, rows, rows % self.vocab_size, self._chunked_head)
        lp.sum().backward()

    def _target_logprobs(
        self, tokens: Sequence[np.ndarray], targets: Sequence[np.ndarray], chunk: int | None = None
    ) -> torch.Tensor:
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
        chunk = chunk or self._chunk_positions(self._checkpointed)
        # The output layer on the real positions' hidden states, even where one chunk holds them
        # all: the model's own logits cover the padding too, and gathering the real rows out of
        # them copies (P, V) again (`_logprobs_at`).
        head_chunks = self._chunked_head
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
        offsets = np.cumsum([0] + lengths)
        positions = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(lengths))]
        return self._logprobs_at(rows, positions, targets, head_chunks, chunk)

    def _shared_target_logprobs(
        self, tokens: Sequence[np.ndarray], targets: Sequence[np.ndarray], shared: SharedPrefixes
    ) -> torch.Tensor:
        """`_target_logprobs`, each shared prefix run once (`shared_prefix.two_pass_features`).

        A prefix's rows serve every datum of its group, each reading its own targets there: the
        target at the last prefix position is the datum's first suffix token, read from the
        prefix pass's last row.
        """
        chunk = self._chunk_positions(self._checkpointed)
        head_chunks = self._chunked_head
        rows, positions = shared_prefix.two_pass_features(
            self._decoder_features if head_chunks else self._logit_features,
            self._model.config,
            tokens,
            shared,
            self.device,
        )
        return self._logprobs_at(rows, positions, targets, head_chunks, chunk)

    def _decoder_features(
        self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, cache: object
    ) -> torch.Tensor:
        out = self._model.get_decoder()(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        return out.last_hidden_state  # (B, T, H)

    def _logit_features(
        self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, cache: object
    ) -> torch.Tensor:
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        return out.logits  # (B, T, V)

    def _chunk_positions(self, checkpointed: bool) -> int:
        """Positions per log-softmax chunk. A checkpointed micro-batch (a long one) takes chunks a
        quarter the size: a chunk's logits live several times over at once (the output layer's,
        a LoRA's term on it, their sum, the log-softmax, their gradients), which at the full
        budget was most of what a long datum's step held (SmolLM2 at 4,096 tokens: 2.7 GB peak
        against 2.2 GB with the smaller chunks). A short one keeps the larger chunks, which
        its backward then needs not recompute."""
        budget = self.config.logits_budget_bytes // (4 if checkpointed else 1)
        return self.config.logprob_chunk_positions or max(1, budget // (4 * self.vocab_size))

    def _logprobs_at(
        self,
        rows: torch.Tensor,
        positions: Sequence[np.ndarray],
        targets: Sequence[np.ndarray],
        head_chunks: bool,
        chunk: int,
    ) -> torch.Tensor:
        """lp in the packed layout: datum i's targets read at rows `positions[i]` of `rows` ((P, H)
        hidden states, or (P, V) logits), the log-softmax taken `chunk` rows at a time."""
        # (position, token) pairs in packed order: each position repeated K times for (N, K) targets.
        per_position = [1 if t.ndim == 1 else t.shape[1] for t in targets]
        pair_rows = np.concatenate([np.repeat(rows_i, k) for rows_i, k in zip(positions, per_position)])
        pair_tokens = np.concatenate([t.reshape(-1) for t in targets])
        # Chunks take pairs by row. Shared prefix rows serve several datums, so pairs come out of
        # row order there: sort them, and put the lp back in packed order at the end.
        order = None if np.all(pair_rows[1:] >= pair_rows[:-1]) else np.argsort(pair_rows, kind="stable")
        if order is not None:
            pair_rows, pair_tokens = pair_rows[order], pair_tokens[order]
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
        lp = torch.cat(pieces)
        if order is None:
            return lp
        packed = np.empty_like(order)
        packed[order] = np.arange(len(order))
        return lp[torch.from_numpy(packed).to(self.device)]

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
        return token_logprobs(logits, rows, tokens)

    def _checkpoints(self, padded_tokens: int) -> bool:
        """Whether a micro-batch of `padded_tokens` runs with its layers checkpointed now."""
        return torch.is_grad_enabled() and self._would_checkpoint(padded_tokens)

    def _would_checkpoint(self, padded_tokens: int) -> bool:
        """Whether a micro-batch of `padded_tokens` with grad checkpoints its layers: the model can,
        and the activations it would keep (bytes per token, measured) pass the budget."""
        # Measured even with checkpointing off: `check_fits` estimates a datum's step from it.
        per_token = self._bytes_per_token()
        return bool(self._checkpointed_layers) and padded_tokens * per_token > self._activation_budget

    def _bytes_per_token(self) -> float:
        """The graph's bytes per token (`_measure_activation_bytes_per_token`), measured at first use."""
        if self._activation_bytes_per_token is None:
            self._activation_bytes_per_token = self._measure_activation_bytes_per_token()
        return self._activation_bytes_per_token

    @property
    def can_checkpoint(self) -> bool:
        """Whether `checkpointing(True)` checkpoints anything: the config asks for it and the model supports it."""
        return bool(self._checkpointed_layers)

    @property
    def activation_budget(self) -> int:
        """The activations a micro-batch may keep before its layers are checkpointed, in bytes."""
        return self._activation_budget

    @contextlib.contextmanager
    def checkpointing(self, on: bool) -> Iterator[None]:
        """Layers checkpointed within, when `on`: transformers checkpoints a layer only while its
        own `training` flag is set; only the flag is set, not `.train()`, so dropout below it stays
        off (eval mode). Backward must run within too: it recomputes the checkpointed layers."""
        for layer in self._checkpointed_layers:
            layer.training = on
        self._checkpointed = on
        try:
            yield
        finally:
            for layer in self._checkpointed_layers:
                layer.training = False
            self._checkpointed = False

    def _measure_activation_bytes_per_token(self) -> float:
        """The bytes the autograd graph keeps per token of the decoder's forward with grad.

        Two probe forwards, of 32 and 64 tokens, under `saved_tensors_hooks` that count every
        storage the graph saves once; weights saved for backward are the same at both lengths and
        cancel out. Nothing runs backward; the graphs are dropped. It measures whatever this
        model's layers keep for the tensors that train now (LoRA adapters or every weight)."""
        sizes = []
        for length in (32, 64):
            saved: dict[int, int] = {}

            def pack(tensor: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
                storage = tensor.untyped_storage()
                saved[storage.data_ptr()] = storage.nbytes()
                return tensor

            ids = (torch.arange(length, device=self.device) % self._input_vocab_size)[None]
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                hidden = self._model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            del hidden
            sizes.append(sum(saved.values()))
        per_token = max(0.0, (sizes[1] - sizes[0]) / 32)
        logger.info("activations kept for backward: %.1f KiB a token", per_token / 1024)
        return per_token

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

    def _plan(self, tokens: Sequence[np.ndarray]) -> list[MicroBatch]:
        """`plan_passes`, with shared prefixes where this model allows them: checked (once) the
        first time a plan has a shared group, so that requests without any run nothing extra.

        A checkpointed layer runs again in backward and would append to the prefix's cache a
        second time, so a shared micro-batch never checkpoints: one that would need it even
        within the plan's budget (a prefix longer than the budget allows) runs its datums
        whole instead, checkpointed."""
        budget = self._plain_batch_tokens()
        plan = plan_passes(tokens, budget, 0 if self._shares_prefixes is False else self.config.min_shared_prefix)
        if self._shares_prefixes is None and any(micro.shared is not None for micro in plan):
            self._shares_prefixes = self._can_share_prefixes()
            if not self._shares_prefixes:
                plan = plan_passes(tokens, budget, 0)
        return [part for micro in plan for part in self._unshared_if_checkpointed(micro, tokens)]

    def _plain_batch_tokens(self) -> int:
        """The padded tokens a micro-batch may hold: `max_batch_tokens`, and with grad no more than
        the micro-batch budget keeps, so that several datums split into micro-batches that run
        plain rather than one that recomputes its layers or holds the allocator's peak (a datum
        longer alone runs alone, checkpointed only past the activation budget)."""
        limit = self.config.max_batch_tokens
        if not (torch.is_grad_enabled() and self._checkpointed_layers):
            return limit
        return max(1, min(limit, int(self._micro_batch_budget // max(1.0, self._bytes_per_token()))))

    def _unshared_if_checkpointed(self, micro: MicroBatch, tokens: Sequence[np.ndarray]) -> list[MicroBatch]:
        # What it keeps for backward is what it runs: each prefix once, then the suffixes.
        if micro.shared is None or not self._checkpoints(shared_micro_tokens(micro, tokens)):
            return [micro]
        lengths = [len(tokens[i]) for i in micro.indices]
        return [
            MicroBatch(tuple(sorted(micro.indices[k] for k in part)))
            for part in plan_micro_batches(lengths, self.config.max_batch_tokens)
        ]

    def _can_share_prefixes(self) -> bool:
        """Whether two passes on the model's cache reproduce its single pass; logs why not."""
        model_type = getattr(self._model.config, "model_type", "?")
        if not shared_prefix.cache_supports_sharing(self._model.config):
            logger.warning("shared prefixes off: model_type=%s has a sliding window or another cache kind", model_type)
            return False
        if self._prefix_sharing_reproduces():
            return True
        logger.warning("shared prefixes off: two passes do not reproduce one for model_type=%s", model_type)
        return False

    def _prefix_sharing_reproduces(self) -> bool:
        """Two datums of 16 tokens that share 8, run whole and in two passes; run once."""
        n = min(16, self._input_vocab_size)
        first = np.arange(n, dtype=np.int64)
        second = first.copy()
        second[n // 2 :] = first[n // 2 :][::-1]
        shared = SharedPrefixes(rows=(0, 0), lengths=(n // 2,))
        with torch.no_grad():
            ids = torch.from_numpy(np.stack([first, second])).to(self.device)
            whole = self._model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            rows, positions = shared_prefix.two_pass_features(
                self._decoder_features, self._model.config, [first, second], shared, self.device
            )
            passes = torch.stack([rows[torch.from_numpy(p).to(self.device)] for p in positions])
        tolerance = 1e-4 if whole.dtype == torch.float32 else 2e-2
        # Rounding differs by the hidden states' scale, not each element's: SmolLM2's reach 42,
        # and a near-zero element then differs by 4.5e-4 (1e-5 of the scale) between the passes'
        # summation orders, which a fixed atol of 1e-4 took for a cache that does not reproduce.
        # A cache that does not (wrong positions, lost rows) differs by the scale itself.
        atol = tolerance * max(1.0, float(whole.abs().max()))
        return bool(torch.allclose(passes.float(), whole.float(), rtol=tolerance, atol=atol))


@contextlib.contextmanager
def gradients_set_aside(params: Sequence[torch.nn.Parameter], keep: bool = True) -> Iterator[None]:
    """Run one request's backward passes into fresh gradient buffers. On success the earlier
    buffers are added back in; on any failure they are put back untouched, so a failed
    request adds nothing, even after some micro-batches backpropagated.
    With `keep=False` the fresh buffers are dropped even on success (a probe's)."""
    earlier = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        yield
    except BaseException:
        for param, grad in zip(params, earlier):
            param.grad = grad
        raise
    if not keep:
        for param, grad in zip(params, earlier):
            param.grad = grad
        return
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


class MicroBatch(msgspec.Struct, frozen=True):
    """One micro-batch of `plan_passes`: the datums it runs, and how they share prefixes."""

    indices: tuple[int, ...]  # datum indices, ascending
    shared: SharedPrefixes | None = None  # None: every datum runs whole


def plan_passes(tokens: Sequence[np.ndarray], max_batch_tokens: int, min_shared_prefix: int) -> list[MicroBatch]:
    """Micro-batches for datums `tokens`: those in no prefix group as `plan_micro_batches` plans
    them, then the prefix groups (`shared_prefix.find_prefix_groups`) packed by their shared
    cost, prefixes + suffixes (`shared_prefix.pack_groups`).

    A group over the budget on its own is split, its suffixes planned as `plan_micro_batches`
    plans datums, within the budget less its prefix; a part of one datum runs whole.
    With `min_shared_prefix` 0, this is `plan_micro_batches`'s plan.
    """
    lengths = [len(t) for t in tokens]
    groups: list[shared_prefix.PrefixGroup] = []
    for group in shared_prefix.find_prefix_groups(tokens, min_shared_prefix):
        suffixes = [lengths[i] - group.prefix_len for i in group.members]
        for part in plan_micro_batches(suffixes, max_batch_tokens - group.prefix_len):
            if len(part) > 1:
                groups.append(shared_prefix.PrefixGroup(tuple(sorted(group.members[k] for k in part)), group.prefix_len))
    grouped = {i for group in groups for i in group.members}
    alone = [i for i in range(len(tokens)) if i not in grouped]
    plan = [
        MicroBatch(tuple(sorted(alone[k] for k in part)))
        for part in plan_micro_batches([lengths[i] for i in alone], max_batch_tokens)
    ]
    for pack in shared_prefix.pack_groups(groups, lengths, max_batch_tokens):
        indices = sorted(i for group in pack for i in group.members)
        row_of = {i: row for row, group in enumerate(pack) for i in group.members}
        shared = SharedPrefixes(tuple(row_of[i] for i in indices), tuple(group.prefix_len for group in pack))
        plan.append(MicroBatch(tuple(indices), shared))
    return plan


def micro_tokens(micro: MicroBatch, tokens: Sequence[np.ndarray]) -> int:
    """The padded tokens of a micro-batch's datums run whole: rows × the longest."""
    return len(micro.indices) * max(len(tokens[i]) for i in micro.indices)


def shared_micro_tokens(micro: MicroBatch, tokens: Sequence[np.ndarray]) -> int:
    """The padded tokens a shared micro-batch runs (`shared_prefix.shared_cost`): its prefixes
    padded to the longest, then every datum's suffix padded to the longest."""
    assert micro.shared is not None
    prefixes = micro.shared.lengths
    suffixes = [len(tokens[i]) - prefixes[row] for i, row in zip(micro.indices, micro.shared.rows)]
    return len(prefixes) * max(prefixes) + len(suffixes) * max(suffixes)


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
