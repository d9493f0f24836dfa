"""The torch sampling engine: one base model, many immutable LoRA versions, continuous batching.

`TorchSampler` owns one base model, its tokenizer, the LoRA weight versions
loaded on it as peft adapters (held by `lora_versions.LoraVersions`, which
copies a new version into the adapter of a dropped one of the same shape), and
one running decode batch. It is a
step-level scheduler, driven by its caller:

- `add(request_id, version, job)` validates a `SampleJob` and queues it.
- `step()` admits queued requests (prefill: each prompt runs once, in chunks
  of at most `prefill_chunk_tokens`, shorter where a chunk's attention mask
  and logits would pass `prefill_budget_bytes` (`prefill_chunks`), and every
  sample's first token is drawn from that one prefill; prompts admitted in one
  step that each fit a chunk share one left-padded forward), moves prefilled
  samples into free batch rows,
  runs one decode forward for every running row, and retires the rows that
  finished. It returns the requests that completed in this step.
- `cancel(request_id)` drops a request wherever it is, freeing its rows.

Rows of different requests and different versions share one forward: rows
are left-padded to one KV width (`kv_batch.KvBatch`), and each row gets its
own adapter ("__base__" for the base model). For Llama-family models the
forwards are `fused_forward.FusedForward`, the same math as flat torch calls;
other models run Hugging Face's forward with peft's mixed-batch
`adapter_names` (MoE experts through `moe_lora`). Sliding-window layers keep
only their window in the running batch, linear-attention layers a state per
row (`kv_batch`). So no request waits behind another job's request for more
than the rows it holds. Rows that sample alike (temperature, top_k, top_p)
draw together, whichever request they belong to; so do the first tokens of
the requests prefilled in one step, and the rows they take join the batch's
KV cache in one copy.

Sampling follows Tinker's sampling semantics (the math is in
`sampling_math`): q_T is logits/T, then top-k, then top-p, renormalised, and
a token's logprob is log q_T in fp32 from the same logits; T = 0 is argmax and
reports 0.0. Sample i draws one uniform per step from its own CPU generator
seeded from (seed mod 2^64, i), so its tokens do not depend on what else
shares the batch. Prompt scoring is always the raw model at T = 1.

Prefix cache (`prefix_cache.PrefixCache`, keyed by the version's adapter):
a prompt whose leading whole blocks were run before, under the same weights,
takes their KV from the cache and prefills only the rest (always at least its
last token, whose logits draw the first token; and every position whose
logits the job scores). Every prefill keeps its prompt's blocks, and a
finished sample keeps its prompt + completion's, so that the next turn of an
episode (that prompt, that completion, new text) prefills only what is new.
Completions earn that place: the first `COMPLETION_TRIAL_ROWS` finished
samples keep theirs; if no prompt has reached into a kept completion by then
(single-turn work: a GRPO group's answers, an eval), one sample in
`COMPLETION_SAMPLE_EVERY` keeps its completion from then on, and the first
prompt that reaches into one turns keeping every completion back on.
Prompts admitted in one step that share blocks none of them has yet are
prefilled in two waves: the first computes the shared blocks and the second
reuses them. A version's blocks go when it is dropped, every block on a park,
on `base_weights_changed` and on close. The cache steps aside for models with
linear-attention layers (Qwen3.5): their state after a prefix is not kept at
block boundaries, so every prompt is prefilled whole. For sliding-window
models a finished row longer than its window is not kept (the batch holds
only the window of it); its prompt's blocks were kept at its prefill.

Long prompts on sliding-window models: a prefill keeps every position of its
sliding layers, so that its KV is a plain prefix for the prefix cache; past
`windowed_prefill_tokens` the memory wins instead, and the prefill's sliding
layers keep only their window (`kv_batch`, windowed). Such a prompt may take a
cached prefix but never enters the prefix cache. Why memory wins there: the
sliding layers' KV is most of such a model's (Gemma 3 270M: 15 of 18 layers,
window 512), so at 32k positions keeping every one of them holds ~30x what
the window does, for blocks the prefix cache (256 MiB by default) could keep
only the head of anyway.

Context: a prompt as long as the model's context is refused (BadRequest naming
the limit); a max_tokens (or None) that would pass the context is cut to it, and
the sample ends with "length" there, as vLLM's mapping does
(`vllm_mapping.generation_limit`), so that both backends agree.

`prompt_cache_hit_tokens`: the prompt positions taken from the prefix cache;
and since a request's n samples all start from its one prefilled KV cache,
when n > 1 and anything is generated the whole prompt was reused, and the
request reports len(prompt).

Guarantees: versions are immutable once loaded; loading a version never
changes the shared base weights; version `None` is always the base model
exactly; a version in use by a live request cannot be dropped.

It never imports trio, never knows about sessions or futures, and is not
thread-safe: the caller makes one call at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import secrets
from pathlib import Path
from typing import TypedDict

import msgspec
import numpy as np
import torch
import transformers

from openrld import heap
from openrld.batches import LoraSpec, SampledSequence, SampleJob, SampleResult, SyncStats, TopK
from openrld.engine_types import Finished, WeightPayload
from openrld.errors import BadRequest
from openrld.gpu import call_threads, models, moe_lora, offload, packed_linear
from openrld.gpu.fused_forward import BASE_ADAPTER, FusedForward
from openrld.gpu.kv_batch import (
    KvBatch,
    KvLayers,
    UnsupportedCache,
    cache_holding,
    cache_tensors,
    can_window,
    prefill_cache,
    prefix_reuse_unsupported,
)
from openrld.gpu.lora_versions import LoraVersions, ServesLoraVersions
from openrld.gpu.prefill_chunks import chunk_spans
from openrld.gpu.prefix_cache import DEFAULT_BLOCK_TOKENS, PrefixCache, PrefixCacheStatistics
from openrld.gpu.sample_alone import sample_alone
from openrld.gpu.sampling_math import (
    TOPK_EMPTY_LOGPROB,
    TOPK_EMPTY_TOKEN,
    StopStringWatch,
    draw_from,
    empty_topk,
    processed_logprobs,
    stream_seed,
    top_k_rows,
)

__all__ = ["TOPK_EMPTY_LOGPROB", "TOPK_EMPTY_TOKEN", "TorchSampler", "TorchSamplerStatistics"]

logger = logging.getLogger(__name__)

STOP = "stop"
LENGTH = "length"
UNIFORM_BLOCK = 32  # uniforms a sample draws from its generator at once
# 256 MiB of prefix KV: SmolLM2-135M in fp32 keeps ~46 KiB a token, so ~5,800 tokens (an
# RL step's shared prefixes and the recent turns of a few dozen episodes); a model 10x
# larger per token still keeps a few hundred tokens, a system prompt.
DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
# Finished samples that keep their completions' KV before any reuse of one is seen; then one in
# COMPLETION_SAMPLE_EVERY, enough to notice an episode's next turn. The text-to-SQL sweep's
# completions are never reused, and their blocks took 2 of each answer's ~12 (issue 36).
COMPLETION_TRIAL_ROWS = 256
COMPLETION_SAMPLE_EVERY = 16
COMPLETION_NAMES_KEPT = 1 << 16  # completion blocks remembered (names, not KV)
# What one prefill chunk's attention mask and logits may hold: the trainer's logits budget.
# At 32k cached positions a chunk's mask takes ~160 KiB a position (fp32 + bool), so ~1,600
# positions a chunk; scoring SmolLM2's 49k vocabulary adds ~590 KiB a position.
DEFAULT_PREFILL_BUDGET_BYTES = 256 * 2**20
# Past this many prompt positions, a sliding-window model's prefill keeps only each sliding
# layer's window; a shorter prompt keeps every position, for the prefix cache. Gemma 3 270M
# keeps ~36 KiB a position with every one: 8k positions are ~290 MiB, past the prefix cache's
# default budget, so longer prompts could only ever be cached in part.
DEFAULT_WINDOWED_PREFILL_TOKENS = 8192


class SamplerOptions(TypedDict, total=False):
    """`TorchSampler`'s keyword options, for those that pass them on (`FullSampler`, the worker's engine table)."""

    decode_batch_rows: int
    prefill_chunk_tokens: int
    prefill_tokens_per_step: int
    prefill_budget_bytes: int
    windowed_prefill_tokens: int
    fused_forward: bool
    prefix_cache_bytes: int
    prefix_block_tokens: int
    packed_weights: bool


class TorchSamplerStatistics(msgspec.Struct, frozen=True):
    versions_loaded: int  # LoRA versions held now; the base model is not counted
    requests_done: int
    samples_done: int
    tokens_generated: int
    prompt_tokens_prefilled: int
    requests_queued: int  # added, not yet prefilled
    requests_running: int  # prefilled, with samples in (or waiting for) batch rows
    rows_running: int
    decode_steps: int
    prefix_cache: PrefixCacheStatistics  # cross-request prompt KV reuse
    adapters_made: int = 0  # peft adapters created for versions
    adapters_reused: int = 0  # versions copied into the adapter of a dropped version
    adapters_free: int = 0  # adapters of dropped versions kept for reuse now
    packed_weight_bytes: int = 0  # base weights held packed for oneDNN now (`packed_linear`), as dense bytes


# ---------------------------------------------------------------------------
# Per-request state


@dataclasses.dataclass(slots=True)
class _Sample:
    generator: torch.Generator | None  # None at T = 0, which draws nothing
    watch: StopStringWatch | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    topk_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    topk_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    stop_reason: str | None = None  # set once the sample is finished
    uniforms: list[float] = dataclasses.field(default_factory=list)  # drawn ahead, next one last

    def next_uniform(self) -> float:
        """The next uniform of this sample's stream. Drawn UNIFORM_BLOCK at a time: one
        torch.rand call per step per sample cost more than the rest of the draw. torch's CPU
        generator yields the same stream in blocks as one at a time."""
        if not self.uniforms:
            assert self.generator is not None, "a sample at T = 0 draws no uniforms"
            block = torch.rand(UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64)
            self.uniforms = block.tolist()[::-1]
        return self.uniforms.pop()


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    version: str | None
    adapter: str  # the peft adapter name of its rows
    job: SampleJob
    limit: int  # generated tokens allowed per sample: max_tokens and the context window
    samples: list[_Sample]
    prompt_ids: list[int]  # job.prompt as Python ints, for the prefix cache's block hashes
    cache_hit_tokens: int = 0  # leading prompt positions whose KV came from the prefix cache
    prefix: KvLayers | None = None  # that KV, from lookup until the prefill takes it
    prefill: KvLayers | None = None  # batch 1, held until every sample has a row
    pending: list[_Sample] = dataclasses.field(default_factory=list)  # first token drawn, no row yet
    prompt_logprobs: np.ndarray | None = None
    topk_prompt: TopK | None = None

    @property
    def is_done(self) -> bool:
        return all(s.stop_reason is not None for s in self.samples)


@dataclasses.dataclass(slots=True, eq=False)
class _PromptWork:
    """What prefilling one request's prompt computes, filled in chunk by chunk (`take`)."""

    prompt: torch.Tensor  # (P,) int64 on the device
    first_needed: int  # the first position whose logits are needed
    scores: bool  # prompt logprobs or top-k prompt logprobs were asked for
    k: int  # top-k prompt logprobs
    logprobs: np.ndarray  # (P,) float32, NaN where not scored
    topk_ids: np.ndarray
    topk_lps: np.ndarray
    last_logits: torch.Tensor | None = None  # (V,) after the last prompt token

    @classmethod
    def of(cls, request: _Request, device: torch.device) -> _PromptWork | None:
        """None when the request needs no forward at all (nothing to generate or score)."""
        job = request.job
        scores = job.prompt_logprobs or job.topk_prompt_logprobs > 0
        if request.limit == 0 and not scores:
            return None
        prompt = torch.as_tensor(job.prompt, dtype=torch.int64, device=device)
        prompt_len = prompt.shape[0]
        first_needed = _first_needed(job)
        k = job.topk_prompt_logprobs
        topk_ids, topk_lps = empty_topk(prompt_len, k)
        logprobs = np.full(prompt_len, np.nan, np.float32)
        return cls(prompt, first_needed, scores, k, logprobs, topk_ids, topk_lps)

    def take(self, logits: torch.Tensor, lo: int, end: int) -> None:
        """Score one chunk: `logits` (end - lo, V) fp32 for positions lo .. end-1 (one row,
        position end-1, when lo >= end)."""
        prompt_len = len(self.prompt)
        if end == prompt_len:
            self.last_logits = logits[-1]
        scored_end = min(end, prompt_len - 1)  # position P-1 predicts no prompt token
        if not self.scores or lo >= scored_end:
            return
        logp = torch.log_softmax(logits[: scored_end - lo], dim=-1)  # (n, V), rows lo .. scored_end-1
        targets = self.prompt[lo + 1 : scored_end + 1]
        self.logprobs[lo + 1 : scored_end + 1] = logp.gather(-1, targets[:, None])[:, 0].cpu().numpy()
        if self.k > 0:
            self.topk_ids[lo + 1 : scored_end + 1], self.topk_lps[lo + 1 : scored_end + 1] = top_k_rows(logp, self.k)


