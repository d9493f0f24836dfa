"""Stability records: what the sampler saw, kept for `stable_reinforce`.

It owns one node's records, keyed by the sequence ids the server returned in
`sample_sequence_ids`, and the resolution of a training request's provenance
spans against them. It is pure state: sync, no trio, no torch, no I/O. Time is
passed in (`now`, seconds on one monotonic clock), so tests drive it.

What one record holds (per sequence): the ServiceClient session that sampled
it, its sampling session, the base model, the weights version that served it
(one per sequence: a request binds to one version at admission, so every token
of the sequence came from it), T / top_k / top_p, the request's prompt ids, the
sampled ids, and per sampled token the logprob the sampler returned (log q_T,
at T = 1 with no truncation that is the raw model logprob).
The raw T = 1 logprob at T != 1 is not recorded: the loss uses the behaviour
policy's logprob, which is log q_T.

Lifetime: a record lives `RECORD_TTL_S` (one day) after its last use; each
training request that resolves it restarts the day. Memory is bounded: past
`MAX_RECORDS` sequences or `MAX_RECORDED_TOKENS` prompt+sampled tokens
(counted per record, so a prompt shared by n samples counts n times, though its
array is shared), the least recently used records are dropped first, expired
or not, and counted in `statistics().evicted`. At the defaults the arrays take
at most about 8 bytes a token: 128 MiB. Records are in memory only: a daemon
restart loses them (the training requests then fail naming the sequence id).

Guarantees of `resolve`: a request either comes back with every datum's
`recorded_logprobs` set, or fails with a `BadRequest` naming the datum, the
field and the sequence id; nothing is refreshed by a failing request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np

from openrld.batches import ProvenanceSpan, TrainDatum
from openrld.errors import BadRequest

RECORD_TTL_S = 24 * 3600.0  # "can be trained on for one day after sampling; each use restarts that day"
MAX_RECORDS = 200_000  # sequences held at once
MAX_RECORDED_TOKENS = 16_000_000  # prompt + sampled tokens held at once (about 8 bytes each)

INPUT_SPANS = "model_input_spans"
TARGET_SPANS = "loss_fn_input_spans"


class StabilityRecord(msgspec.Struct, frozen=True):
    sequence_id: str
    session_id: str  # the ServiceClient session that sampled it; only its training requests may use it
    sampler_id: str
    base_model: str
    version: str | None  # the weights version that served every token; None is the base model
    temperature: float
    top_k: int
    top_p: float
    prompt: np.ndarray  # int64 (P,): the request's prompt
    tokens: np.ndarray  # int32 (S,): the sampled tokens
    logprobs: np.ndarray  # float32 (S,): log q_T of each sampled token, as returned

    @property
    def size_tokens(self) -> int:
        return int(self.prompt.size + self.tokens.size)


class StabilityStatistics(msgspec.Struct, frozen=True):
    records: int
    recorded_tokens: int
    recorded_total: int
    expired: int
    evicted: int  # dropped before expiry to stay within the bounds
    resolved_sequences: int


class StabilityRecords:
    """The node's stability records, least recently used first."""

    def __init__(
        self, *, ttl_s: float = RECORD_TTL_S, max_records: int = MAX_RECORDS,
        max_tokens: int = MAX_RECORDED_TOKENS,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_records = max_records
        self._max_tokens = max_tokens
        self._records: OrderedDict[str, tuple[StabilityRecord, float]] = OrderedDict()  # id -> (record, last use)
        self._tokens = 0
        self._recorded = 0
        self._expired = 0
        self._evicted = 0
        self._resolved = 0

    def add(self, record: StabilityRecord, now: float) -> None:
        """Hold `record` (a resubmitted request's identical ids replace the first ones)."""
        self._drop(record.sequence_id)
        self._records[record.sequence_id] = (record, now)
        self._tokens += record.size_tokens
        self._recorded += 1
        self.expire(now)
        while self._records and (len(self._records) > self._max_records or self._tokens > self._max_tokens):
            self._drop(next(iter(self._records)))
            self._evicted += 1

    def expire(self, now: float) -> None:
        """Drop the records unused for `ttl_s`; they sit at the front (LRU order)."""
        while self._records:
            sequence_id, (_, last_used) = next(iter(self._records.items()))
            if now - last_used < self._ttl_s:
                return
            self._drop(sequence_id)
            self._expired += 1

    def get(self, sequence_id: str, session_id: str, now: float) -> StabilityRecord | None:
        """The record, if it exists, is unexpired and belongs to `session_id`; does not refresh."""
        held = self._records.get(sequence_id)
        if held is None or now - held[1] >= self._ttl_s or held[0].session_id != session_id:
            return None
        return held[0]

    def touch(self, sequence_ids: Sequence[str], now: float) -> None:
        """Restart the day of each id (a training request used it)."""
        for sequence_id in sequence_ids:
            held = self._records.get(sequence_id)
            if held is not None:
                self._records[sequence_id] = (held[0], now)
                self._records.move_to_end(sequence_id)

    def statistics(self) -> StabilityStatistics:
        return StabilityStatistics(
            records=len(self._records), recorded_tokens=self._tokens, recorded_total=self._recorded,
            expired=self._expired, evicted=self._evicted, resolved_sequences=self._resolved,
        )

    def _drop(self, sequence_id: str) -> None:
        held = self._records.pop(sequence_id, None)
        if held is not None:
            self._tokens -= held[0].size_tokens

    def resolve(self, data: Sequence[TrainDatum], session_id: str, now: float) -> list[TrainDatum]:
        """Check every datum's provenance and attach the records.

        Args:
            data: the datums of one stable_reinforce request.
            session_id: the training model's ServiceClient session.
            now: the clock `add` was called with.

        Returns:
            The datums with `recorded_logprobs` set: float32 (N,), the recorded sampler
            logprob at target positions under a SampledProvenanceSpan, NaN elsewhere.
            Every sequence named is refreshed.

        Raises:
            BadRequest: a datum without both span lists, spans that do not tile their
                field, an unknown, expired or foreign sequence id, a span outside the
                recorded prompt or sampled tokens, model_input or sampled target tokens
                that differ from the recorded ones, or a non-zero advantage on a
                prompt-attributed target. The message names the datum and the field.
        """
        self.expire(now)
        used: set[str] = set()
        resolved = [self._resolve_datum(index, datum, session_id, now, used) for index, datum in enumerate(data)]
        self.touch(sorted(used), now)
        self._resolved += len(used)
        return resolved

    def _resolve_datum(
        self, index: int, datum: TrainDatum, session_id: str, now: float, used: set[str]
    ) -> TrainDatum:
        where = f"datum {index}"
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            raise BadRequest(
                f"{where}: stable_reinforce needs provenance on every datum (model_input_spans and "
                "loss_fn_input_spans, from a sampling client created with record_stability_info=True)",
                key=INPUT_SPANS if datum.model_input_spans is None else TARGET_SPANS,
            )
        n = len(datum.tokens)
        for field, spans in ((INPUT_SPANS, datum.model_input_spans), (TARGET_SPANS, datum.loss_fn_input_spans)):
            covered = sum(span.length for span in spans)
            if covered != n:
                raise BadRequest(
                    f"{where}: {field} cover {covered} positions; they must tile all {n} (model_input length)",
                    key=field,
                )
        for position, span in _runs(datum.model_input_spans):
            record = self._record(where, INPUT_SPANS, span, session_id, now)
            used.add(span.sequence_id)
            _check_tokens(where, INPUT_SPANS, "model_input", span, position, datum.tokens, record)
        targets = datum.inputs.get("target_tokens")
        advantages = datum.inputs.get("advantages")
        recorded = np.full(n, np.nan, dtype=np.float32)
        for position, span in _runs(datum.loss_fn_input_spans):
            record = self._record(where, TARGET_SPANS, span, session_id, now)
            used.add(span.sequence_id)
            end = position + span.length
            if span.is_sampled:
                # Target shapes are the loss's to judge; only well-formed 1-D targets are compared.
                if targets is not None and targets.shape == (n,):
                    what = "loss_fn_inputs['target_tokens']"
                    _check_tokens(where, TARGET_SPANS, what, span, position, targets, record)
                recorded[position:end] = record.logprobs[span.offset : span.offset + span.length]
            elif advantages is not None and advantages.shape == (n,) and np.any(advantages[position:end] != 0):
                at = position + int(np.flatnonzero(advantages[position:end] != 0)[0])
                raise BadRequest(
                    f"{where}: loss_fn_inputs['advantages'] is {float(advantages[at]):.7g} at position {at}, which "
                    f"loss_fn_input_spans attribute to the prompt of {span.sequence_id!r}; stable_reinforce "
                    "only accepts non-zero advantages on sampled tokens",
                    key="advantages",
                )
        return msgspec.structs.replace(datum, recorded_logprobs=recorded)

    def _record(
        self, where: str, field: str, span: ProvenanceSpan, session_id: str, now: float
    ) -> StabilityRecord:
        record = self.get(span.sequence_id, session_id, now)
        if record is None:
            raise BadRequest(
                f"{where}: {field} names sequence_id {span.sequence_id!r}, which this session has no stability "
                "record of: it was not sampled with record_stability_info=True in this session, or its record "
                "expired (one day after its last use)",
                key=field,
            )
        limit = record.tokens.size if span.is_sampled else record.prompt.size
        if span.offset + span.length > limit:
            part = "sampled tokens" if span.is_sampled else "prompt"
            raise BadRequest(
                f"{where}: {field} span [{span.offset}, {span.offset + span.length}) of {span.sequence_id!r} lies "
                f"outside its {part}, which holds {limit} tokens",
                key=field,
            )
        return record


def _runs(spans: Sequence[ProvenanceSpan]) -> list[tuple[int, ProvenanceSpan]]:
    """(first datum position, span) for each span with a length: position comes from order."""
    runs = []
    position = 0
    for span in spans:
        if span.length:
            runs.append((position, span))
        position += span.length
    return runs


def _check_tokens(
    where: str, field: str, what: str, span: ProvenanceSpan, position: int, tokens: np.ndarray,
    record: StabilityRecord,
) -> None:
    source = record.tokens if span.is_sampled else record.prompt
    expected = source[span.offset : span.offset + span.length].astype(np.int64)
    got = np.asarray(tokens[position : position + span.length]).astype(np.int64)
    if not np.array_equal(got, expected):
        k = int(np.flatnonzero(got != expected)[0])
        part = "sampled token" if span.is_sampled else "prompt token"
        raise BadRequest(
            f"{where}: {what}[{position + k}] is {int(got[k])}, but {field} attribute it to {part} "
            f"{span.offset + k} of {span.sequence_id!r}, which is {int(expected[k])}",
            key=field,
        )
