"""The torch sampling engine: one base model serving many immutable weight versions.

`TorchSampler` owns one base model, its tokenizer, and a set of LoRA weight
versions loaded on top of it as peft adapters. `sample(version, job)` runs one
`SampleJob` against one version (or the bare base model, version `None`) and
returns a `SampleResult` that follows `shared/spec/sampling.md` sections 1-3:

- The prompt is prefilled once, in chunks so that its logits never take more
  than `prefill_chunk_tokens` rows of memory, and its KV cache is shared by all
  `num_samples` samples, which then decode together as one batch, token by
  token. Finished rows leave the batch (and the cache) at once.
- Each token is drawn from q_T: logits/T, then top-k, then top-p, then
  renormalise. Its reported logprob is log q_T in fp32 from the same logits.
  T = 0 is argmax (ties to the lowest id) and reports 0.0.
- Sample i draws one uniform per step from its own CPU generator seeded from
  (seed mod 2^64, i), so a sample's tokens do not depend on how many samples
  share its batch, nor on which rows finished before it.
- Prompt scoring is always the raw model at T = 1.

Guarantees: versions are immutable once loaded; loading a version never
changes the shared base weights (a tensor for a base weight must equal it);
version `None` is always the base model exactly. Nothing is cached across
calls, so `prompt_cache_hit_tokens` is always 0.

It never imports trio, never knows about sessions, futures or request ids, and
is not thread-safe: the caller runs one call at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import secrets
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import peft
import torch
import transformers

from openrld.batches import LoraSpec, SampledSequence, SampleJob, SampleResult, SamplingSpec, TopK
from openrld.errors import BadRequest
from openrld.gpu import models

logger = logging.getLogger(__name__)

TOPK_EMPTY_TOKEN = 0  # the Tinker SDK's sentinel cell: token 0 with logprob -99999.0
TOPK_EMPTY_LOGPROB = -99999.0
STOP = "stop"
LENGTH = "length"


class TorchSamplerStatistics(msgspec.Struct, frozen=True):
    versions_loaded: int  # LoRA versions held now; the base model is not counted
    requests_done: int
    samples_done: int
    tokens_generated: int
    prompt_tokens_prefilled: int


# ---------------------------------------------------------------------------
# Pure functions of the sampling math


def stream_seed(seed: int, index: int) -> int:
    """The seed of sample `index`'s RNG stream: a 64-bit hash of (seed mod 2^64, index).

    A hash rather than `seed + index`, so that the streams of (seed, 1) and
    (seed + 1, 0) are unrelated.
    """
    key = (seed % 2**64).to_bytes(8, "little") + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def processed_logprobs(logits: torch.Tensor, params: SamplingSpec) -> torch.Tensor:
    """log q_T for each row: logits/T, then top-k, then top-p, then renormalise (T > 0).

    Args:
        logits: (R, V) float32.
        params: temperature > 0, top_k, top_p.

    Returns:
        (R, V) float32: log q_T, -inf for tokens that top-k or top-p removed.
    """
    assert params.temperature > 0, f"processed_logprobs needs T > 0, got {params.temperature}"
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    limits_k = 0 < params.top_k < vocab
    if not limits_k and params.top_p >= 1.0:
        # Skip the sort so that the default settings give exactly log_softmax(logits/T).
        return torch.log_softmax(scaled, dim=-1)
    # A stable descending sort puts equal logits in id order, so ties keep the lowest ids.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # (R, V)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if limits_k:
        keep[:, params.top_k :] = False
    if params.top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
        # Keep token j iff the mass strictly before it is < top_p: the smallest set reaching
        # top_p, and always the first token (top_p > 0).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < params.top_p
    sorted_logq = torch.log_softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logq)


def draw_from(logq: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: for each row r, the tokens whose CDF interval holds uniforms[r].

    One uniform per draw (rather than torch.multinomial) keeps each sample's
    randomness in its own CPU generator while the arithmetic stays on the device.

    Args:
        logq: (R, V) float32 log-probabilities, -inf outside the support.
        uniforms: (R, M) float64 in [0, 1).

    Returns:
        (R, M) int64 token ids, each with q > 0.
    """
    probs = logq.double().exp()  # (R, V)
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms.to(cdf.device) * cdf[:, -1:]
    # right=True gives the first token whose CDF exceeds the target; that token has q > 0.
    tokens = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[-1] - 1)
    off_support = probs.gather(-1, tokens) == 0
    if bool(off_support.any()):
        # Only when rounding made target == total: take the last token of the support.
        last = probs.shape[-1] - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1, keepdim=True)
        tokens = torch.where(off_support, last.expand_as(tokens), tokens)
    return tokens


