"""Token usage per session, counted where the work is submitted and delivered.

`UsageMeter` owns the in-memory hourly buckets of tokens each session used:
training tokens (every forward/forward_backward datum's model input),
sampling prefill tokens (each sample request's prompt, once per request) and
sampled tokens (the tokens of every sequence delivered). `flush` moves them
into the store, which the maintenance task does every few seconds and the
admin routes do before they read, so a read sees every count so far.

It never blocks and never does I/O except in `flush`; a crash loses at most
the counts since the last flush.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from openrld.store import Store, UsageRow

TRAINING = "training"
SAMPLING_PREFILL = "sampling_prefill"
SAMPLING_SAMPLE = "sampling_sample"

PENDING_SAMPLES_MAX = 100_000  # sample requests whose delivery is still to be counted; oldest dropped past it


class _Source(msgspec.Struct, frozen=True):
    session_id: str
    owner: str
    base_model: str


class UsageStatistics(msgspec.Struct, frozen=True):
    buckets_unflushed: int
    samples_pending: int


def session_of(model_or_sampler_id: str) -> str:
    """The session a model id ("<s>:train:<n>") or sampler id ("<s>:sample:<n>") belongs to."""
    return model_or_sampler_id.split(":", 1)[0]


class UsageMeter:
    def __init__(self, *, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._buckets: dict[tuple[int, str, str, str, str], int] = {}  # (hour, session, owner, model, kind) -> tokens
        self._pending_samples: dict[str, _Source] = {}  # request_id -> who sampled

    def _add(self, source: _Source, kind: str, tokens: int) -> None:
        if tokens <= 0:
            return
        hour = int(self._now()) // 3600 * 3600
        key = (hour, source.session_id, source.owner, source.base_model, kind)
        self._buckets[key] = self._buckets.get(key, 0) + tokens

    def training(self, *, model_id: str, owner: str, base_model: str, tokens: int) -> None:
        self._add(_Source(session_of(model_id), owner, base_model), TRAINING, tokens)

    def sample_submitted(self, *, request_id: str, sampler_id: str, owner: str, base_model: str, prompt_tokens: int) -> None:
        source = _Source(session_of(sampler_id), owner, base_model)
        self._add(source, SAMPLING_PREFILL, prompt_tokens)
        self._pending_samples[request_id] = source
        if len(self._pending_samples) > PENDING_SAMPLES_MAX:
            del self._pending_samples[next(iter(self._pending_samples))]

    def sample_delivered(self, request_id: str, sampled_tokens: int) -> None:
        """Count a sample's tokens the first time its result is delivered (a re-read counts nothing)."""
        source = self._pending_samples.pop(request_id, None)
        if source is not None:
            self._add(source, SAMPLING_SAMPLE, sampled_tokens)

    def flush(self, store: Store) -> int:
        """Add the counts so far into the store; returns how many buckets were written."""
        if not self._buckets:
            return 0
        buckets, self._buckets = self._buckets, {}
        store.usage_ledger.add(
            [
                UsageRow(
                    bucket_start=datetime.fromtimestamp(hour, UTC), session_id=session_id, owner=owner,
                    base_model=base_model, kind=kind, tokens=tokens,
                )
                for (hour, session_id, owner, base_model, kind), tokens in buckets.items()
            ]
        )
        return len(buckets)

    def statistics(self) -> UsageStatistics:
        return UsageStatistics(buckets_unflushed=len(self._buckets), samples_pending=len(self._pending_samples))
