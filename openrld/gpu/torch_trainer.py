"""The trainer engine for one resident base model and many LoRA adapters (one per job).

What it does: it loads the base model once (frozen, eval mode: no dropout), adds and drops
peft LoRA adapters by name, and for one adapter at a time runs `forward_backward`
(Tinker losses over the target-token log-probabilities, `gpu/losses.py`), or
`forward_backward_many` for several requests of that adapter in one pass, `optim_step`
(the adapter's optimizer family, AdamW or Dimuon, fixed when it is added: `gpu/optim.py`),
and saving and loading of its state.

Guarantees:
- a request is validated whole before any compute; a failed request (bad input or a
  non-finite loss) leaves the adapter's accumulated gradients exactly as they were;
- gradients accumulate per adapter until that adapter's `optim_step`; `forward_only`
  neither adds to nor clears them. Adapters never share weights, gradients or optimizer
  state, and clipping and the gradient norm cover one adapter only;
- datums run as right-padded micro-batches of at most `max_batch_tokens` padded tokens,
  never one at a time, and the datums of several requests share micro-batches. lp = log_softmax(logits in fp32)[target] is computed over chunks
  of positions, with the output layer recomputed in backward, so full fp32 logits for
  every position never exist at once (nor, unless `chunked_head` is off, full logits at all);
  with `activation_checkpointing`, decoder layers are recomputed in backward too;
- an optim_step of the other family than the adapter's is refused and keeps the gradient;
- adapter tensors use the keys of `peft.get_peft_model_state_dict(..., adapter_name=name,
  save_embedding_layers=False)`, which is what the sampler loads with
  `peft.set_peft_model_state_dict`.

What it does not do: ordering, queueing, locking (the caller makes one call at a time),
request ids or futures, trio. Device and dtype are explicit arguments.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np
import peft
import torch
import torch.utils.checkpoint

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, LoraSpec, OptimParams, OptimResult, TrainDatum
from openrld.errors import BadRequest, Conflict, NotFound
from openrld.gpu import lora_io, losses
from openrld.gpu.models import load_causal_lm, lora_config, max_context, vocab_size
from openrld.gpu.optim import family_of, optimizer_for

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
STATE_FORMAT_VERSION = 1


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


class TrainerStatistics(msgspec.Struct, frozen=True):
    adapters: int
    optim_steps: int  # AdamW steps applied, summed over the resident adapters
    forward_backward_calls: int
    tokens: int  # model-input tokens run through forward_backward


class TrainerState(msgspec.Struct, frozen=True):
    """state.json of a state checkpoint."""

    format_version: int
    lora: LoraSpec
    optimizer: str  # "adamw" or "dimuon"
    optimizer_steps: int
    has_optimizer_state: bool


class _Adapter:
    """One job's adapter: its shape, its trainable tensors and its own optimizer."""

    def __init__(self, spec: LoraSpec, params: dict[str, torch.nn.Parameter], family: str) -> None:
        self.spec = spec
        self.params = params  # peft state-dict key (no adapter name) -> parameter
        self.family = family  # fixed for the adapter's life (optimizers.md §1.1)
        self.optimizer = optimizer_for(family, params, spec.rank)


