"""What crosses between openrld's sampling types and vLLM's: parameters, adapter names, outputs.

Pure functions and small state, no vLLM import, so all of it is tested without a GPU:
- `child_params`: one sample of a `SampleJob` as the keyword arguments of
  `vllm.SamplingParams` (every field of the SDK's `SamplingParams`);
- `AdapterNames`: the unique, never reused vLLM adapter name and int id of each loaded
  weight version, so vLLM's adapter cache can never serve an older version's weights;
- `to_sample_result`: vLLM's finished outputs (duck-typed `RequestOutput`s) as our
  `SampleResult`, with the logprob, top-k, stop-reason and prompt-scoring rules of
  Tinker's sampling semantics.
The engine that uses them is `vllm_sampler.VllmSampler`. Never imports trio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec
import numpy as np
import torch

from openrld import model_families
from openrld.batches import SampledSequence, SampleJob, SampleResult, SamplingSpec, TopK
from openrld.errors import BadRequest
from openrld.gpu.sampling_math import TOPK_EMPTY_LOGPROB, TOPK_EMPTY_TOKEN, empty_topk, stream_seed

ADAPTER_PREFIX = "openrld-v"
STOP = "stop"
LENGTH = "length"
# The max_lora_rank values vLLM's LoRAConfig accepts (`possible_max_ranks` in its __post_init__;
# some versions also take 1, which 8 covers).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# vLLM seeds a torch.Generator per seeded request; 63 bits keep the seed a positive int64 on every path.
SEED_MASK = (1 << 63) - 1
# vLLM's temperature rules (SamplingParams.__post_init__ / _verify_args, 0.30 to 0.33): above 2 it
# raises VLLMValidationError; a positive temperature below 0.01 (its _MAX_TEMP) it raises to 0.01
# with only a log line, and would report log q at 0.01. Both are refused here by name
# (an option the server cannot honour is a 400, never silently changed).
VLLM_MAX_TEMPERATURE = 2.0
VLLM_MIN_TEMPERATURE = 0.01
# Architectures whose vLLM model class takes no LoRA on the output layer (lm_head is not among
# its LoRA modules: `embedding_modules` is empty), so vLLM refuses an adapter that trains it
# ("expected target modules in [...]"). Loading the adapter without its lm_head part would
# sample from other weights than the trainer's, so such an adapter is refused instead.
# Per family in `model_families.FAMILIES` (`VllmLora.takes_lm_head`).
VLLM_NO_UNEMBED_LORA = frozenset(
    arch
    for family in model_families.FAMILIES
    if family.vllm is not None and not family.vllm.takes_lm_head
    for arch in family.architectures
)


# ---------------------------------------------------------------------------
# The vLLM shapes this module reads (duck-typed: vllm.outputs.RequestOutput and friends)


class LogprobLike(Protocol):
    logprob: float


class CompletionLike(Protocol):
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, LogprobLike]] | None
    finish_reason: str | None


class RequestOutputLike(Protocol):
    outputs: Sequence[CompletionLike]
    prompt_logprobs: Sequence[Mapping[int, LogprobLike] | None] | None
    num_cached_tokens: int | None
    finished: bool


# ---------------------------------------------------------------------------
# Parameter translation (pure)


class ChildParams(msgspec.Struct, frozen=True):
    """The keyword arguments of `vllm.SamplingParams` for one sample of a request."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    include_stop_str_in_output: bool  # the text keeps the stop string (nothing is trimmed)
    logprobs: int  # top-k of each sampled position; 0 still returns the sampled token's logprob
    prompt_logprobs: int | None  # None: no prompt scoring; k: the prompt token plus the top k
    skip_special_tokens: bool  # False: stop strings match the text the torch engine decodes
    spaces_between_special_tokens: bool
    detokenize: bool  # stop strings need the text


def generation_limit(job: SampleJob, context: int) -> int:
    """Generated tokens allowed per sample: max_tokens and what is left of the context window."""
    limit = context - len(job.prompt)
    if job.params.max_tokens is not None:
        limit = min(limit, job.params.max_tokens)
    return limit


def scores_prompt(job: SampleJob) -> bool:
    return job.prompt_logprobs or job.topk_prompt_logprobs > 0


