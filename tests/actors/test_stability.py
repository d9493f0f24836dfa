"""Stability records and provenance resolution.

One recorded sequence "s-a:sample:0:0:0": prompt [5, 6, 7] (P = 3), sampled [8, 9, 2]
(S = 3) with logprobs [-0.5, -1.0, -1.5]. The cookbook's single-turn datum for it has
N = P + S − 1 = 5: model_input = [5, 6, 7, 8, 9], targets = [6, 7, 8, 9, 2], and
model_input_spans = [Prompt(0, 3), Sampled(0, 2)], loss_fn_input_spans = [Prompt(1, 2), Sampled(0, 3)].
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from openrld.actors.stability import RECORD_TTL_S, StabilityRecord, StabilityRecords
from openrld.batches import ProvenanceSpan, TrainDatum
from openrld.errors import BadRequest

SESSION = "s-a"
SEQ = "s-a:sample:0:0:0"


def record(sequence_id: str = SEQ, session_id: str = SESSION) -> StabilityRecord:
    return StabilityRecord(
        sequence_id=sequence_id, session_id=session_id, sampler_id=f"{session_id}:sample:0", base_model="tiny",
        version=None, temperature=1.0, top_k=-1, top_p=1.0, prompt=np.array([5, 6, 7], np.int64),
        tokens=np.array([8, 9, 2], np.int32), logprobs=np.array([-0.5, -1.0, -1.5], np.float32),
    )


def prompt(offset: int, length: int, sequence_id: str = SEQ) -> ProvenanceSpan:
    return ProvenanceSpan(sequence_id, offset, length, is_sampled=False)


def sampled(offset: int, length: int, sequence_id: str = SEQ) -> ProvenanceSpan:
    return ProvenanceSpan(sequence_id, offset, length, is_sampled=True)


INPUT_SPANS = (prompt(0, 3), sampled(0, 2))
TARGET_SPANS = (prompt(1, 2), sampled(0, 3))


def cookbook_datum(
    tokens=(5, 6, 7, 8, 9), targets=(6, 7, 8, 9, 2), advantages=(0, 0, 1, 1, 1),
    input_spans=INPUT_SPANS, target_spans=TARGET_SPANS,
) -> TrainDatum:
    return TrainDatum(
        tokens=np.array(tokens, np.int64),
        inputs={"target_tokens": np.array(targets, np.int64), "advantages": np.array(advantages, np.float32)},
        model_input_spans=input_spans, loss_fn_input_spans=target_spans,
    )


@pytest.fixture
def records() -> StabilityRecords:
    held = StabilityRecords()
    held.add(record(), now=0.0)
    return held


def refused(records: StabilityRecords, datum: TrainDatum, now: float = 1.0) -> BadRequest:
    with pytest.raises(BadRequest) as error:
        records.resolve([cookbook_datum(), datum], SESSION, now)
    return error.value


def test_sampled_targets_get_the_recorded_logprobs_and_prompt_targets_nan(records):
    [resolved] = records.resolve([cookbook_datum()], SESSION, now=1.0)
    recorded = resolved.recorded_logprobs.tolist()
    assert [math.isnan(v) for v in recorded[:2]] == [True, True]
    assert recorded[2:] == [-0.5, -1.0, -1.5]


def test_targets_under_a_prompt_span_are_not_checked(records):
    # rl_loop.py sends 0 at prompt-attributed targets, and real Tinker accepts it.
    [resolved] = records.resolve([cookbook_datum(targets=(0, 0, 8, 9, 2))], SESSION, now=1.0)
    assert resolved.recorded_logprobs[2:].tolist() == [-0.5, -1.0, -1.5]


def test_unknown_sequence_id_is_refused_naming_datum_field_and_id(records):
    error = refused(records, cookbook_datum(input_spans=(prompt(0, 3, "s-a:sample:0:9:0"), sampled(0, 2))))
    assert error.detail == (
        "datum 1: model_input_spans names sequence_id 's-a:sample:0:9:0', which this session has no stability "
        "record of: it was not sampled with record_stability_info=True in this session, or its record expired "
        "(one day after its last use)"
    )
    assert error.key == "model_input_spans"


def test_another_sessions_sequence_is_refused_as_unknown(records):
    with pytest.raises(BadRequest, match="names sequence_id 's-a:sample:0:0:0', which this session has no"):
        records.resolve([cookbook_datum()], "s-other", now=1.0)


def test_record_expires_one_day_after_its_last_use_and_each_use_restarts_the_day(records):
    records.resolve([cookbook_datum()], SESSION, now=RECORD_TTL_S - 1)  # used just before the day ends
    records.resolve([cookbook_datum()], SESSION, now=2 * RECORD_TTL_S - 2)  # still held: the day restarted
    with pytest.raises(BadRequest, match="or its record expired"):
        records.resolve([cookbook_datum()], SESSION, now=3 * RECORD_TTL_S - 2)
    assert records.statistics().expired == 1


def test_a_failing_request_refreshes_nothing(records):
    bad = cookbook_datum(advantages=(1, 0, 1, 1, 1))
    with pytest.raises(BadRequest):
        records.resolve([bad], SESSION, now=RECORD_TTL_S - 1)
    with pytest.raises(BadRequest, match="or its record expired"):
        records.resolve([cookbook_datum()], SESSION, now=RECORD_TTL_S)


def test_span_outside_the_recorded_sampled_tokens_is_refused(records):
    error = refused(records, cookbook_datum(target_spans=(prompt(1, 1), sampled(0, 4))))
    assert error.detail == (
        "datum 1: loss_fn_input_spans span [0, 4) of 's-a:sample:0:0:0' lies outside its sampled tokens, "
        "which holds 3 tokens"
    )


def test_model_input_token_that_differs_from_the_record_is_refused(records):
    error = refused(records, cookbook_datum(tokens=(5, 6, 7, 8, 4)))
    assert error.detail == (
        "datum 1: model_input[4] is 4, but model_input_spans attribute it to sampled token 1 of "
        "'s-a:sample:0:0:0', which is 9"
    )
    assert error.key == "model_input_spans"


def test_sampled_target_that_differs_from_the_record_is_refused(records):
    error = refused(records, cookbook_datum(targets=(6, 7, 8, 9, 3)))
    assert error.detail == (
        "datum 1: loss_fn_inputs['target_tokens'][4] is 3, but loss_fn_input_spans attribute it to sampled "
        "token 2 of 's-a:sample:0:0:0', which is 2"
    )


def test_nonzero_advantage_on_a_prompt_target_is_refused(records):
    error = refused(records, cookbook_datum(advantages=(0, 1, 2, 2, 2)))
    assert error.detail == (
        "datum 1: loss_fn_inputs['advantages'] is 1 at position 1, which loss_fn_input_spans attribute to the "
        "prompt of 's-a:sample:0:0:0'; stable_reinforce only accepts non-zero advantages on sampled tokens"
    )
    assert error.key == "advantages"


def test_spans_that_do_not_tile_the_datum_are_refused(records):
    error = refused(records, cookbook_datum(input_spans=(prompt(0, 3), sampled(0, 1))))
    assert error.detail == "datum 1: model_input_spans cover 4 positions; they must tile all 5 (model_input length)"


def test_datum_without_provenance_is_refused(records):
    error = refused(records, cookbook_datum(input_spans=None, target_spans=None))
    assert error.detail.startswith("datum 1: stable_reinforce needs provenance on every datum")


def test_least_recently_used_record_is_evicted_past_the_bound():
    held = StabilityRecords(max_records=2)
    for i in range(3):
        held.add(record(f"s-a:sample:0:{i}:0"), now=float(i))
    assert held.get("s-a:sample:0:0:0", SESSION, now=3.0) is None
    assert held.get("s-a:sample:0:2:0", SESSION, now=3.0) is not None
    stats = held.statistics()
    assert (stats.records, stats.recorded_tokens, stats.evicted) == (2, 12, 1)


def test_token_bound_evicts_too():
    held = StabilityRecords(max_tokens=10)  # each record holds 3 prompt + 3 sampled tokens
    held.add(record("s-a:sample:0:0:0"), now=0.0)
    held.add(record("s-a:sample:0:1:0"), now=1.0)
    assert (held.statistics().records, held.statistics().evicted) == (1, 1)