class TorchTrainer:
    """Many LoRA adapters over one frozen base model; one call at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        config: TrainerConfig = TrainerConfig(),
    ) -> None:
        self.device = device
        self.config = config
        self._model = load_causal_lm(model_dir, device, dtype)  # peft injects its layers into this object
        self._peft: peft.PeftModel | None = None  # created with the first adapter
        self._adapters: dict[str, _Adapter] = {}
        self._active: str | None = None
        self._vocab_size = vocab_size(self._model)
        self._input_vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self._max_tokens = max_context(self._model)
        self._softcap: float | None = getattr(self._model.config, "final_logit_softcapping", None)
        self._chunked_head = config.chunked_head and self._head_reproduces_logits()
        self._checkpointed_layers = self._enable_activation_checkpointing() if config.activation_checkpointing else []
        self._fb_calls = 0
        self._tokens = 0

    # ------------------------------------------------------------ adapters

    def add_adapter(self, name: str, spec: LoraSpec, optimizer: str = "adamw") -> None:
        """Add a fresh adapter with a fresh `optimizer` ("adamw" or "dimuon"). peft
        initialises B to zero, so it equals the base model; A's random init is seeded with
        `spec.seed` when given (reproducible).

        Raises:
            Conflict: `name` exists.  BadRequest: a name peft cannot key, rank < 1, or an
            unknown optimizer family.
        """
        optimizer_for(optimizer, {}, spec.rank)  # refuse an unknown family before peft changes
        if name in self._adapters:
            raise Conflict(f"adapter {name!r} already exists")
        if not name or "." in name:
            raise BadRequest(f"adapter name {name!r} cannot key torch modules (empty, or contains '.')")
        if spec.rank < 1:
            raise BadRequest(f"LoRA rank must be >= 1; got {spec.rank}", key="rank")
        # fork_rng keeps a seeded init from moving the process's global RNG; peft draws A on the CPU.
        seeded = torch.random.fork_rng(devices=[]) if spec.seed is not None else contextlib.nullcontext()
        with seeded:
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self._peft is None:
                self._peft = peft.get_peft_model(self._model, lora_config(spec), adapter_name=name)
            else:
                self._peft.add_adapter(name, lora_config(spec))
        self._active = None  # peft may have switched the active adapter
        self._adapters[name] = _Adapter(spec, self._adapter_parameters(name), optimizer)
        logger.info("adapter added adapter=%s rank=%d optimizer=%s", name, spec.rank, optimizer)

    def drop_adapter(self, name: str) -> None:
        """Delete the adapter, its gradients and its optimizer state. Raises NotFound."""
        self._get(name)
        assert self._peft is not None
        others = [other for other in self._adapters if other != name]
        if others and name in self._peft.active_adapters:
            # peft warns each time it must pick a new active adapter itself; pick one first.
            self._peft.set_adapter(others[0])
        self._peft.delete_adapter(name)
        del self._adapters[name]
        self._active = None
        logger.info("adapter dropped adapter=%s", name)

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Detached CPU clones, keyed as `peft.get_peft_model_state_dict` keys them."""
        self._get(name)
        state = peft.get_peft_model_state_dict(self._peft, adapter_name=name, save_embedding_layers=False)
        return {key: tensor.detach().to("cpu").clone() for key, tensor in state.items()}

    def adapter_gradients(self, name: str) -> dict[str, torch.Tensor]:
        """The accumulated gradients as CPU clones (tensors without one are left out);
        for diagnostics and tests."""
        adapter = self._get(name)
        return {key: p.grad.detach().to("cpu").clone() for key, p in adapter.params.items() if p.grad is not None}

    # ------------------------------------------------------------ training

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        """Score every datum's targets and, unless `batch.forward_only`, add ∇ of the loss
        to the adapter's gradients.

        Returns:
            Per datum, float32 lp with the shape of its target_tokens (pre-update weights),
            and the loss's metrics summed over the datums (`loss:sum` always).
        Raises:
            NotFound: unknown adapter.  BadRequest / NotSupportedYet: see
            `losses.validate_request`, plus bad model inputs and a non-finite loss; no
            gradient is added in any of these cases.
        """
        return self.forward_backward_many(name, [batch])[0]

    def forward_backward_many(self, name: str, batches: Sequence[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        """Several requests of one adapter, in one pass: their datums share micro-batches.

        Each request keeps its own loss function, config, outputs and metrics; the
        gradient added is the sum of theirs. All requests must agree on `forward_only`.
        The call is atomic: if any request fails, nothing is added and the first error
        is raised (the caller reruns the requests one by one to tell whose it was).

        Returns:
            One ForwardBackwardResult per request, in order.
        Raises:
            As `forward_backward`, for the first failing request.
        """
        adapter = self._get(name)
        forward_only = batches[0].forward_only
        assert all(b.forward_only == forward_only for b in batches), "forward_backward_many mixes forward_only"
        requests = []
        for batch in batches:
            self._check_model_inputs(batch.data)
            requests.append(
                losses.validate_request(batch.loss_fn, batch.data, batch.loss_config, vocab_size=self._vocab_size)
            )
        self._activate(name)
        for layer in self._checkpointed_layers:
            # transformers checkpoints a layer only while its own `training` flag is set; only
            # the flag is set, not `.train()`, so dropout below it stays off (eval mode).
            layer.training = True
        if forward_only:
            guard: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        else:
            guard = _gradients_set_aside(list(adapter.params.values()))
        with guard, torch.set_grad_enabled(not forward_only):
            results = self._run_micro_batches(batches, requests)
        self._fb_calls += len(batches)
        self._tokens += sum(len(d.tokens) for batch in batches for d in batch.data)
        return results

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
                losses.check_finite_loss(loss, batches[r].loss_fn)  # before backward: a bad loss adds no gradient
                total = loss if total is None else total + loss
                _scatter(part, indices, request, logprobs[r])
                for key, value in part_metrics.items():
                    metrics[r][key] += value
            assert total is not None and offset == lp.numel(), f"packed {offset} of {lp.numel()} log-probs"
            if torch.is_grad_enabled():
                total.backward()
        return [ForwardBackwardResult(logprobs=lp_list, metrics=m) for lp_list, m in zip(logprobs, metrics)]

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        """One step of the adapter's optimizer with its accumulated gradients.

        Returns:
            {"grad_norm:mean", "learning_rate:mean"}.
        Raises:
            NotFound; BadRequest for params of the other family (gradients kept), invalid
            params or a non-finite gradient norm (optim.py).
        """
        adapter = self._get(name)
        sent = family_of(params)
        if sent != adapter.family:
            expected = "AdamParams" if adapter.family == "adamw" else "DimuonParams"
            version = " (version 1)" if adapter.family == "dimuon" else ""
            raise BadRequest(
                f"optimizer mismatch: model {name} uses {adapter.family!r}{version} but this optim_step sent "
                f"{type(params).__name__}; send {expected}",
                key="optimizer",
            )
        return OptimResult(metrics=adapter.optimizer.step(params))  # type: ignore[arg-type]

    # ------------------------------------------------------------ checkpoints

    def save_state(self, name: str, directory: Path, with_optimizer: bool = True) -> int:
        """Write the adapter (lora_io format), `optimizer.safetensors` when `with_optimizer`,
        and `state.json` into the existing, empty `directory`; every file fsynced.

        Returns:
            Total bytes written.
        """
        adapter = self._get(name)
        size = lora_io.save_adapter(directory, self.adapter_tensors(name), adapter.spec)
        if with_optimizer:
            size += lora_io.write_synced(
                directory / OPTIMIZER_FILE, lora_io.encode_tensors(adapter.optimizer.state_tensors())
            )
        state = TrainerState(
            format_version=STATE_FORMAT_VERSION,
            lora=adapter.spec,
            optimizer=adapter.family,
            optimizer_steps=adapter.optimizer.steps_done,
            has_optimizer_state=with_optimizer,
        )
        size += lora_io.write_synced(directory / STATE_FILE, msgspec.json.encode(state))
        lora_io.fsync_directory(directory)
        return size

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec, with_optimizer: bool, optimizer: str = "adamw"
    ) -> None:
        """Restore the adapter from `directory` (a state or sampler-weights checkpoint),
        adding it with `spec` and `optimizer` if absent. Without `with_optimizer` the
        optimizer starts fresh. Accumulated gradients are dropped. On failure nothing changes.

        Raises:
            BadRequest: "checkpoint has no optimizer state"; a spec that differs from the
                checkpoint's (rank or trained modules); tensors of another shape; an
                `optimizer` that differs from the resident adapter's, or (with optimizer
                state) from the checkpoint's.
        """
        resident = self._adapters.get(name)
        if resident is not None and resident.family != optimizer:
            raise BadRequest(
                f"model {name} uses optimizer {resident.family!r}; cannot load it as {optimizer!r}", key="optimizer"
            )
        tensors, stored = lora_io.load_adapter(directory)
        for field in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if getattr(stored, field) != getattr(spec, field):
                raise BadRequest(
                    f"checkpoint {directory.name!r} has LoRA {field}={getattr(stored, field)!r}; "
                    f"the model wants {field}={getattr(spec, field)!r}",
                    key=field,
                )
        optimizer_path = directory / OPTIMIZER_FILE
        if with_optimizer and not optimizer_path.is_file():
            raise BadRequest(
                f"checkpoint has no optimizer state ({directory.name!r} holds adapter weights only)", key="optimizer"
            )
        optimizer_state = lora_io.read_tensors(optimizer_path) if with_optimizer else None
        if with_optimizer:
            stored_family = _stored_optimizer(directory)
            if stored_family != optimizer:
                raise BadRequest(
                    f"checkpoint {directory.name!r} holds {stored_family!r} optimizer state; the model uses "
                    f"{optimizer!r}: cannot override restored optimizer state",
                    key="optimizer",
                )
        is_new = name not in self._adapters
        if is_new:
            self.add_adapter(name, spec, optimizer)
        try:
            adapter = self._adapters[name]
            _check_same_tensors(directory.name, adapter.params, tensors)
            if optimizer_state is None:
                adapter.optimizer.reset()
            else:
                adapter.optimizer.load_state_tensors(optimizer_state)
        except BaseException:
            if is_new:
                self.drop_adapter(name)
            raise
        with torch.no_grad():
            for key, param in adapter.params.items():
                param.copy_(tensors[key])
        adapter.optimizer.zero_grad()
        logger.info("adapter loaded adapter=%s checkpoint=%s with_optimizer=%s", name, directory, with_optimizer)

    # ------------------------------------------------------------ observability

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            adapters=len(self._adapters),
            optim_steps=sum(a.optimizer.steps_done for a in self._adapters.values()),
            forward_backward_calls=self._fb_calls,
            tokens=self._tokens,
        )

    # ------------------------------------------------------------ internals

    def _get(self, name: str) -> _Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name!r} on this trainer")
        return adapter

    def _activate(self, name: str) -> None:
        """Make `name` the one adapter in the forward pass; peft also makes only its tensors
        require grad, so no other adapter can receive a gradient."""
        if self._active != name:
            assert self._peft is not None
            self._peft.set_adapter(name)
            self._active = name

    def _adapter_parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's LoRA tensors, keyed like peft's state dict (adapter name removed)."""
        assert self._peft is not None
        params: dict[str, torch.nn.Parameter] = {}
        for key, param in self._peft.named_parameters():
            for part in ("lora_A", "lora_B"):
                marker = f".{part}.{name}."
                if marker in key:
                    params[key.replace(marker, f".{part}.")] = param
        assert params, f"peft created no LoRA tensors for adapter {name!r}"
        return params

    def _check_model_inputs(self, data: Sequence[TrainDatum]) -> None:
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
        chunk = self.config.logprob_chunk_positions or max(1, self.config.logits_budget_bytes // (4 * self._vocab_size))
        # One chunk holds every position: the model's own full logits are as cheap and simpler.
        head_chunks = self._chunked_head and sum(lengths) > chunk
        if head_chunks:
            decoder = self._model.get_decoder()
            out = decoder(input_ids=input_ids, attention_mask=model_mask, use_cache=False)
            features = out.last_hidden_state  # (B, T, H)
        else:
            features = self._model(input_ids=input_ids, attention_mask=model_mask, use_cache=False).logits
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
        ids = torch.arange(min(16, self._vocab_size), device=self.device).unsqueeze(0)
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
def _gradients_set_aside(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
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


def _stored_optimizer(directory: Path) -> str:
    """The optimizer family in a state checkpoint's state.json ("adamw" when it has none)."""
    path = directory / STATE_FILE
    if not path.is_file():
        return "adamw"
    return msgspec.json.decode(path.read_bytes(), type=TrainerState).optimizer


def _check_same_tensors(
    checkpoint: str, params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]
) -> None:
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise BadRequest(
            f"checkpoint {checkpoint!r} does not fit this adapter: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    for key, param in params.items():
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise BadRequest(
                f"checkpoint {checkpoint!r}: {key} has shape {list(tensors[key].shape)}; expected {list(param.shape)}"
            )