def child_params(job: SampleJob, index: int, limit: int, vocab: int) -> ChildParams:
    """vLLM's SamplingParams for sample `index` of `job`.

    Args:
        limit: `generation_limit`; 0 asks for one token that is then discarded,
            which is how a request with max_tokens = 0 still scores its prompt.
        vocab: the vocabulary size, above which top_k means "no limit".
    """
    params = job.params
    seed = None if params.seed is None else stream_seed(params.seed, index) & SEED_MASK
    top_k = params.top_k if 0 < params.top_k < vocab else -1  # vLLM: -1 is "all tokens"
    return ChildParams(
        n=1,
        max_tokens=max(limit, 1),
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=top_k,
        seed=seed,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=not params.stop_at_eos,
        include_stop_str_in_output=True,
        logprobs=job.topk_sample_logprobs,
        prompt_logprobs=job.topk_prompt_logprobs if index == 0 and scores_prompt(job) else None,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        detokenize=True,
    )


def check_vllm_limits(job: SampleJob) -> None:
    """Refuse what vLLM would refuse or silently change, naming the field (a 400, not a crash).

    Raises:
        BadRequest: temperature above 2, or positive and below 0.01.
    """
    temperature = job.params.temperature
    if temperature > VLLM_MAX_TEMPERATURE:
        raise BadRequest(
            f"sampling_params.temperature: expected at most {VLLM_MAX_TEMPERATURE} on this node's vLLM sampler "
            f"(vLLM's limit), got {temperature!r}",
            key="sampling_params.temperature",
        )
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise BadRequest(
            f"sampling_params.temperature: expected 0 (greedy) or at least {VLLM_MIN_TEMPERATURE} on this node's "
            f"vLLM sampler, got {temperature!r} (vLLM would sample at {VLLM_MIN_TEMPERATURE} and report those logprobs)",
            key="sampling_params.temperature",
        )


def vllm_lora_module(arch: str, key: str) -> str | None:
    """The vLLM module a peft adapter tensor `key` loads into for a model of `arch`: the fused
    one where vLLM packs it (q_proj -> qkv_proj), else its own name; None where vLLM's class
    takes no LoRA there, or `arch` has no known vLLM layout.

    `key` is a peft state-dict key (`....self_attn.q_proj.lora_A.weight`); a MoE layer's
    `experts.base_layer` (gate_up_proj's wrapper) loads into the same `experts` as down_proj's.
    """
    family = model_families.family_of(arch)
    if family is None or family.vllm is None:
        return None
    module = key.split(".lora_A.")[0].split(".lora_B.")[0]
    if module.endswith(".experts.base_layer"):
        module = module.removesuffix(".base_layer")
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return leaf if family.vllm.takes_lm_head else None
    for fused, parts in family.vllm.packed.items():
        if leaf in parts:
            return fused
    return leaf if leaf in family.vllm.plain else None


def unembed_lora_refusal(architectures: Sequence[str]) -> str | None:
    """Why vLLM cannot serve a LoRA adapter on lm_head for a model of `architectures`
    (its config.json list), or None when it can."""
    refused = sorted(set(architectures) & VLLM_NO_UNEMBED_LORA)
    if not refused:
        return None
    return (
        f"lora_config.train_unembed: this node samples LoRA adapters with vLLM, which cannot load a LoRA on lm_head "
        f"for {refused[0]}; create the LoRA model with train_unembed=False (lora_config), or use a node whose "
        f"sampler_backend is \"torch\""
    )


GIB = 1 << 30
# What a starting vLLM engine takes before it checks free memory: the CUDA context of its
# engine-core process (about half a GiB) and allocator slack. Left out of what it may claim.
START_MARGIN_BYTES = GIB
# The smallest KV cache worth starting an engine for.
MIN_KV_CACHE_BYTES = 256 << 20
# Weights plus what vLLM's profiling run needs besides them (activations of one max-size batch).
WEIGHTS_OVERHEAD = 1.25


def memory_share(*, free_bytes: int, total_bytes: int, wanted: float, weights_bytes: int) -> float:
    """The `gpu_memory_utilization` to start a vLLM engine with on a device already in use.

    vLLM's `gpu_memory_utilization` is a fraction of the device's *total* memory that must be
    free when the engine starts (it refuses otherwise) and that it then takes for weights and
    KV cache. So a second sampler replica, or one started after a trainer took more than
    `1 - wanted` of the device, cannot start with the configured fraction. The share is the
    configured one, lowered to what is free now (less START_MARGIN_BYTES), rounded down to
    1/1000: each replica sizes itself from what the engines before it left.

    Raises:
        ValueError: what is free cannot hold the weights and a minimal KV cache (the
            message gives the figures).
    """
    available = max(0, free_bytes - START_MARGIN_BYTES)
    share_bytes = min(int(wanted * total_bytes), available)
    needed = int(weights_bytes * WEIGHTS_OVERHEAD) + MIN_KV_CACHE_BYTES
    if share_bytes < needed:
        raise ValueError(
            f"the vLLM sampler needs {needed / GIB:.2f} GiB of device memory (weights {weights_bytes / GIB:.2f} GiB "
            f"and a minimal KV cache) but {free_bytes / GIB:.2f} of {total_bytes / GIB:.2f} GiB is free "
            f"(other engines on the device hold the rest; vllm_gpu_memory_utilization = {wanted}); run fewer "
            "sampler replicas or engines on this device"
        )
    return math.floor(share_bytes * 1000 / total_bytes) / 1000