def _first_needed(job: SampleJob) -> int:
    """The first prompt position whose logits the job needs; the positions before it may come
    from the prefix cache."""
    prompt_len = len(job.prompt)
    if not (job.prompt_logprobs or job.topk_prompt_logprobs > 0):
        return prompt_len - 1  # the last position's logits draw the first token
    first_scored = prompt_len - (job.prompt_logprobs_last_n or prompt_len - 1)  # position 0 never
    # Logits at position q predict q + 1: scoring needs rows first_scored-1 .. P-2, sampling P-1.
    return first_scored - 1


def _uncached_len(request: _Request) -> int:
    return len(request.job.prompt) - request.cache_hit_tokens


# ---------------------------------------------------------------------------
# The engine


class TorchSampler(offload.ParksInSlot, ServesLoraVersions):
    """Samples from one base model and the LoRA versions loaded on it.

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        device, dtype: where and in what the model computes (dtype: `models.pick_dtype`).
        decode_batch_rows: at most this many samples decode together; a request
            with more samples moves them into rows as rows free up.
        prefill_chunk_tokens: a prompt is prefilled at most this many tokens at a
            time.
        prefill_budget_bytes: and fewer where a chunk's attention mask (chunk, its
            end) and its needed logits (chunk, vocab) would hold more than this; so
            a long prompt's prefill memory stays bounded however long it grows.
        windowed_prefill_tokens: on a model with sliding-window layers, a longer
            prompt prefills with those layers keeping only their window, and is not
            kept in the prefix cache (see the module docstring).
        prefill_tokens_per_step: one step prefills new prompts up to this many
            tokens (always at least one prompt), so that admitting a burst of
            requests does not stall the running rows for long.
        fused_forward: decode and prefill with `fused_forward.FusedForward` (the
            same math as flat torch calls) where the architecture allows; False
            keeps Hugging Face's forward for every call.
        prefix_cache_bytes: the most KV the cross-request prefix cache keeps, on
            `device`; 0 turns it off.
        prefix_block_tokens: prefixes are cached and matched in blocks of this
            many positions.
        packed_weights: on the CPU, the forward (the fused one, or Hugging Face's for the
            other families) multiplies by copies of the base weights packed for oneDNN
            (`packed_linear`), given back at each park; False for weights patched in
            place (the full sampler's).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        decode_batch_rows: int = 256,
        prefill_chunk_tokens: int = 1024,
        prefill_tokens_per_step: int = 2048,
        prefill_budget_bytes: int = DEFAULT_PREFILL_BUDGET_BYTES,
        windowed_prefill_tokens: int = DEFAULT_WINDOWED_PREFILL_TOKENS,
        fused_forward: bool = True,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_block_tokens: int = DEFAULT_BLOCK_TOKENS,
        packed_weights: bool = True,
    ) -> None:
        assert decode_batch_rows >= 1 and prefill_chunk_tokens >= 1 and prefill_tokens_per_step >= 1
        assert prefill_budget_bytes >= 1 and windowed_prefill_tokens >= 1
        self._device = device
        self._model = models.load_causal_lm(model_dir, device, dtype)
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self._vocab = models.vocab_size(self._model)
        self._context = models.max_context(self._model)
        self._eos_ids = _eos_ids(self._tokenizer, self._model)
        # peft injects its adapters into this same model, so the fused forward sees every version.
        # Packed where oneDNN can take the weights and repays it (`packed_linear.usable`: float32 on
        # the CPU, and not small).
        self._fused = FusedForward.for_model(self._model, packed_weights=packed_weights) if fused_forward else None
        # Whichever forward runs holds the packed copies: the fused one, or, for the families it does
        # not run, HF's own through its linears.
        self._packs: FusedForward | packed_linear.PackedLinears | None = (
            self._fused if self._fused is not None
            else packed_linear.PackedLinears.for_model(self._model) if packed_weights else None
        )
        self._weights = call_threads.weights(self._model)  # a forward's size, for its CPU threads
        self._decode_batch_rows = decode_batch_rows
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._prefill_tokens_per_step = prefill_tokens_per_step
        self._prefill_budget_bytes = prefill_budget_bytes
        # A longer prompt prefills windowed; None: this model has nothing to window.
        self._windowed_prefill_tokens = windowed_prefill_tokens if can_window(self._model.config) else None
        # The fused forward binds to peft's linears (the first adapter swaps them in) and their
        # adapters; peft's expert wrappers (MoE models) get a forward that serves mixed batches.
        self._mixed_experts = False  # whether peft wrapped MoE experts (`moe_lora`)
        self._versions = LoraVersions(self._model, self._adapters_changed)
        self._requests: dict[str, _Request] = {}  # every live request
        self._queued: collections.deque[_Request] = collections.deque()  # not yet prefilled
        self._prefilled: collections.deque[_Request] = collections.deque()  # samples waiting for rows
        try:
            self._batch = KvBatch(self._model.config, device)
        except UnsupportedCache as e:
            raise BadRequest(f"the torch sampler cannot hold a {self._model.config.model_type!r} model: {e}") from None
        self._rows: list[tuple[_Request, _Sample]] = []  # row r of the batch
        no_prefix_reuse = prefix_reuse_unsupported(self._model.config)
        if no_prefix_reuse is not None and prefix_cache_bytes > 0:
            logger.info("prefix cache off for this model: %s", no_prefix_reuse)
            prefix_cache_bytes = 0
        self._prefixes = PrefixCache(prefix_cache_bytes, prefix_block_tokens)  # keyed by adapter name
        self._completion_blocks: set[int] = set()  # chain names of kept blocks that hold completion tokens
        self._completions_reused = False  # whether a prompt's cached prefix has reached into one
        self._completion_rows = 0  # finished samples that could have kept their completion
        self._requests_done = 0
        self._samples_done = 0
        self._tokens_generated = 0
        self._prompt_tokens_prefilled = 0
        self._decode_steps = 0
        # Parked while the time-slicer gives the device to another.
        self._slot = offload.ParkSlot(
            "sampler", device, lambda: offload.module_tensors(self._model), drop_caches=self._drop_caches
        )

    # -- versions ---------------------------------------------------------

    def _adapters_changed(self) -> None:
        if self._fused is not None:
            self._fused.bind()
        self._mixed_experts = moe_lora.enable_mixed_batches(self._model) > 0

    def has_version(self, version: str | None) -> bool:
        return version is None or version in self._versions

    def base_weights(self) -> dict[str, torch.nn.Parameter]:
        """The base model's parameters by name, for an owner that replaces them in place
        between steps (full fine-tuning: `full_sampler`); LoRA versions never change them.
        That owner calls `base_weights_changed` after each change."""
        return dict(self._model.named_parameters())

    def base_weights_changed(self) -> None:
        """The base weights were replaced in place: every cached prefix's KV is stale, under
        every version (each adds its adapter to the base), and so is any packed copy of them."""
        self._prefixes.clear()
        self._drop_packed()

    def bound_prefix_cache(self, budget_bytes: int) -> int:
        """Hold the prefix cache to `budget_bytes` from now on: the node's share for this engine
        (actors/host_memory.py), never past `prefix_cache_bytes`; the bytes it holds after."""
        return self._prefixes.resize(budget_bytes)

    def validate(self, job: SampleJob) -> None:
        """Raise BadRequest for a job that `add` would refuse (the message names the field)."""
        _validate(job, self._vocab, self._context)

    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        """Load an immutable LoRA version from the trainer's `get_peft_model_state_dict` tensors.

        Raises:
            ValueError: no spec (not a LoRA version), `version` is already loaded, a LoRA
                tensor is missing, unexpected or misshapen, or a base-weight tensor differs
                from this sampler's base weights.
        """
        if spec is None or not isinstance(payload, dict):
            raise ValueError(f"weight version {version!r} is not a LoRA adapter; this sampler serves LoRA versions")
        self._require_resident("load_version")  # peft would create the new tensors on the host
        adapter = self._versions.load(version, payload, spec)
        self._prefixes.drop(adapter)  # a reused adapter's prefixes went with its version; never serve any

    def drop_version(self, version: str) -> None:
        """Free a version.

        Raises:
            KeyError: it is not loaded.
            ValueError: a live request samples from it.
        """
        self._refuse_in_use(version)
        self._prefixes.drop(self._versions.drop(version))

    def versions_in_use(self) -> set[str]:
        """Versions that a live request samples from; they cannot be dropped."""
        return {r.version for r in self._requests.values() if r.version is not None}

    def _adapter_name(self, version: str | None) -> str:
        return BASE_ADAPTER if version is None else self._versions.adapter(version)

    # -- scheduling -------------------------------------------------------

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        """Queue one sampling request on `version` (None: the base model); `step` runs it.

        Raises:
            BadRequest: the job is invalid (the message names the field and the value).
            KeyError: `version` is not loaded.
            ValueError: `request_id` is already live.
        """
        _validate(job, self._vocab, self._context)
        if version is not None and version not in self._versions:
            raise KeyError(f"weight version {version!r} is not loaded")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the sampler")
        limit = self._context - len(job.prompt)  # generated tokens sit at positions P .. context-1
        if job.params.max_tokens is not None:
            limit = min(limit, job.params.max_tokens)
        request = _Request(
            request_id=request_id, version=version, adapter=self._adapter_name(version), job=job,
            limit=limit, samples=self._new_samples(job), prompt_ids=job.prompt.tolist(),
        )
        self._requests[request_id] = request
        self._queued.append(request)

    def cancel(self, request_id: str) -> bool:
        """Drop a live request and free its rows; False if it is not live (finished or unknown)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request in self._queued:
            self._queued.remove(request)
        if request in self._prefilled:
            self._prefilled.remove(request)
        self._keep_rows([r for r, (owner, _) in enumerate(self._rows) if owner is not request])
        logger.info("cancelled sample request_id=%s", request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[Finished]:
        """Admit and prefill what fits, fill free rows, decode one token for every row.

        Returns:
            The requests that completed in this step, in completion order.
        """
        self._require_resident("step")
        finished: list[Finished] = []
        with torch.inference_mode():
            self._admit(finished)
            self._fill_rows()
            if self._rows:
                self._decode_step(finished)
        return finished

    def sample(self, version: str | None, job: SampleJob) -> SampleResult:
        """Run one request alone to completion on the idle engine (`sample_alone`)."""
        return sample_alone(self, version, job)

    def _admit(self, finished: list[Finished]) -> None:
        """Prefill queued requests, in arrival order, while rows and the step's prefill budget allow."""
        budget = self._prefill_tokens_per_step
        admitted: list[_Request] = []
        while self._queued:
            request = self._queued[0]
            # Admitted requests not yet prefilled count with all their samples.
            waiting_rows = sum(len(r.pending) for r in self._prefilled) + sum(r.job.num_samples for r in admitted)
            has_room = len(self._rows) + waiting_rows < self._decode_batch_rows
            if request.limit > 1 and not has_room:
                break  # its samples would only wait for rows, holding a prefill cache meanwhile
            # Only what the prefix cache does not hold will be computed.
            cost = len(request.job.prompt) - self._cached_tokens(request)
            if budget < self._prefill_tokens_per_step and cost > budget:
                break
            self._queued.popleft()
            budget -= cost
            admitted.append(request)
        first: list[tuple[_Request, torch.Tensor]] = []
        for wave in self._prefill_waves(admitted):
            for request in wave:
                self._look_up_prefix(request)
            for group in self._prefill_groups(wave):
                first += self._prefill(group[0]) if len(group) == 1 else self._prefill_together(group)
        self._draw_first(first)
        for request in admitted:
            if request.pending:
                self._prefilled.append(request)
            else:
                finished.append(self._finish(request))

    # -- prefix cache -----------------------------------------------------

    def _cacheable(self, request: _Request) -> int:
        """How many leading prompt positions may come from the prefix cache."""
        return _first_needed(request.job)

    def _cached_tokens(self, request: _Request) -> int:
        return self._prefixes.cached_tokens(request.adapter, request.prompt_ids, self._cacheable(request))

    def _look_up_prefix(self, request: _Request) -> None:
        """Take the longest cached prefix of the request's prompt, if any, for its prefill."""
        if request.limit == 0 and not (request.job.prompt_logprobs or request.job.topk_prompt_logprobs > 0):
            return  # no forward at all
        hit, prefix = self._prefixes.match(request.adapter, request.prompt_ids, self._cacheable(request))
        request.cache_hit_tokens, request.prefix = hit, prefix
        if hit and not self._completions_reused:
            reached = self._prefixes.chain(request.adapter, request.prompt_ids, hit)
            self._completions_reused = not self._completion_blocks.isdisjoint(reached)

    def _prefill_waves(self, requests: list[_Request]) -> list[list[_Request]]:
        """Split requests admitted together so that blocks some of them share, and the cache
        lacks, are computed once: a request that an earlier one's prefill would give a longer
        cached prefix than the cache has now waits for the second wave."""
        if not self._prefixes.is_enabled or len(requests) < 2:
            return [requests]
        first: list[_Request] = []
        later: list[_Request] = []
        coming: set[int] = set()  # blocks the first wave's prefills will cache
        for request in requests:
            wanted = self._prefixes.chain(request.adapter, request.prompt_ids, self._cacheable(request))
            shared = next((i for i, name in enumerate(wanted) if name not in coming), len(wanted))
            if shared * self._prefixes.block_tokens > self._cached_tokens(request):
                later.append(request)
            else:
                first.append(request)
                coming.update(self._prefixes.chain(request.adapter, request.prompt_ids))
        return [wave for wave in (first, later) if wave]

    def _keep_prefix(self, request: _Request, tokens: list[int], layers: KvLayers) -> None:
        """Cache the whole blocks of `tokens`, whose KV `layers` holds from column 0."""
        self._prefixes.insert(request.adapter, tokens, layers)

    def _keep_finished_rows(self) -> None:
        """Cache the prompt + completion KV of the rows that finished in this step (all but the
        last token, which no forward has seen), for a next turn that extends them."""
        for row, (request, s) in enumerate(self._rows):
            if s.stop_reason is None:
                continue
            tokens = request.prompt_ids + s.tokens[:-1]
            if len(tokens) < self._prefixes.block_tokens or not self._keeps_completion():
                continue
            # None where a sliding-window layer kept only its window of a long row: its prompt's
            # blocks were kept at its prefill, and the completion is not.
            layers = self._batch.row_layers(row)
            if layers is not None:
                self._keep_prefix(request, tokens, layers)
                completion = len(request.prompt_ids) // self._prefixes.block_tokens  # its first block
                self._completion_blocks.update(self._prefixes.chain(request.adapter, tokens)[completion:])

    def _keeps_completion(self) -> bool:
        """Whether this finished sample keeps its completion (the module docstring says when)."""
        self._completion_rows += 1
        if self._completions_reused or self._completion_rows <= COMPLETION_TRIAL_ROWS:
            return True
        if len(self._completion_blocks) > COMPLETION_NAMES_KEPT:
            self._completion_blocks.clear()  # names only; the oldest are long evicted
        return self._completion_rows % COMPLETION_SAMPLE_EVERY == 0

    # -- prefill ----------------------------------------------------------

    def _prefill_groups(self, requests: list[_Request]) -> list[list[_Request]]:
        """Requests whose prompts share one fused forward (what each computes, its prompt after
        its cached prefix, fits one prefill chunk, and so do the group's padded tokens); every
        other request is a group of its own."""
        if self._fused is None:
            return [[r] for r in requests]
        chunk = self._prefill_chunk_tokens
        short = sorted((r for r in requests if _uncached_len(r) <= chunk), key=_uncached_len)
        groups = [[r] for r in requests if _uncached_len(r) > chunk]
        together: list[_Request] = []
        for request in short:  # ascending length: the newest member is the longest
            if together and (len(together) + 1) * _uncached_len(request) > chunk:
                groups.append(together)
                together = []
            together.append(request)
        if together:
            groups.append(together)
        return groups

    def _fill_rows(self) -> None:
        """Give free batch rows to prefilled samples, oldest request first."""
        joining: list[tuple[KvLayers, int]] = []
        while self._prefilled and len(self._rows) < self._decode_batch_rows:
            request = self._prefilled[0]
            taken = request.pending[: self._decode_batch_rows - len(self._rows)]
            assert request.prefill is not None
            joining.append((request.prefill, len(taken)))
            self._rows.extend((request, s) for s in taken)
            request.pending = request.pending[len(taken) :]
            if not request.pending:
                request.prefill = None
                self._prefilled.popleft()
        if joining:
            self._batch.join(joining)

    def _decode_step(self, finished: list[Finished]) -> None:
        """One forward for every row (each with its own adapter), then draw, record and retire."""
        inputs = torch.tensor([s.tokens[-1] for _, s in self._rows], dtype=torch.int64, device=self._device)
        adapters = [r.adapter for r, _ in self._rows]
        if self._fused is not None:
            logits = self._fused.decode(inputs, self._batch, adapters).float()  # (B, V)
        else:
            mask, positions = self._batch.mask_and_positions()
            cache = self._batch.cache
            out = self._forward(inputs[:, None], cache, adapters, attention_mask=mask, position_ids=positions)
            logits = out.logits[:, -1, :].float()
        self._batch.advance()
        self._decode_steps += 1
        # Rows that sample alike draw together, whichever request they belong to.
        alike: dict[tuple[float, int, float], list[int]] = {}
        for row, (request, _) in enumerate(self._rows):
            alike.setdefault(_alike(request), []).append(row)
        for rows in alike.values():
            if len(rows) < len(self._rows):
                index = torch.tensor(rows, dtype=torch.int64, device=self._device)
                self._draw([(self._rows[r][0], [self._rows[r][1]]) for r in rows], logits.index_select(0, index))
            else:
                self._draw([(request, [s]) for request, s in self._rows], logits)
        requests = list(dict.fromkeys(request for request, _ in self._rows))
        if self._prefixes.is_enabled:
            self._keep_finished_rows()
        self._keep_rows([r for r, (_, s) in enumerate(self._rows) if s.stop_reason is None])
        finished.extend(self._finish(request) for request in requests if request.is_done)

    def _keep_rows(self, rows: list[int]) -> None:
        # Finished rows leave the batch: their cache rows are dropped, not masked.
        self._batch.keep(rows)
        self._rows = [self._rows[r] for r in rows]
        if not self._rows and not self._prefilled and not self._queued:
            heap.trim(heap.TRIM_AT_BYTES)  # run dry: what the prefills and decode steps left in the arenas (heap.py)

    def _forward(
        self, input_ids: torch.Tensor, cache: transformers.DynamicCache, adapters: list[str], **kwargs: object
    ):
        call_threads.compute_on(self._weights, input_ids.numel())
        if self._versions.peft is None:
            return self._model(input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
        if self._mixed_experts and input_ids.shape[1] > 1:
            # A prefill (one request, one adapter) of a MoE model: its blocks flatten rows and
            # positions into one axis before the shared expert's linears, which then cannot
            # take per-row adapter names; so the one adapter runs as the active one.
            (adapter,) = set(adapters)
            return self._versions.run_as(adapter, input_ids=input_ids, cache=cache, use_cache=True, **kwargs)
        return self._versions.peft(input_ids=input_ids, cache=cache, use_cache=True, adapter_names=adapters, **kwargs)

    def _finish(self, request: _Request) -> Finished:
        del self._requests[request.request_id]
        for s in request.samples:
            if s.stop_reason is None:
                s.stop_reason = LENGTH  # only when limit == 0: nothing was generated
        job = request.job
        shared_prompt = job.num_samples > 1 and request.limit > 0
        cache_hit_tokens = len(job.prompt) if shared_prompt else request.cache_hit_tokens
        self._requests_done += 1
        self._samples_done += len(request.samples)
        self._tokens_generated += sum(len(s.tokens) for s in request.samples)
        result = SampleResult(
            sequences=[_to_sequence(s, job.topk_sample_logprobs) for s in request.samples],
            prompt_logprobs=request.prompt_logprobs if job.prompt_logprobs else None,
            topk_prompt=request.topk_prompt,
            prompt_cache_hit_tokens=cache_hit_tokens,
        )
        return Finished(request_id=request.request_id, result=result)

    # -- sampling ---------------------------------------------------------

    def _new_samples(self, job: SampleJob) -> list[_Sample]:
        params = job.params
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        samples = []
        for i in range(job.num_samples):
            generator = None
            if params.temperature > 0:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(stream_seed(seed, i))
            watch = StopStringWatch(params.stop_strings, self._decode_text) if params.stop_strings else None
            samples.append(_Sample(generator=generator, watch=watch))
        return samples

    def _decode_text(self, ids: list[int]) -> str:
        # No clean-up of spaces, so that decoding more tokens only ever appends text.
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _prefill(self, request: _Request) -> list[tuple[_Request, torch.Tensor]]:
        """Run the prompt through the model once, chunk by chunk, scoring what the job asks.

        Sets the request's prompt scores and its batch-1 cache. Returns the request with
        its logits after the last prompt token, which its samples' first tokens are drawn
        from (`_draw_first`), or nothing when it generates nothing.
        """
        work = _PromptWork.of(request, self._device)
        if work is None:
            return []
        prompt = work.prompt
        windowed = self._is_windowed(request)
        if request.prefix is not None:
            cache = cache_holding(self._model.config, request.prefix, windowed=windowed)
            request.prefix = None
        else:
            cache = prefill_cache(self._model.config, windowed=windowed)
        for start, end in self._chunk_spans(request, work):
            lo = max(start, work.first_needed)
            # logits_to_keep=0 would mean "all", so a chunk that needs none still keeps one row.
            keep = end - lo if lo < end else 1
            if self._fused is not None:
                logits = self._fused.prefill(prompt[start:end], cache, request.adapter, keep).float()
            else:
                out = self._forward(prompt[None, start:end], cache, [request.adapter], logits_to_keep=keep)
                logits = out.logits[0].float()  # (keep, V): positions end-keep .. end-1
            self._prompt_tokens_prefilled += end - start
            work.take(logits, lo, end)
        layers = cache_tensors(cache)
        if not windowed:  # a windowed cache's sliding layers hold no plain prefix
            self._keep_prefix(request, request.prompt_ids, layers)
        return self._prefilled_into(request, work, layers)

    def _is_windowed(self, request: _Request) -> bool:
        """Whether the request's prefill keeps only each sliding layer's window."""
        limit = self._windowed_prefill_tokens
        return limit is not None and len(request.job.prompt) > limit

    def _chunk_spans(self, request: _Request, work: _PromptWork) -> list[tuple[int, int]]:
        """The position spans the prefill computes, each chunk's mask and logits within the budget."""
        prompt_len = len(work.prompt)
        element = self._model.get_input_embeddings().weight.element_size()
        return list(chunk_spans(
            request.cache_hit_tokens, prompt_len,
            cap_tokens=self._prefill_chunk_tokens,
            budget_bytes=self._prefill_budget_bytes,
            key_bytes=element + 1,  # the bool mask and the additive one in the model's dtype
            logit_bytes=self._vocab * (element + 4 + 4),  # logits, as fp32, and their log-softmax
            first_scored=work.first_needed if work.scores else prompt_len,
        ))

    def _prefill_together(self, requests: list[_Request]) -> list[tuple[_Request, torch.Tensor]]:
        """`_prefill` for several requests whose prompts (after their cached prefixes) share one
        fused forward."""
        works = [(request, work) for request in requests if (work := _PromptWork.of(request, self._device)) is not None]
        if not works:
            return []
        assert self._fused is not None
        needed = [len(work.prompt) - work.first_needed for _, work in works]
        logits, caches = self._fused.prefill_many(
            [work.prompt[request.cache_hit_tokens :] for request, work in works],
            [request.adapter for request, _ in works],
            max(needed),
            pasts=[request.prefix for request, _ in works],
        )
        first = []
        for (request, work), rows, own, cache in zip(works, needed, logits.float(), caches):
            request.prefix = None
            self._prompt_tokens_prefilled += len(work.prompt) - request.cache_hit_tokens
            work.take(own[len(own) - rows :], work.first_needed, len(work.prompt))
            self._keep_prefix(request, request.prompt_ids, cache)
            first += self._prefilled_into(request, work, cache)
        return first

    def _prefilled_into(
        self, request: _Request, work: _PromptWork, cache: KvLayers
    ) -> list[tuple[_Request, torch.Tensor]]:
        """Record a finished prefill: the prompt's scores and the cache its samples will decode
        from. Returns what `_prefill` returns."""
        job = request.job
        request.prompt_logprobs = work.logprobs
        if job.topk_prompt_logprobs:
            request.topk_prompt = TopK(token_ids=work.topk_ids, logprobs=work.topk_lps)
        if request.limit == 0:
            return []
        assert work.last_logits is not None
        request.prefill = cache
        return [(request, work.last_logits)]

    def _draw_first(self, prefilled: list[tuple[_Request, torch.Tensor]]) -> None:
        """Every sample's first token, from its request's logits after the prompt; requests that
        sample alike draw in one call. The samples still running are left in `pending`."""
        alike: dict[tuple[float, int, float], list[tuple[_Request, torch.Tensor]]] = {}
        for request, logits in prefilled:
            alike.setdefault(_alike(request), []).append((request, logits))
        for group in alike.values():
            self._draw([(request, request.samples) for request, _ in group], torch.stack([x for _, x in group]))
        for request, _ in prefilled:
            request.pending = [s for s in request.samples if s.stop_reason is None]
            if not request.pending:
                request.prefill = None

    def _draw(self, owners: list[tuple[_Request, list[_Sample]]], logits: torch.Tensor) -> None:
        """Draw one token for each sample and record it; all of them share temperature, top_k and top_p.

        Args:
            owners: one (request, samples) per row of `logits`; each of the samples draws from
                that row (a decode row holds one sample; a prompt's row holds all of its samples).
            logits: (len(owners), V) fp32.
        """
        params = owners[0][0].job.params
        counts = [len(samples) for _, samples in owners]
        width = max(counts)
        if params.temperature == 0:
            tokens = torch.argmax(logits, dim=-1, keepdim=True).expand(-1, width)  # (R, width)
            logprobs, logq = torch.zeros(tokens.shape), None
        else:
            logq = processed_logprobs(logits, params)
            # One uniform from each sample's own stream, so its tokens never depend on its neighbours.
            drawn = torch.tensor([s.next_uniform() for _, group in owners for s in group], dtype=torch.float64)
            tokens = draw_from(logq, _uniform_rows(drawn, counts, width))  # (R, width)
            logprobs = logq.gather(-1, tokens)
        k = max(request.job.topk_sample_logprobs for request, _ in owners)
        topk = self._topk_sample_rows(logq, tokens[:, 0], k)
        for row, ((request, samples), row_tokens, row_logprobs) in enumerate(
            zip(owners, tokens.tolist(), logprobs.tolist())
        ):
            for s, token, logprob in zip(samples, row_tokens, row_logprobs):  # a short row's padding is left
                self._record(request, s, token, logprob, topk, row)

    def _topk_sample_rows(
        self, logq: torch.Tensor | None, tokens: torch.Tensor, k: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Top-k rows of q_T for this step; at T = 0 (logq None) q is a point mass on the argmax."""
        if k == 0:
            return None
        if logq is not None:
            return top_k_rows(logq, k)
        ids, lps = empty_topk(tokens.shape[0], k)
        ids[:, 0] = tokens.cpu().numpy()
        lps[:, 0] = 0.0
        return ids, lps

    def _record(
        self,
        request: _Request,
        s: _Sample,
        token: int,
        logprob: float,
        topk: tuple[np.ndarray, np.ndarray] | None,
        row: int,
    ) -> None:
        """Append one token to a sample and decide whether it has finished, and why.

        `topk` holds at least the request's k columns (rows that draw together share
        the widest k asked); the best entries come first, so the first k are its own.
        """
        params = request.job.params
        s.tokens.append(token)
        s.logprobs.append(logprob)
        k = request.job.topk_sample_logprobs
        if k > 0:
            assert topk is not None
            s.topk_ids.append(topk[0][row, :k])
            s.topk_logprobs.append(topk[1][row, :k])
        stops_on_id = token in params.stop_token_ids or (params.stop_at_eos and token in self._eos_ids)
        # The watch must see every token, so it is fed even when the id already stops.
        stops_on_text = s.watch is not None and s.watch.push(token)
        if stops_on_id or stops_on_text:
            s.stop_reason = STOP  # also when this was the last allowed token
        elif len(s.tokens) >= request.limit:
            s.stop_reason = LENGTH

    # -- time-slicing -----------------------------------------------------

    # park, resume, is_parked: offload.ParksInSlot, over the model and every loaded version; a
    # park drops the caches first (queued requests stay queued).
    def _drop_caches(self) -> int:
        """Free the decode batch's KV cache, the prefix cache and the packed weights; their
        bytes. Raises CannotPark while a request decodes."""
        if self._rows or self._prefilled:
            live = sorted({r.request_id for r, _ in self._rows} | {r.request_id for r in self._prefilled})
            raise offload.CannotPark(f"the sampler is decoding requests {live[:4]}; park it between requests")
        dropped = self._batch.nbytes()
        self._batch = KvBatch(self._model.config, self._device)  # views of the old cache keep its storage alive
        return dropped + self._prefixes.clear() + self._drop_packed()

    def _drop_packed(self) -> int:
        return self._packs.drop_packed() if self._packs is not None else 0

    @property
    def last_sync(self) -> SyncStats | None:
        """Always None: LoRA versions arrive whole, with no sync to account for."""
        return None

    def close(self) -> None:
        """Free the prefix cache; the rest goes with garbage collection (no process or file is held)."""
        self._prefixes.clear()

    def _require_resident(self, operation: str) -> None:
        self._slot.require_resident(operation)

    def statistics(self) -> TorchSamplerStatistics:
        return TorchSamplerStatistics(
            versions_loaded=len(self._versions),
            requests_done=self._requests_done,
            samples_done=self._samples_done,
            tokens_generated=self._tokens_generated,
            prompt_tokens_prefilled=self._prompt_tokens_prefilled,
            requests_queued=len(self._queued),
            requests_running=len(self._requests) - len(self._queued),
            rows_running=len(self._rows),
            decode_steps=self._decode_steps,
            prefix_cache=self._prefixes.statistics(),
            adapters_made=self._versions.made,
            adapters_reused=self._versions.reused,
            adapters_free=self._versions.free,
            packed_weight_bytes=self._packs.packed_bytes if self._packs is not None else 0,
        )


# ---------------------------------------------------------------------------
# Builders and checks


def _alike(request: _Request) -> tuple[float, int, float]:
    """Rows whose requests share this draw in one call."""
    params = request.job.params
    return params.temperature, params.top_k, params.top_p


def _uniform_rows(uniforms: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """(R, width) float64: row r's first counts[r] cells take the next counts[r] of `uniforms`;
    the cells after them are padding, drawn from but never recorded."""
    if all(count == width for count in counts):
        return uniforms.view(len(counts), width)
    rows = torch.full((len(counts), width), 0.5, dtype=torch.float64)
    row_index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    column_index = torch.cat([torch.arange(count) for count in counts])
    rows[row_index, column_index] = uniforms
    return rows


def _eos_ids(tokenizer: transformers.PreTrainedTokenizerBase, model: torch.nn.Module) -> frozenset[int]:
    """The tokenizer's EOS plus any EOS ids of the generation config."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    return frozenset(ids)


def _to_sequence(s: _Sample, k: int) -> SampledSequence:
    topk = None
    if k > 0:
        ids, lps = empty_topk(0, k)
        if s.topk_ids:
            ids, lps = np.stack(s.topk_ids), np.stack(s.topk_logprobs)
        topk = TopK(token_ids=ids, logprobs=lps)
    assert s.stop_reason is not None
    return SampledSequence(
        tokens=np.asarray(s.tokens, dtype=np.int32),
        logprobs=np.asarray(s.logprobs, dtype=np.float32),
        stop_reason=s.stop_reason,
        topk=topk,
    )


def _bad(key: str, expected: str, got: object) -> BadRequest:
    return BadRequest(f"{key}: expected {expected}, got {got!r}", key=key)


def _validate(job: SampleJob, vocab: int, context: int) -> None:
    """Refuse a job the engine cannot honour exactly, naming the field and the value received."""
    params = job.params
    prompt = job.prompt
    if job.num_samples < 1:
        raise _bad("num_samples", "an integer >= 1", job.num_samples)
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise _bad("prompt", "a 1-D array of token ids", f"{prompt.dtype} array of shape {prompt.shape}")
    if len(prompt) == 0:
        raise _bad("prompt", "at least one token", "an empty prompt")
    if len(prompt) >= context:
        raise _bad("prompt", f"fewer than the model's context of {context} tokens", f"{len(prompt)} tokens")
    out_of_range = prompt[(prompt < 0) | (prompt >= vocab)]
    if len(out_of_range):
        raise _bad("prompt", f"token ids in [0, {vocab})", int(out_of_range[0]))
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise _bad("sampling_params.temperature", "a finite number >= 0", params.temperature)
    if params.top_k < -1:
        raise _bad("sampling_params.top_k", "-1 or 0 (no limit) or k >= 1", params.top_k)
    if not (0.0 < params.top_p <= 1.0):
        raise _bad("sampling_params.top_p", "a number in (0, 1]", params.top_p)
    if params.max_tokens is not None and params.max_tokens < 0:
        raise _bad("sampling_params.max_tokens", "None or an integer >= 0", params.max_tokens)
    for token in params.stop_token_ids:
        if not 0 <= token < vocab:
            raise _bad("sampling_params.stop", f"token ids in [0, {vocab})", token)
    for text in params.stop_strings:
        if text == "":
            raise _bad("sampling_params.stop", "non-empty stop strings", text)
    if job.prompt_logprobs_last_n is not None:
        if not job.prompt_logprobs:
            raise _bad("prompt_logprobs_last_n", "it only with prompt_logprobs=true", job.prompt_logprobs_last_n)
        if not 1 <= job.prompt_logprobs_last_n <= len(prompt) - 1:
            expected = f"an integer in [1, {len(prompt) - 1}] (the prompt length - 1)"
            raise _bad("prompt_logprobs_last_n", expected, job.prompt_logprobs_last_n)
    topks = (("topk_prompt_logprobs", job.topk_prompt_logprobs), ("topk_sample_logprobs", job.topk_sample_logprobs))
    for key, k in topks:
        if not 0 <= k <= vocab:
            raise _bad(key, f"an integer in [0, {vocab}] (the vocabulary size)", k)
