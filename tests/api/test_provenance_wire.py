"""Provenance spans on forward_backward datums, as the SDK encodes them (Datum fields 3 and 4)."""

from __future__ import annotations

import pytest
import tinker.types as sdk
from tinker.proto import tinker_public_pb2 as sdk_pb

from openrld.batches import ProvenanceSpan
from openrld.errors import BadRequest
from tests.api.test_wire import decode, sdk_fwdbwd_body, text_datum

SEQ = "s-a:sample:0:3:1"


def test_spans_decode_in_order_with_their_kind():
    datum = text_datum([5, 6, 7, 8], target_tokens=[6, 7, 8, 9], advantages=[0.0, 0.0, 1.0, 1.0]).with_provenance(
        model_input=[sdk.PromptProvenanceSpan(sequence_id=SEQ, offset=0, length=3),
                     sdk.SampledProvenanceSpan(sequence_id=SEQ, offset=0, length=1)],
        loss_fn_inputs=[sdk.PromptProvenanceSpan(sequence_id=SEQ, offset=1, length=2),
                        sdk.SampledProvenanceSpan(sequence_id=SEQ, offset=0, length=2)],
    )
    _, _, batch = decode(sdk_fwdbwd_body([datum], loss_fn="stable_reinforce"))
    decoded = batch.data[0]
    assert decoded.model_input_spans == (ProvenanceSpan(SEQ, 0, 3, False), ProvenanceSpan(SEQ, 0, 1, True))
    assert decoded.loss_fn_input_spans == (ProvenanceSpan(SEQ, 1, 2, False), ProvenanceSpan(SEQ, 0, 2, True))
    assert decoded.recorded_logprobs is None  # only the server's stability records set it


def test_datum_without_spans_decodes_to_none():
    _, _, batch = decode(sdk_fwdbwd_body([text_datum([1, 2], target_tokens=[2, 3])]))
    assert (batch.data[0].model_input_spans, batch.data[0].loss_fn_input_spans) == (None, None)


def test_span_with_a_negative_offset_is_refused_naming_the_datum_and_span():
    # The SDK refuses a negative offset itself, so the span is written into its protobuf by hand.
    body = sdk_fwdbwd_body([text_datum([1, 2, 3], target_tokens=[2, 3, 4])])
    message = sdk_pb.ForwardBackwardRequest.FromString(body)
    span = message.data[0].model_input_spans.add()
    span.sampled_tokens.sequence_id = SEQ
    span.sampled_tokens.offset = -1
    span.sampled_tokens.length = 3
    with pytest.raises(BadRequest) as error:
        decode(message.SerializeToString())
    assert error.value.detail == "data[0].model_input_spans[0]: offset and length must be >= 0, got -1 and 3"