def top_k_rows(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best entries of each row, by logprob descending, ties by id ascending.

    Entries at -inf (outside q's support) become the sentinel (token 0, -99999.0).

    Returns:
        (token_ids int32 (R, k), logprobs float32 (R, k)).
    """
    assert 0 < k <= logp.shape[-1], f"k={k} must be in [1, {logp.shape[-1]}]"
    values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    values, ids = values[:, :k].float().cpu().numpy(), ids[:, :k].to(torch.int32).cpu().numpy()
    empty = np.isneginf(values)
    ids[empty] = TOPK_EMPTY_TOKEN
    values[empty] = TOPK_EMPTY_LOGPROB
    return ids, values


def _empty_topk(rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((rows, k), TOPK_EMPTY_TOKEN, np.int32), np.full((rows, k), TOPK_EMPTY_LOGPROB, np.float32)


# ---------------------------------------------------------------------------
# Per-sample state


class StopStringWatch:
    """Watches one sample's generated text for stop strings, one token at a time.

    The text is decoded incrementally: each step decodes only the tokens since
    the last complete character, and a tail of `longest - 1` characters is kept
    so that a match spanning earlier tokens is still seen. Text that ends in an
    incomplete character (U+FFFD) is checked as decoded but not committed until
    the character completes, which is what decoding all generated tokens gives.
    """

    def __init__(self, stop_strings: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self._stop_strings = stop_strings
        self._decode = decode
        self._keep_chars = max(len(s) for s in stop_strings) - 1
        self._tokens: list[int] = []
        self._prefix_offset = 0  # tokens before this are fully reflected in _tail
        self._read_offset = 0  # tokens in [prefix, read) were committed last
        self._tail = ""

    def push(self, token: int) -> bool:
        """Add a generated token; True when the generated text now contains a stop string."""
        self._tokens.append(token)
        committed = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        current = self._decode(self._tokens[self._prefix_offset :])
        pending = current[len(committed) :]
        window = self._tail + pending
        if any(s in window for s in self._stop_strings):
            return True
        if pending and not pending.endswith("\ufffd"):
            self._tail = window[-self._keep_chars :] if self._keep_chars else ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return False


@dataclasses.dataclass(slots=True)
class _Sample:
    generator: torch.Generator | None  # None at T = 0, which draws nothing
    watch: StopStringWatch | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    topk_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    topk_logprobs: list[np.ndarray] = dataclasses.field(default_factory=list)
    stop_reason: str | None = None  # set once the sample is finished


# ---------------------------------------------------------------------------
# The engine


class TorchSampler:
    """Samples from one base model and the LoRA versions loaded on it.

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        device, dtype: where and in what the model computes (dtype: `models.pick_dtype`).
        decode_batch_rows: at most this many samples decode together; a larger
            request decodes in groups, each from a copy of the one prefilled cache.
        prefill_chunk_tokens: the prompt is prefilled this many tokens at a time,
            which bounds the prompt-logits memory to (chunk, vocab).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        decode_batch_rows: int = 256,
        prefill_chunk_tokens: int = 1024,
    ) -> None:
        assert decode_batch_rows >= 1 and prefill_chunk_tokens >= 1
        self._device = device
        self._model = models.load_causal_lm(model_dir, device, dtype)
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        self._vocab = models.vocab_size(self._model)
        self._context = models.max_context(self._model)
        self._eos_ids = _eos_ids(self._tokenizer, self._model)
        self._decode_batch_rows = decode_batch_rows
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._peft: peft.PeftModel | None = None  # wraps self._model once the first version loads
        self._adapters: dict[str, str] = {}  # version -> peft adapter name (versions may hold ':' and '/')
        self._adapter_counter = 0
        self._requests_done = 0
        self._samples_done = 0
        self._tokens_generated = 0
        self._prompt_tokens_prefilled = 0

    # -- versions ---------------------------------------------------------

    def has_version(self, version: str | None) -> bool:
        return version is None or version in self._adapters

    def load_version(self, version: str, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        """Load an immutable LoRA version from the trainer's `get_peft_model_state_dict` tensors.

        Raises:
            ValueError: `version` is already loaded, a LoRA tensor is missing,
                unexpected or misshapen, or a base-weight tensor differs from
                this sampler's base weights.
        """
        if version in self._adapters:
            raise ValueError(f"weight version {version!r} is already loaded; versions are immutable")
        adapter = f"v{self._adapter_counter}"
        self._adapter_counter += 1
        # peft initialises lora_A randomly; fork so that loading never moves the global RNG.
        with torch.random.fork_rng(devices=[]):
            if self._peft is None:
                self._peft = peft.get_peft_model(self._model, models.lora_config(spec), adapter_name=adapter)
            else:
                self._peft.add_adapter(adapter, models.lora_config(spec))
        try:
            lora_tensors = self._check_base_tensors(version, tensors)
            result = peft.set_peft_model_state_dict(self._peft, lora_tensors, adapter_name=adapter)
        except (RuntimeError, ValueError) as e:
            self._peft.delete_adapter(adapter)
            raise ValueError(f"weight version {version!r}: {e}") from e
        missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter}." in k]
        if missing or result.unexpected_keys:
            self._peft.delete_adapter(adapter)
            raise ValueError(
                f"weight version {version!r}: tensors do not match LoraSpec {spec}: "
                f"missing {missing[:4]}, unexpected {list(result.unexpected_keys)[:4]}"
            )
        self._adapters[version] = adapter
        logger.info("loaded weight version=%s adapter=%s rank=%d", version, adapter, spec.rank)

    def drop_version(self, version: str) -> None:
        """Free a version. Raises KeyError if it is not loaded."""
        adapter = self._adapters.pop(version)
        assert self._peft is not None
        self._peft.delete_adapter(adapter)
        logger.info("dropped weight version=%s adapter=%s", version, adapter)

    def _check_base_tensors(self, version: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Split off base-weight tensors (peft saves lm_head's base weight when it is a target).

        They are not loaded, since the base is shared by every version; they
        must equal it, or the version would not be what the trainer trained.
        """
        assert self._peft is not None
        params = dict(self._peft.named_parameters())
        lora = {}
        for key, tensor in tensors.items():
            if "lora_" in key:
                lora[key] = tensor
                continue
            base = params.get(key)
            if base is None:
                raise ValueError(f"tensor {key!r} names no parameter of the model")
            if not torch.equal(tensor.to(base.device, base.dtype), base):
                raise ValueError(f"tensor {key!r} differs from the shared base weight")
        return lora

    def _activate(self, version: str | None) -> None:
        if self._peft is None:
            return  # no LoRA layers exist: the model is the base model
        tuner = self._peft.base_model
        if version is None:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            tuner.set_adapter(self._adapters[version], inference_mode=True)

    # -- sampling ---------------------------------------------------------

    def sample(self, version: str | None, job: SampleJob) -> SampleResult:
        """Run one sampling request on `version` (None: the base model).

        Raises:
            BadRequest: the job is invalid (the message names the field and the value).
            KeyError: `version` is not loaded.
        """
        _validate(job, self._vocab, self._context)
        if version is not None and version not in self._adapters:
            raise KeyError(f"weight version {version!r} is not loaded")
        params = job.params
        prompt_len = len(job.prompt)
        # Generated tokens sit at positions P .. context-1.
        limit = self._context - prompt_len
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        scores_prompt = job.prompt_logprobs or job.topk_prompt_logprobs > 0
        samples = self._new_samples(job)
        prompt_logprobs: np.ndarray | None = None
        topk_prompt: TopK | None = None
        self._activate(version)
        with torch.inference_mode():
            if limit > 0 or scores_prompt:
                cache, last_logits, prompt_logprobs, topk_prompt = self._prefill(job)
                if limit > 0:
                    self._first_step(last_logits, samples, job, limit)
                    active = [s for s in samples if s.stop_reason is None]
                    for start in range(0, len(active), self._decode_batch_rows):
                        group = active[start : start + self._decode_batch_rows]
                        is_last = start + self._decode_batch_rows >= len(active)
                        # The last group may consume the prefilled cache; earlier ones take a copy.
                        group_cache = cache if is_last else copy.deepcopy(cache)
                        self._decode(group, group_cache, job, limit)
        for s in samples:
            if s.stop_reason is None:
                s.stop_reason = LENGTH  # only when limit == 0: nothing was generated
        self._requests_done += 1
        self._samples_done += len(samples)
        self._tokens_generated += sum(len(s.tokens) for s in samples)
        return SampleResult(
            sequences=[_to_sequence(s, job.topk_sample_logprobs) for s in samples],
            prompt_logprobs=prompt_logprobs if job.prompt_logprobs else None,
            topk_prompt=topk_prompt,
            prompt_cache_hit_tokens=0,  # no cache survives a call
        )

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

    def _prefill(self, job: SampleJob) -> tuple[transformers.DynamicCache, torch.Tensor, np.ndarray, TopK | None]:
        """Run the prompt through the model once, chunk by chunk, scoring what the job asks.

        Returns:
            the cache (batch 1), the fp32 logits (V,) after the last prompt token,
            raw prompt logprobs float32 (P,) with NaN where not scored, and the
            top-k prompt rows (or None).
        """
        prompt = torch.as_tensor(job.prompt, dtype=torch.int64, device=self._device)
        prompt_len = prompt.shape[0]
        scores_prompt = job.prompt_logprobs or job.topk_prompt_logprobs > 0
        first_scored = prompt_len - (job.prompt_logprobs_last_n or prompt_len - 1)  # position 0 never
        # Logits at position q predict q + 1: scoring needs rows first_scored-1 .. P-2, sampling P-1.
        first_needed = first_scored - 1 if scores_prompt else prompt_len - 1
        prompt_logprobs = np.full(prompt_len, np.nan, np.float32)
        k = job.topk_prompt_logprobs
        topk_ids, topk_lps = _empty_topk(prompt_len, k)
        cache = transformers.DynamicCache(config=self._model.config)
        last_logits = torch.empty(0)
        for start in range(0, prompt_len, self._prefill_chunk_tokens):
            end = min(start + self._prefill_chunk_tokens, prompt_len)
            lo = max(start, first_needed)
            # logits_to_keep=0 would mean "all", so a chunk that needs none still keeps one row.
            keep = end - lo if lo < end else 1
            out = self._model(input_ids=prompt[None, start:end], cache=cache, use_cache=True, logits_to_keep=keep)
            logits = out.logits[0].float()  # (keep, V): positions end-keep .. end-1
            self._prompt_tokens_prefilled += end - start
            if end == prompt_len:
                last_logits = logits[-1]
            scored_end = min(end, prompt_len - 1)  # position P-1 predicts no prompt token
            if scores_prompt and lo < scored_end:
                logp = torch.log_softmax(logits[: scored_end - lo], dim=-1)  # (n, V), rows lo .. scored_end-1
                targets = prompt[lo + 1 : scored_end + 1]
                picked = logp.gather(-1, targets[:, None])[:, 0]
                prompt_logprobs[lo + 1 : scored_end + 1] = picked.cpu().numpy()
                if k > 0:
                    topk_ids[lo + 1 : scored_end + 1], topk_lps[lo + 1 : scored_end + 1] = top_k_rows(logp, k)
        topk_prompt = TopK(token_ids=topk_ids, logprobs=topk_lps) if k > 0 else None
        return cache, last_logits, prompt_logprobs, topk_prompt

    def _first_step(self, last_logits: torch.Tensor, samples: list[_Sample], job: SampleJob, limit: int) -> None:
        """Draw every sample's first token from the one prefilled distribution."""
        n = len(samples)
        logits = last_logits[None, :]  # (1, V), shared by all samples
        if job.params.temperature == 0:
            tokens, logprobs, logq = torch.argmax(logits, dim=-1).expand(n), torch.zeros(n), None
        else:
            logq = processed_logprobs(logits, job.params)
            uniforms = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in samples])
            tokens = draw_from(logq, uniforms[None, :])[0]  # (n,)
            logprobs = logq[0, tokens]
        topk = self._topk_sample_rows(logq, tokens[:1], job.topk_sample_logprobs)
        for s, token, logprob in zip(samples, tokens.tolist(), logprobs.tolist()):
            self._record(s, token, logprob, topk, 0, job.params, limit)

    def _decode(self, group: list[_Sample], cache: transformers.DynamicCache, job: SampleJob, limit: int) -> None:
        """Decode `group` as one batch until every sample in it has finished."""
        if not group:
            return
        cache.batch_repeat_interleave(len(group))
        params = job.params
        active = group
        inputs = torch.tensor([s.tokens[-1] for s in active], dtype=torch.int64, device=self._device)
        while active:
            out = self._model(input_ids=inputs[:, None], cache=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()  # (B, V)
            if params.temperature == 0:
                tokens, logprobs, logq = torch.argmax(logits, dim=-1), torch.zeros(len(active)), None
            else:
                logq = processed_logprobs(logits, params)
                uniforms = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in active])
                tokens = draw_from(logq, uniforms[:, None])[:, 0]  # (B,)
                logprobs = logq.gather(-1, tokens[:, None])[:, 0]
            topk = self._topk_sample_rows(logq, tokens, job.topk_sample_logprobs)
            for row, (s, token, logprob) in enumerate(zip(active, tokens.tolist(), logprobs.tolist())):
                self._record(s, token, logprob, topk, row, params, limit)
            still = [row for row, s in enumerate(active) if s.stop_reason is None]
            if len(still) < len(active) and still:
                # Finished rows leave the batch: their cache rows are dropped, not masked.
                index = torch.tensor(still, dtype=torch.int64, device=self._device)
                cache.batch_select_indices(index)
                tokens = tokens[index]
            active = [active[row] for row in still]
            inputs = tokens

    def _topk_sample_rows(
        self, logq: torch.Tensor | None, tokens: torch.Tensor, k: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Top-k rows of q_T for this step; at T = 0 (logq None) q is a point mass on the argmax."""
        if k == 0:
            return None
        if logq is not None:
            return top_k_rows(logq, k)
        ids, lps = _empty_topk(tokens.shape[0], k)
        ids[:, 0] = tokens.cpu().numpy()
        lps[:, 0] = 0.0
        return ids, lps

    def _record(
        self,
        s: _Sample,
        token: int,
        logprob: float,
        topk: tuple[np.ndarray, np.ndarray] | None,
        row: int,
        params: SamplingSpec,
        limit: int,
    ) -> None:
        """Append one token to a sample and decide whether it has finished, and why."""
        s.tokens.append(token)
        s.logprobs.append(logprob)
        if topk is not None:
            s.topk_ids.append(topk[0][row])
            s.topk_logprobs.append(topk[1][row])
        stops_on_id = token in params.stop_token_ids or (params.stop_at_eos and token in self._eos_ids)
        # The watch must see every token, so it is fed even when the id already stops.
        stops_on_text = s.watch is not None and s.watch.push(token)
        if stops_on_id or stops_on_text:
            s.stop_reason = STOP  # also when this was the last allowed token
        elif len(s.tokens) >= limit:
            s.stop_reason = LENGTH

    def statistics(self) -> TorchSamplerStatistics:
        return TorchSamplerStatistics(
            versions_loaded=len(self._adapters),
            requests_done=self._requests_done,
            samples_done=self._samples_done,
            tokens_generated=self._tokens_generated,
            prompt_tokens_prefilled=self._prompt_tokens_prefilled,
        )


# ---------------------------------------------------------------------------
# Builders and checks


def _eos_ids(tokenizer: transformers.PreTrainedTokenizerBase, model: torch.nn.Module) -> frozenset[int]:
    """The tokenizer's EOS plus any EOS ids of the generation config (sampling.md 1.3)."""
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
        ids, lps = _empty_topk(0, k)
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