def check_logprob_caps(job: SampleJob, max_logprobs: int) -> None:
    """Refuse top-k sizes over vLLM's `max_logprobs`, naming the field and the cap."""
    for key, k in (("topk_sample_logprobs", job.topk_sample_logprobs), ("topk_prompt_logprobs", job.topk_prompt_logprobs)):
        if k > max_logprobs:
            raise BadRequest(f"{key}: expected at most {max_logprobs} (this sampler's cap), got {k}", key=key)


# ---------------------------------------------------------------------------
# Adapter names (pure)


class AdapterSlot(msgspec.Struct, frozen=True):
    name: str  # vLLM's lora_name
    int_id: int  # vLLM's lora_int_id, > 0, the key of its adapter cache


class AdapterNames:
    """Which vLLM adapter name and id each loaded version has; an id is never given out twice."""

    def __init__(self) -> None:
        self._next_id = 1  # vLLM reserves 0 for "no adapter"
        self._slots: dict[str, AdapterSlot] = {}

    def assign(self, version: str) -> AdapterSlot:
        """A fresh slot for `version`. Raises ValueError if it holds one already."""
        if version in self._slots:
            raise ValueError(f"weight version {version!r} is already loaded; versions are immutable")
        slot = AdapterSlot(name=f"{ADAPTER_PREFIX}{self._next_id}", int_id=self._next_id)
        self._next_id += 1
        self._slots[version] = slot
        return slot

    def get(self, version: str) -> AdapterSlot:
        """Raises KeyError when `version` is not loaded."""
        slot = self._slots.get(version)
        if slot is None:
            raise KeyError(f"weight version {version!r} is not loaded")
        return slot

    def release(self, version: str) -> AdapterSlot:
        """Forget `version`; its name and id stay retired. Raises KeyError when not loaded."""
        slot = self.get(version)
        del self._slots[version]
        return slot

    def __contains__(self, version: object) -> bool:
        return version in self._slots

    def __len__(self) -> int:
        return len(self._slots)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that fits `rank`.

    Raises:
        ValueError: `rank` is above vLLM's largest.
    """
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"max_lora_rank {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")


def lora_tensors_only(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA A/B tensors of a trainer's adapter state dict.

    peft also keys a targeted lm_head's base weight, which vLLM refuses as an
    "unsupported LoRA weight"; it equals the shared base, so it is left out.
    """
    return {key: tensor for key, tensor in tensors.items() if ".lora_A." in key or ".lora_B." in key}


# ---------------------------------------------------------------------------
# Result mapping (pure)


def _topk_row(entries: Mapping[int, LogprobLike], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best finite entries, by logprob descending, ties by id ascending; sentinels after."""
    ids, lps = np.full(k, TOPK_EMPTY_TOKEN, np.int32), np.full(k, TOPK_EMPTY_LOGPROB, np.float32)
    ranked = sorted(
        ((float(entry.logprob), int(token)) for token, entry in entries.items() if math.isfinite(entry.logprob)),
        key=lambda pair: (-pair[0], pair[1]),
    )[:k]
    for column, (logprob, token) in enumerate(ranked):
        ids[column], lps[column] = token, logprob
    return ids, lps


def stop_reason_of(tokens: Sequence[int], finish_reason: str | None, params: SamplingSpec, eos_ids: frozenset[int]) -> str:
    """"stop" when EOS, a stop id or a stop string ended the sample (also on its last allowed
    token, where vLLM may say "length"), else "length"."""
    if tokens:
        last = tokens[-1]
        if last in params.stop_token_ids or (params.stop_at_eos and last in eos_ids):
            return STOP
    if finish_reason == STOP:
        return STOP  # a stop string (vLLM checks those on the detokenized text)
    if finish_reason == LENGTH:
        return LENGTH
    raise ValueError(f"vLLM finished a sample with finish_reason={finish_reason!r}; expected 'stop' or 'length'")


def to_sequence(
    completion: CompletionLike, job: SampleJob, eos_ids: frozenset[int], *, discard: bool = False
) -> SampledSequence:
    """One sample's tokens, log q_T per token, stop reason and top-k rows.

    Args:
        discard: the sample was generated only to score the prompt (max_tokens = 0):
            return it empty, stopped by length.
    """
    params, k = job.params, job.topk_sample_logprobs
    tokens = [] if discard else [int(t) for t in completion.token_ids]
    greedy = params.temperature == 0
    logprobs = np.zeros(len(tokens), np.float32)
    ids, lps = empty_topk(len(tokens), k)
    if tokens and completion.logprobs is None:
        raise ValueError("vLLM returned no logprobs; every sample must ask for them")
    for i, token in enumerate(tokens):
        entries = completion.logprobs[i]  # type: ignore[index]
        if greedy:
            # T = 0 reports 0.0, and its q is a point mass on the token.
            if k:
                ids[i, 0], lps[i, 0] = token, 0.0
            continue
        if token not in entries:
            raise ValueError(f"vLLM's logprobs at position {i} lack the sampled token {token}")
        logprobs[i] = entries[token].logprob
        if k:
            ids[i], lps[i] = _topk_row(entries, k)
    reason = LENGTH if discard else stop_reason_of(tokens, completion.finish_reason, params, eos_ids)
    return SampledSequence(
        tokens=np.asarray(tokens, np.int32), logprobs=logprobs, stop_reason=reason,
        topk=TopK(token_ids=ids, logprobs=lps) if k else None,
    )


def prompt_scores(output: RequestOutputLike, job: SampleJob) -> tuple[np.ndarray, TopK | None]:
    """The raw prompt logprobs (NaN where unscored) and top-k prompt rows of sample 0's output."""
    prompt_len = len(job.prompt)
    first_scored = prompt_len - (job.prompt_logprobs_last_n or prompt_len - 1)  # position 0 never
    logprobs = np.full(prompt_len, np.nan, np.float32)
    k = job.topk_prompt_logprobs
    ids, lps = empty_topk(prompt_len, k)
    rows = output.prompt_logprobs
    if rows is None or len(rows) != prompt_len:
        raise ValueError(f"vLLM returned {None if rows is None else len(rows)} prompt logprob rows for {prompt_len} tokens")
    for position in range(first_scored, prompt_len):
        entries = rows[position]
        token = int(job.prompt[position])
        if entries is None or token not in entries:
            raise ValueError(f"vLLM's prompt logprobs at position {position} lack the prompt token {token}")
        logprobs[position] = entries[token].logprob
        if k:
            ids[position], lps[position] = _topk_row(entries, k)
    return logprobs, TopK(token_ids=ids, logprobs=lps) if k else None


def to_sample_result(
    job: SampleJob, outputs: Sequence[RequestOutputLike], limit: int, eos_ids: frozenset[int]
) -> SampleResult:
    """The SampleResult of a request from its samples' finished vLLM outputs, in sample order.

    `outputs` holds one output per sample, or (when `limit` is 0) the one
    scoring-only output, whose generated token is discarded.
    """
    if limit == 0:
        sequences = [to_sequence(outputs[0].outputs[0], job, eos_ids, discard=True) if outputs else _empty(job)] * job.num_samples
    else:
        assert len(outputs) == job.num_samples, f"{len(outputs)} outputs for {job.num_samples} samples"
        sequences = [to_sequence(output.outputs[0], job, eos_ids) for output in outputs]
    prompt_logprobs, topk_prompt = None, None
    if scores_prompt(job):
        prompt_logprobs, topk_prompt = prompt_scores(outputs[0], job)
    cached = max((output.num_cached_tokens or 0 for output in outputs), default=0)
    return SampleResult(
        sequences=sequences,
        prompt_logprobs=prompt_logprobs if job.prompt_logprobs else None,
        topk_prompt=topk_prompt,
        prompt_cache_hit_tokens=min(max(cached, 0), len(job.prompt)),
    )


def _empty(job: SampleJob) -> SampledSequence:
    k = job.topk_sample_logprobs
    return SampledSequence(
        tokens=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32), stop_reason=LENGTH,
        topk=TopK(*empty_topk(0, k)) if k else None,
    )
