"""The Tinker wire against the real SDK 0.38.0.

Requests are built with the SDK's own types and serialised the way its
resources do (`tinker.proto.request_conv` plus `SerializeToString`, optional
zstd; pydantic `model_dump(mode="json", exclude_none=True)` for JSON), then
decoded by openrld. Results are encoded by openrld and decoded by the SDK's
`tinker.proto.response_conv` or validated by its pydantic response models.
Expected values are written out; float32 values are chosen exactly
representable, so comparisons are exact.
"""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
import pytest
import tinker.types as sdk
import zstandard
from google.protobuf import descriptor_pb2, descriptor_pool
from tinker.cli.auth_api import SelfApiKeyResponse, _ErrorResponse as CliErrorResponse
from tinker.lib.public_interfaces.rest_client import (
    _SessionTraceExportPollResponse as SdkTraceExportPollResponse,
)
from tinker.proto import request_conv, response_conv, tinker_public_pb2 as sdk_pb
from tinker.types._pydantic_types.tensor_data import TensorData as SdkTensorDataModel
from tinker.types.auth_token_response import AuthTokenResponse
from tinker.types.client_dynamic_config_response import ClientDynamicConfigResponse
from tinker.types.external_weights_urls_response import ExternalWeightsUrlsResponse
from tinker.types.generic_event import GenericEvent
from tinker.types.optimizer import OptimParamsBase
from tinker.types.save_weights_external_response import SaveWeightsExternalResponseInternal
from tinker.types.save_weights_for_sampler_response import SaveWeightsForSamplerResponseInternal
from tinker.types.try_again_response import TryAgainResponse

from openrld.api import proto, wire
from openrld.api.proto import schema
from openrld.batches import (
    AdamParams,
    DimuonParams,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    SampledSequence,
    SampleJob,
    SampleResult,
    TopK,
)
from openrld.errors import BadRequest, NotSupportedYet, ServerError

MAX_BODY_BYTES = 1 << 20
MODEL_ID = "sess-1:train:0"


# ---------------------------------------------------------------- helpers


def sdk_fwdbwd_body(
    data: list[sdk.Datum],
    *,
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    forward_only: bool = False,
    seq_id: int = 1,
) -> bytes:
    """What `AsyncTrainingResource.forward_backward` puts on the wire (before zstd)."""
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config
        ),
        model_id=MODEL_ID,
        seq_id=seq_id,
    )
    message = request_conv.forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def decode(body: bytes, encoding: str | None = None) -> tuple[str, int, ForwardBackwardBatch]:
    return wire.decode_forward_backward(body, encoding, max_body_bytes=MAX_BODY_BYTES)


def text_datum(tokens: list[int], **inputs: Any) -> sdk.Datum:
    return sdk.Datum(model_input=sdk.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def hand_request(tensor: Any, name: str = "weights") -> bytes:
    """A request built with the SDK's own pb2 classes, for encodings the SDK never writes."""
    message = sdk_pb.ForwardBackwardRequest(model_id=MODEL_ID, seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2, 3], dtype="<i4").tobytes()
    datum.loss_fn_inputs[name].CopyFrom(tensor)
    return message.SerializeToString()


def sdk_json(model: Any) -> bytes:
    """What the SDK's resources send: `model_dump(mode="json", exclude_none=True)`."""
    return json.dumps(model.model_dump(mode="json", exclude_none=True)).encode()


def as_sdk(body: msgspec.Struct, sdk_type: type) -> Any:
    return sdk_type.model_validate(json.loads(wire.encode_json(body)))


def sample_request(**fields: Any) -> sdk.SampleRequest:
    fields.setdefault("prompt", sdk.ModelInput.from_ints([11, 12, 13, 14]))
    fields.setdefault("sampling_params", sdk.SamplingParams(max_tokens=8))
    return sdk.SampleRequest(sampling_session_id="sess-1:sample:0", seq_id=0, **fields)


def sample_job(request: sdk.SampleRequest, *, max_num_samples: int = 8, max_topk: int = 20) -> SampleJob:
    decoded = wire.decode_json(sdk_json(request), wire.SampleRequest)
    return wire.sample_job_from_request(decoded, max_num_samples=max_num_samples, max_topk=max_topk)


# ---------------------------------------------------------------- schema


def test_descriptor_equals_the_sdk_descriptor() -> None:
    sdk_file = descriptor_pb2.FileDescriptorProto()
    sdk_pb.DESCRIPTOR.CopyToProto(sdk_file)
    assert proto.build_file_descriptor_proto() == sdk_file


def test_message_classes_live_in_a_private_pool() -> None:
    pool = schema.ForwardBackwardRequest.DESCRIPTOR.file.pool
    assert pool is schema.POOL
    assert pool is not descriptor_pool.Default()


def test_sdk_request_bytes_parse_into_our_classes_field_for_field() -> None:
    body = sdk_fwdbwd_body([text_datum([1, 2], target_tokens=[2, 3])], loss_fn_config={"beta": 0.5})
    ours = schema.ForwardBackwardRequest()
    ours.ParseFromString(body)
    assert ours.SerializeToString(deterministic=True) == (
        sdk_pb.ForwardBackwardRequest.FromString(body).SerializeToString(deterministic=True)
    )


# ---------------------------------------------------------------- forward_backward request


def test_forward_backward_decodes_ids_tokens_and_inputs_from_sdk_bytes() -> None:
    body = sdk_fwdbwd_body(
        [
            text_datum([5, 6, 7], target_tokens=[6, 7, 8], weights=[1.0, 0.5, 0.0]),
            text_datum([9, 10], target_tokens=[10, 11], weights=[0.25, 1.0]),
        ],
        seq_id=7,
    )
    model_id, seq_id, batch = decode(body)
    assert (model_id, seq_id) == (MODEL_ID, 7)
    assert batch.loss_fn == "cross_entropy"
    assert batch.forward_only is False
    first, second = batch.data
    assert first.tokens.dtype == np.int64 and first.tokens.tolist() == [5, 6, 7]
    assert first.inputs["target_tokens"].dtype == np.int64
    assert first.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert first.inputs["weights"].dtype == np.float32
    assert first.inputs["weights"].tolist() == [1.0, 0.5, 0.0]
    assert second.tokens.tolist() == [9, 10]
    assert second.inputs["weights"].tolist() == [0.25, 1.0]


def test_encoded_text_chunks_concatenate_in_order() -> None:
    model_input = sdk.ModelInput(
        chunks=[
            sdk.EncodedTextChunk(tokens=[1, 2]),
            sdk.EncodedTextChunk(tokens=[3]),
            sdk.EncodedTextChunk(tokens=[70000]),
        ]
    )
    body = sdk_fwdbwd_body([sdk.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})])
    _, _, batch = decode(body)
    assert batch.data[0].tokens.tolist() == [1, 2, 3, 70000]


def test_zstd_body_decodes_like_the_plain_body() -> None:
    body = sdk_fwdbwd_body([text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0])])
    # The SDK compresses with ZstdCompressor().compress, which declares the content size.
    _, _, plain = decode(body)
    _, _, compressed = decode(zstandard.ZstdCompressor().compress(body), "zstd")
    assert compressed.data[0].tokens.tolist() == plain.data[0].tokens.tolist()
    assert compressed.data[0].inputs["weights"].tolist() == [1.0, 1.0, 1.0]


def test_forward_only_flag_is_carried() -> None:
    _, _, batch = decode(sdk_fwdbwd_body([text_datum([1], target_tokens=[2])], forward_only=True))
    assert batch.forward_only is True


def test_csr_inputs_expand_to_dense_with_zero_fill() -> None:
    # Dense (3, 2) target_tokens [[0, 0], [0, 5], [6, 0]] as CSR: row 0 empty.
    targets = sdk.TensorData(
        data=np.array([5, 6], dtype=np.int64), dtype="int64", shape=[3, 2],
        sparse_crow_indices=[0, 0, 1, 2], sparse_col_indices=[1, 0],
    )
    weights = sdk.TensorData(
        data=np.array([0.5, -2.0, 1.0], dtype=np.float32), dtype="float32", shape=[3, 2],
        sparse_crow_indices=[0, 0, 2, 3], sparse_col_indices=[0, 1, 1],
    )
    body = sdk_fwdbwd_body([text_datum([1, 2, 3], target_tokens=targets, weights=weights)])
    _, _, batch = decode(body)
    inputs = batch.data[0].inputs
    assert inputs["target_tokens"].dtype == np.int64
    assert inputs["target_tokens"].tolist() == [[0, 0], [0, 5], [6, 0]]
    assert inputs["weights"].dtype == np.float32
    assert inputs["weights"].tolist() == [[0.0, 0.0], [0.5, -2.0], [0.0, 1.0]]


def test_torch_2d_inputs_that_the_sdk_sparsifies_decode_exactly() -> None:
    torch = pytest.importorskip("torch")
    targets = torch.tensor([[3, 0, 0, 0], [0, 0, 4, 0], [0, 0, 0, 0]], dtype=torch.int64)
    weights = torch.tensor([[0.5, 0, 0, 0], [0, 0, -1.0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    datum = text_datum([1, 2, 3], target_tokens=targets, weights=weights)
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # sent as CSR
    _, _, batch = decode(sdk_fwdbwd_body([datum]))
    assert batch.data[0].inputs["target_tokens"].tolist() == targets.tolist()
    assert batch.data[0].inputs["weights"].tolist() == weights.tolist()


def test_loss_config_v2_keeps_numbers_and_strings() -> None:
    body = sdk_fwdbwd_body(
        [text_datum([1], target_tokens=[2])], loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.75, "clip_high_threshold": 1.25, "mode": "token"},
    )
    _, _, batch = decode(body)
    assert batch.loss_fn == "ppo"
    assert batch.loss_config == {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25, "mode": "token"}


def test_legacy_loss_config_is_used_when_v2_is_empty() -> None:
    message = sdk_pb.ForwardBackwardRequest.FromString(sdk_fwdbwd_body([text_datum([1], target_tokens=[2])]))
    message.loss_fn_config["beta"] = 0.125
    _, _, batch = decode(message.SerializeToString())
    assert batch.loss_config == {"beta": 0.125}


def test_integer_float_inputs_are_converted_to_float32() -> None:
    body = sdk_fwdbwd_body([text_datum([1, 2], target_tokens=[2, 3], advantages=np.array([3, -1], dtype=np.int64))])
    _, _, batch = decode(body)
    advantages = batch.data[0].inputs["advantages"]
    assert advantages.dtype == np.float32 and advantages.tolist() == [3.0, -1.0]


def test_whole_number_float_target_tokens_become_int64() -> None:
    body = sdk_fwdbwd_body([text_datum([1, 2], target_tokens=np.array([7.0, 9.0], dtype=np.float32))])
    _, _, batch = decode(body)
    targets = batch.data[0].inputs["target_tokens"]
    assert targets.dtype == np.int64 and targets.tolist() == [7, 9]


def test_fractional_target_tokens_are_refused_naming_the_field() -> None:
    body = sdk_fwdbwd_body([text_datum([1, 2], target_tokens=np.array([7.0, 9.5], dtype=np.float32))])
    with pytest.raises(BadRequest, match=r"data\[0\]\.loss_fn_inputs\['target_tokens'\].*whole numbers.*9\.5"):
        decode(body)


def test_int32_and_bf16_tensors_are_widened() -> None:
    int32 = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_INT32, shape=[3], dense=np.array([4, 5, 6], dtype="<i4").tobytes())
    # bf16 is the top half of a float32: 1.5 -> 0x3FC0, -2.0 -> 0xC000, 0.25 -> 0x3E80.
    bf16_bits = np.array([0x3FC0, 0xC000, 0x3E80], dtype="<u2")
    bf16 = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_BFLOAT16, shape=[3], dense=bf16_bits.tobytes())
    message = sdk_pb.ForwardBackwardRequest.FromString(hand_request(int32, "target_tokens"))
    message.data[0].loss_fn_inputs["weights"].CopyFrom(bf16)
    _, _, batch = decode(message.SerializeToString())
    assert batch.data[0].inputs["target_tokens"].dtype == np.int64
    assert batch.data[0].inputs["target_tokens"].tolist() == [4, 5, 6]
    assert batch.data[0].inputs["weights"].dtype == np.float32
    assert batch.data[0].inputs["weights"].tolist() == [1.5, -2.0, 0.25]


def test_dense_tensor_without_shape_is_one_dimensional() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, dense=np.array([1.0, 2.0, 3.0], dtype="<f4").tobytes())
    _, _, batch = decode(hand_request(tensor))
    assert batch.data[0].inputs["weights"].shape == (3,)


def test_dense_bytes_that_do_not_fill_the_shape_are_refused() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, shape=[2, 2], dense=np.zeros(3, dtype="<f4").tobytes())
    message = r"data\[0\]\.loss_fn_inputs\['weights'\]: dense data holds 3 elements but shape \[2, 2\] needs 4"
    with pytest.raises(BadRequest, match=message):
        decode(hand_request(tensor))


def test_dense_bytes_that_split_an_element_are_refused() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, dense=b"\x00" * 6)
    with pytest.raises(BadRequest, match=r"weights'\]\.dense: 6 bytes is not a whole number of 4-byte elements"):
        decode(hand_request(tensor))


def test_csr_on_a_rank_one_shape_is_refused() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, shape=[3])
    tensor.sparse_csr.values = np.array([1.0], dtype="<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1], dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([0], dtype="<i8").tobytes()
    with pytest.raises(BadRequest, match=r"weights'\]: sparse_csr needs a rank-2 shape, got \[3\]"):
        decode(hand_request(tensor))


def test_csr_whose_row_pointers_overrun_the_values_is_refused() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, shape=[2, 2])
    tensor.sparse_csr.values = np.array([1.0], dtype="<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1, 2], dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([0], dtype="<i8").tobytes()
    with pytest.raises(BadRequest, match=r"crow_indices must start at 0, never decrease and end at 1"):
        decode(hand_request(tensor))


def test_csr_column_outside_the_shape_is_refused() -> None:
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, shape=[1, 2])
    tensor.sparse_csr.values = np.array([1.0], dtype="<f4").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1], dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([2], dtype="<i8").tobytes()
    with pytest.raises(BadRequest, match=r"col_indices must lie in \[0, 2\)"):
        decode(hand_request(tensor))


def test_csr_that_expands_past_the_body_limit_is_refused() -> None:
    # An 8 KB body whose all-empty CSR asks for a 1000 x 100000 dense tensor.
    tensor = sdk_pb.Tensor(dtype=sdk_pb.DTYPE_FLOAT32, shape=[1000, 100_000])
    tensor.sparse_csr.crow_indices = np.zeros(1001, dtype="<i8").tobytes()
    message = r"weights'\]: sparse tensor expands to 100000000 cells; only 1048576 are left"
    with pytest.raises(BadRequest, match=message):
        decode(hand_request(tensor))


def test_image_chunk_is_not_supported_yet_naming_the_datum_and_chunk() -> None:
    model_input = sdk.ModelInput(
        chunks=[sdk.EncodedTextChunk(tokens=[1]), sdk.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
    )
    body = sdk_fwdbwd_body([sdk.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [1] * 5})])
    with pytest.raises(NotSupportedYet, match=r"data\[0\]\.model_input\[1\]: image chunks are not supported yet"):
        decode(body)


def test_malformed_protobuf_is_bad_request() -> None:
    with pytest.raises(BadRequest, match=r"not a ForwardBackwardRequest protobuf"):
        decode(b"\xff\xff\xff\xff")


def test_request_without_model_id_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"model_id is required"):
        decode(sdk_pb.ForwardBackwardRequest(seq_id=1, loss_fn="cross_entropy").SerializeToString())


def test_ids_of_a_refused_body_are_still_readable_so_its_seq_id_can_be_burned() -> None:
    model_input = sdk.ModelInput(chunks=[sdk.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=1)])
    body = sdk_fwdbwd_body([sdk.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [1]})], seq_id=5)
    with pytest.raises(NotSupportedYet):
        decode(body)
    assert wire.forward_backward_ids(body, None, max_body_bytes=MAX_BODY_BYTES) == (MODEL_ID, 5)


def test_ids_of_an_unreadable_body_are_none() -> None:
    assert wire.forward_backward_ids(b"\xff\xff\xff", None, max_body_bytes=MAX_BODY_BYTES) is None


def test_body_over_the_limit_is_refused_before_parsing() -> None:
    with pytest.raises(BadRequest, match=r"body is 11 bytes; the limit is 10"):
        wire.decode_forward_backward(b"x" * 11, None, max_body_bytes=10)


def test_zstd_body_declaring_more_than_the_limit_is_refused() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (MAX_BODY_BYTES + 1))
    with pytest.raises(BadRequest, match=r"zstd body declares 1048577 bytes; the limit is 1048576"):
        decode(bomb, "zstd")


def test_zstd_stream_without_declared_size_is_bounded() -> None:
    sink = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(sink, closefd=False) as writer:
        writer.write(b"\x00" * (MAX_BODY_BYTES + 1))
    with pytest.raises(BadRequest, match=r"truncated, corrupt or over 1048576 bytes"):
        decode(sink.getvalue(), "zstd")


def test_unknown_content_encoding_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"Content-Encoding: expected zstd, gzip, deflate or none, got 'br'"):
        decode(b"", "br")


# ---------------------------------------------------------------- forward_backward result


def test_forward_backward_output_round_trips_through_the_sdk_decoder() -> None:
    result = ForwardBackwardResult(
        logprobs=[np.array([-0.5, -1.25, -2.0], np.float32), np.array([-0.75], np.float32)],
        metrics={"loss:sum": 3.5, "tokens:sum": 4.0},
    )
    payload = wire.encode_forward_backward_output(result)
    raw = sdk_pb.ForwardBackwardOutput.FromString(payload)
    assert len(raw.loss_fn_outputs) == 1 and raw.loss_fn_outputs[0].num_datums == 2
    output = response_conv.deserialize_forward_backward_output(payload)
    assert output.loss_fn_output_type == "ArrayRecord"
    assert output.metrics == {"loss:sum": 3.5, "tokens:sum": 4.0}
    assert [o["logprobs"].shape for o in output.loss_fn_outputs] == [[3], [1]]
    assert [o["logprobs"].dtype for o in output.loss_fn_outputs] == ["float32", "float32"]
    assert [o["logprobs"].data for o in output.loss_fn_outputs] == [[-0.5, -1.25, -2.0], [-0.75]]


def test_two_dimensional_logprobs_come_back_with_shape_n_k() -> None:
    first = np.array([[-1.0, -2.0], [-3.0, -4.0], [-0.5, -0.25]], np.float32)
    second = np.array([[-8.0, -16.0]], np.float32)
    payload = wire.encode_forward_backward_output(ForwardBackwardResult(logprobs=[first, second], metrics={}))
    record = sdk_pb.ForwardBackwardOutput.FromString(payload).loss_fn_outputs[0]
    assert list(record.fields["logprobs"].trailing_shape) == [2]
    output = response_conv.deserialize_forward_backward_output(payload)
    assert output.loss_fn_outputs[0]["logprobs"].shape == [3, 2]
    assert output.loss_fn_outputs[0]["logprobs"].to_numpy().tolist() == first.tolist()
    assert output.loss_fn_outputs[1]["logprobs"].to_numpy().tolist() == second.tolist()


def test_ragged_trailing_shapes_split_into_records_the_sdk_concatenates() -> None:
    arrays = [
        np.array([-1.0, -2.0], np.float32),
        np.array([[-3.0, -4.0, -5.0]], np.float32),
        np.array([-6.0], np.float32),
    ]
    payload = wire.encode_forward_backward_output(ForwardBackwardResult(logprobs=arrays, metrics={}))
    assert [r.num_datums for r in sdk_pb.ForwardBackwardOutput.FromString(payload).loss_fn_outputs] == [1, 1, 1]
    output = response_conv.deserialize_forward_backward_output(payload)
    assert [o["logprobs"].shape for o in output.loss_fn_outputs] == [[2], [1, 3], [1]]
    assert output.loss_fn_outputs[1]["logprobs"].to_numpy().tolist() == [[-3.0, -4.0, -5.0]]


def test_metric_key_without_exactly_one_colon_is_a_server_error() -> None:
    with pytest.raises(ServerError, match=r"metric key 'loss' must be 'name:reduction'"):
        wire.encode_forward_backward_output(ForwardBackwardResult(logprobs=[], metrics={"loss": 1.0}))


# ---------------------------------------------------------------- sample result


def sequence(
    tokens: list[int], logprobs: list[float], stop_reason: str = "stop", topk: TopK | None = None
) -> SampledSequence:
    return SampledSequence(
        tokens=np.array(tokens, np.int32), logprobs=np.array(logprobs, np.float32), stop_reason=stop_reason, topk=topk
    )


def test_sample_response_round_trips_through_the_sdk_decoder() -> None:
    result = SampleResult(
        sequences=[sequence([4, 5, 2], [-0.5, -1.0, -0.125], "stop"), sequence([9], [-2.0], "length")],
        prompt_cache_hit_tokens=3,
    )
    response = response_conv.deserialize_sample_response(wire.encode_sample_response(result))
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert [s.tokens for s in response.sequences] == [[4, 5, 2], [9]]
    assert [s.logprobs for s in response.sequences] == [[-0.5, -1.0, -0.125], [-2.0]]
    assert [s.topk_logprobs for s in response.sequences] == [None, None]
    assert response.prompt_logprobs is None
    assert response.topk_prompt_logprobs is None
    assert response.prompt_cache_hit_tokens == 3


def test_nan_prompt_logprobs_come_back_as_none() -> None:
    result = SampleResult(
        sequences=[sequence([1], [-1.0], "length")],
        prompt_logprobs=np.array([np.nan, np.nan, -0.5, -3.0], np.float32),
    )
    response = response_conv.deserialize_sample_response(wire.encode_sample_response(result))
    assert response.prompt_logprobs == [None, None, -0.5, -3.0]


def test_topk_logprobs_round_trip_with_sentinel_rows_read_as_none() -> None:
    sentinel = -99999.0
    topk_prompt = TopK(
        token_ids=np.array([[0, 0], [7, 3], [5, 0]], np.int32),
        logprobs=np.array([[sentinel, sentinel], [-0.25, -2.0], [-0.5, sentinel]], np.float32),
    )
    topk_sampled = TopK(token_ids=np.array([[8, 1]], np.int32), logprobs=np.array([[-0.125, -4.0]], np.float32))
    result = SampleResult(
        sequences=[sequence([8], [-0.125], "stop", topk=topk_sampled)],
        prompt_logprobs=np.array([np.nan, -0.25, -0.5], np.float32),
        topk_prompt=topk_prompt,
    )
    response = response_conv.deserialize_sample_response(wire.encode_sample_response(result))
    assert response.topk_prompt_logprobs == [None, [(7, -0.25), (3, -2.0)], [(5, -0.5)]]
    assert response.sequences[0].topk_logprobs == [[(8, -0.125), (1, -4.0)]]


def test_unknown_stop_reason_is_a_server_error() -> None:
    result = SampleResult(sequences=[sequence([1], [-1.0], "abort")])
    with pytest.raises(ServerError, match=r"sequence 0: stop_reason must be 'stop' or 'length', got 'abort'"):
        wire.encode_sample_response(result)


def test_tokens_and_logprobs_of_different_lengths_are_a_server_error() -> None:
    with pytest.raises(ServerError, match=r"sequence 0: 2 tokens but 1 logprobs"):
        wire.encode_sample_response(SampleResult(sequences=[sequence([1, 2], [-1.0])]))


# ---------------------------------------------------------------- JSON: sample requests


def test_sdk_sample_request_becomes_a_sample_job() -> None:
    request = sample_request(
        num_samples=3,
        sampling_params=sdk.SamplingParams(max_tokens=16, seed=42, temperature=0.5, top_k=40, top_p=0.875),
        prompt_logprobs=True,
        topk_prompt_logprobs=5,
        topk_sample_logprobs=2,
        prompt_logprobs_last_n=2,
        record_stability_info=False,
    )
    job = sample_job(request)
    assert job.prompt.dtype == np.int64 and job.prompt.tolist() == [11, 12, 13, 14]
    assert job.num_samples == 3
    assert (job.prompt_logprobs, job.prompt_logprobs_last_n) == (True, 2)
    assert (job.topk_prompt_logprobs, job.topk_sample_logprobs) == (5, 2)
    params = job.params
    assert (params.max_tokens, params.seed, params.temperature, params.top_k, params.top_p) == (16, 42, 0.5, 40, 0.875)
    assert (params.stop_strings, params.stop_token_ids, params.stop_at_eos) == ((), (), True)


def test_compute_logprobs_request_decodes() -> None:
    # What SamplingClient.compute_logprobs sends.
    request = sample_request(sampling_params=sdk.SamplingParams(max_tokens=1, temperature=1.0), prompt_logprobs=True)
    job = sample_job(request)
    assert job.prompt_logprobs is True and job.params.max_tokens == 1 and job.prompt_logprobs_last_n is None


@pytest.mark.parametrize(
    ("stop", "strings", "token_ids", "stop_at_eos"),
    [
        (None, (), (), True),
        ([], (), (), False),
        ("\n\n", ("\n\n",), (), True),
        (["User:", "###"], ("User:", "###"), (), True),
        ([128001, 7], (), (128001, 7), True),
    ],
    ids=["none-keeps-eos", "empty-list-disables-eos", "string", "strings", "token-ids"],
)
def test_stop_is_split_into_strings_token_ids_and_eos(
    stop: Any, strings: tuple[str, ...], token_ids: tuple[int, ...], stop_at_eos: bool
) -> None:
    params = sample_job(sample_request(sampling_params=sdk.SamplingParams(max_tokens=4, stop=stop))).params
    assert (params.stop_strings, params.stop_token_ids, params.stop_at_eos) == (strings, token_ids, stop_at_eos)


def test_mixed_stop_list_is_refused() -> None:
    body = sdk_json(sample_request()).replace(b'"max_tokens": 8', b'"max_tokens": 8, "stop": ["a", 3]')
    request = wire.decode_json(body, wire.SampleRequest)
    with pytest.raises(BadRequest, match=r"sampling_params\.stop: .*got a mix"):
        wire.sample_job_from_request(request, max_num_samples=8, max_topk=20)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"sampling_params\.stop: stop strings must be non-empty"):
        sample_job(sample_request(sampling_params=sdk.SamplingParams(stop=["ok", ""])))


def test_top_k_zero_means_no_limit() -> None:
    assert sample_job(sample_request(sampling_params=sdk.SamplingParams(top_k=0))).params.top_k == -1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (sdk.SamplingParams(temperature=-0.5), r"sampling_params\.temperature: expected a finite value >= 0, got -0\.5"),
        (sdk.SamplingParams(top_p=0.0), r"sampling_params\.top_p: expected a value in \(0, 1\], got 0\.0"),
        (sdk.SamplingParams(top_p=1.5), r"sampling_params\.top_p: expected a value in \(0, 1\], got 1\.5"),
        (sdk.SamplingParams(top_k=-2), r"sampling_params\.top_k: .* got -2"),
        (sdk.SamplingParams(max_tokens=-1), r"sampling_params\.max_tokens: expected >= 0, got -1"),
        (sdk.SamplingParams(stop=[-3]), r"sampling_params\.stop: token ids must lie in .* got -3"),
    ],
    ids=[
        "negative-temperature", "zero-top-p", "top-p-over-one", "top-k-below-minus-one", "negative-max-tokens",
        "negative-stop-id",
    ],
)
def test_bad_sampling_params_are_refused_naming_the_field(params: sdk.SamplingParams, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        sample_job(sample_request(sampling_params=params))


@pytest.mark.parametrize("num_samples", [0, 9], ids=["zero", "over-the-cap"])
def test_num_samples_outside_one_to_the_cap_is_refused(num_samples: int) -> None:
    message = rf"num_samples: expected 1 to 8 \(the server's max_num_samples\), got {num_samples}"
    with pytest.raises(BadRequest, match=message):
        sample_job(sample_request(num_samples=num_samples), max_num_samples=8)


def test_prompt_logprobs_last_n_requires_prompt_logprobs() -> None:
    with pytest.raises(BadRequest, match=r"prompt_logprobs_last_n requires prompt_logprobs=true"):
        sample_job(sample_request(prompt_logprobs=False, prompt_logprobs_last_n=2))


def test_prompt_logprobs_last_n_beyond_the_prompt_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"prompt_logprobs_last_n: expected 1 to 3 \(prompt length - 1\), got 4"):
        sample_job(sample_request(prompt_logprobs=True, prompt_logprobs_last_n=4))


def test_topk_over_the_cap_is_refused_naming_the_cap() -> None:
    with pytest.raises(BadRequest, match=r"topk_sample_logprobs: expected 0 to 20 \(the server's max_topk\), got 21"):
        sample_job(sample_request(topk_sample_logprobs=21), max_topk=20)


def test_target_prompt_logprobs_is_not_supported_yet() -> None:
    targets = SdkTensorDataModel(data=[5, -1, 6, 7, -1, -1], dtype="int64", shape=[3, 2])
    with pytest.raises(NotSupportedYet, match=r"target_prompt_logprobs is not supported yet") as info:
        sample_job(sample_request(target_prompt_logprobs=targets))
    assert info.value.key == "target_prompt_logprobs"


def test_prompt_alt_tokens_is_not_supported_yet() -> None:
    with pytest.raises(NotSupportedYet, match=r"prompt_alt_tokens_k > 0 is not supported yet"):
        sample_job(sample_request(prompt_alt_tokens_k=2))


def test_record_stability_info_is_accepted() -> None:
    assert sample_job(sample_request(record_stability_info=True)).num_samples == 1


@pytest.mark.parametrize(
    ("chunk", "kind"),
    [
        (sdk.ImageChunk(data=b"\x89PNG\r\n", format="png", expected_tokens=4), "image"),
        (sdk.ImageAssetPointerChunk(location="s3://bucket/cat.png", format="png", expected_tokens=4), "image_asset_pointer"),
        (sdk.DmelChunk(dmel=b"\x01\x01\x04"), "dmel"),
    ],
    ids=["image", "image-asset-pointer", "dmel"],
)
def test_non_text_prompt_chunk_is_not_supported_yet_naming_its_type(chunk: Any, kind: str) -> None:
    prompt = sdk.ModelInput(chunks=[sdk.EncodedTextChunk(tokens=[1, 2]), chunk])
    with pytest.raises(NotSupportedYet, match=rf"prompt\.chunks\[1\]: '{kind}' chunks are not supported yet"):
        sample_job(sample_request(prompt=prompt))


def test_image_chunk_base64_decodes_to_its_bytes() -> None:
    prompt = sdk.ModelInput(chunks=[sdk.ImageChunk(data=b"\x89PNG\r\n\x00", format="jpeg")])
    request = wire.decode_json(sdk_json(sample_request(prompt=prompt)), wire.SampleRequest)
    chunk = request.prompt.chunks[0]
    assert (chunk.type, chunk.data, chunk.format) == ("image", b"\x89PNG\r\n\x00", "jpeg")


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"prompt: holds no tokens"):
        sample_job(sample_request(prompt=sdk.ModelInput(chunks=[])))


# ---------------------------------------------------------------- JSON: training requests


def test_sdk_create_model_request_decodes() -> None:
    request = sdk.CreateModelRequest(
        session_id="sess-1", model_seq_id=0, base_model="tiny-llama",
        lora_config=sdk.LoraConfig(rank=8, seed=3, train_unembed=False), user_metadata={"run": "a", "n": 1},
    )
    decoded = wire.decode_json(sdk_json(request), wire.CreateModelRequest)
    assert (decoded.session_id, decoded.model_seq_id, decoded.base_model) == ("sess-1", 0, "tiny-llama")
    assert decoded.optimizer_config == {"type": "adamw"}
    assert decoded.user_metadata == {"run": "a", "n": 1}
    assert decoded.lora_config is not None
    assert wire.lora_spec_from_config(decoded.lora_config) == LoraSpec(
        rank=8, seed=3, train_unembed=False, train_mlp=True, train_attn=True
    )


def test_lora_config_with_no_trained_part_is_refused() -> None:
    config = wire.LoraConfig(rank=4, train_unembed=False, train_mlp=False, train_attn=False)
    with pytest.raises(BadRequest, match=r"lora_config: at least one of train_unembed, train_mlp, train_attn"):
        wire.lora_spec_from_config(config)


def test_optimizer_family_of_the_sdk_default_is_adamw() -> None:
    assert wire.optimizer_family(sdk.AdamOptimizerConfig().model_dump(mode="json")) == "adamw"


def test_optimizer_family_of_the_sdk_dimuon_config_is_dimuon() -> None:
    assert wire.optimizer_family(sdk.DimuonOptimizerConfig().model_dump(mode="json")) == "dimuon"


def test_dimuon_config_of_another_version_is_refused() -> None:
    with pytest.raises(BadRequest, match=r"optimizer_config\.version: dimuon version must be 1, got 2"):
        wire.optimizer_family({"type": "dimuon", "version": 2})


def test_unknown_optimizer_config_is_refused_listing_the_supported_ones() -> None:
    with pytest.raises(BadRequest, match=r"^unsupported optimizer type 'lion'; supported: adamw, dimuon$"):
        wire.optimizer_family({"type": "lion", "lr": 1})


def test_optimizer_config_without_a_type_is_refused() -> None:
    body = b'{"session_id": "s", "model_seq_id": 0, "base_model": "m", "optimizer_config": {"version": 1}}'
    with pytest.raises(BadRequest, match=r"optimizer_config: expected an object with a string 'type'"):
        wire.decode_json(body, wire.CreateModelRequest)


def test_sdk_adam_params_become_adam_params() -> None:
    request = sdk.OptimStepRequest(
        adam_params=sdk.AdamParams(learning_rate=2e-5, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0),
        model_id=MODEL_ID, seq_id=4,
    )
    body = sdk_json(request)
    assert b'"adam_params"' in body  # the SDK's wire name for AdamParams
    decoded = wire.decode_json(body, wire.OptimStepRequest)
    assert (decoded.model_id, decoded.seq_id) == (MODEL_ID, 4)
    assert wire.adam_params_from_request(decoded) == AdamParams(
        learning_rate=2e-5, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
    )


def test_omitted_adam_fields_take_the_sdk_defaults() -> None:
    body = b'{"model_id": "m", "seq_id": 1, "optimizer_params": {"type": "adamw", "learning_rate": 0.5}}'
    decoded = wire.decode_json(body, wire.OptimStepRequest)
    assert wire.adam_params_from_request(decoded) == AdamParams(learning_rate=0.5)


def test_legacy_optim_params_key_is_accepted() -> None:
    decoded = wire.decode_json(b'{"model_id": "m", "optim_params": {"learning_rate": 0.25}}', wire.OptimStepRequest)
    assert wire.adam_params_from_request(decoded) == AdamParams(learning_rate=0.25)


def test_sdk_dimuon_params_become_dimuon_params_with_the_spec_defaults() -> None:
    params = sdk.DimuonParams(learning_rate=0.01, grad_clip_norm=2.0, beta1=0.5)
    request = sdk.OptimStepRequest(optimizer_params=params, model_id=MODEL_ID, seq_id=2)
    decoded = wire.decode_json(sdk_json(request), wire.OptimStepRequest)
    assert wire.adam_params_from_request(decoded) == DimuonParams(
        learning_rate=0.01, grad_clip_norm=2.0, beta1=0.5, damping=1e-4, rank_lr_correction_exponent=0.175
    )


def test_dimuon_params_of_sdk_0_29_keep_damping_and_exponent() -> None:
    body = (
        b'{"model_id": "m", "optimizer_params": {"type": "dimuon", "learning_rate": 0.1, '
        b'"damping": 0.01, "rank_lr_correction_exponent": 0.0}}'
    )
    params = wire.adam_params_from_request(wire.decode_json(body, wire.OptimStepRequest))
    assert params == DimuonParams(learning_rate=0.1, damping=0.01, rank_lr_correction_exponent=0.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"beta1": 0.9}, r"optimizer_params\.learning_rate: required for dimuon"),
        ({"learning_rate": 0.1, "weight_decay": 0.1}, r"optimizer_params\.weight_decay: not a DimuonParams field"),
        ({"learning_rate": 0.1, "damping": 0.0}, r"optimizer_params\.damping: expected > 0, got 0\.0"),
        ({"learning_rate": 0.1, "beta1": 1.0}, r"optimizer_params\.beta1: expected a value in \[0, 1\), got 1\.0"),
    ],
    ids=["no-learning-rate", "adamw-field", "zero-damping", "beta1-one"],
)
def test_bad_dimuon_params_are_refused_naming_the_field(params: dict, message: str) -> None:
    body = json.dumps({"model_id": "m", "optimizer_params": {"type": "dimuon", **params}}).encode()
    with pytest.raises(BadRequest, match=message):
        wire.adam_params_from_request(wire.decode_json(body, wire.OptimStepRequest))


def test_sdk_unknown_optimizer_params_are_refused_listing_the_supported_ones() -> None:
    lion = OptimParamsBase(type="lion", learning_rate=0.1)
    request = sdk.OptimStepRequest(optimizer_params=lion, model_id=MODEL_ID, seq_id=2)
    decoded = wire.decode_json(sdk_json(request), wire.OptimStepRequest)
    with pytest.raises(BadRequest, match=r"^unsupported optimizer type 'lion'; supported: adamw, dimuon$"):
        wire.adam_params_from_request(decoded)


def test_optim_step_without_params_is_refused() -> None:
    decoded = wire.decode_json(b'{"model_id": "m", "seq_id": 1}', wire.OptimStepRequest)
    with pytest.raises(BadRequest, match=r"expected exactly one of adam_params, optimizer_params, optim_params; got none"):
        wire.adam_params_from_request(decoded)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("beta1", 1.0, r"adam_params\.beta1: expected a value in \[0, 1\), got 1\.0"),
        ("learning_rate", -1e-3, r"adam_params\.learning_rate: expected >= 0, got -0\.001"),
        ("eps", -1.0, r"adam_params\.eps: expected >= 0, got -1\.0"),
        ("beta2", -0.5, r"adam_params\.beta2: expected a value in \[0, 1\), got -0\.5"),
        # JSON has no infinity; an overflowing literal is refused while decoding.
        ("weight_decay", 1e400, r"Number out of range - at `\$\.adam_params\.weight_decay`"),
    ],
    ids=["beta1-one", "negative-lr", "negative-eps", "negative-beta2", "overflowing-weight-decay"],
)
def test_out_of_range_adam_values_are_refused_naming_the_field(field: str, value: float, message: str) -> None:
    body = json.dumps({"model_id": "m", "adam_params": {field: value}}).encode().replace(b"Infinity", b"1e400")
    with pytest.raises(BadRequest, match=message):
        wire.adam_params_from_request(wire.decode_json(body, wire.OptimStepRequest))


def test_negative_grad_clip_norm_means_no_clipping() -> None:
    decoded = wire.decode_json(b'{"model_id": "m", "adam_params": {"grad_clip_norm": -1.0}}', wire.OptimStepRequest)
    assert wire.adam_params_from_request(decoded).grad_clip_norm == -1.0


def test_sdk_create_via_load_request_decodes() -> None:
    request = sdk.LoadWeightsRequest(
        session_id="sess-1", model_seq_id=2, path="tinker://run/weights/step-1", optimizer=False,
        optimizer_config=sdk.AdamOptimizerConfig(),
    )
    decoded = wire.decode_json(sdk_json(request), wire.LoadWeightsRequest)
    assert decoded.creates_model
    assert (decoded.session_id, decoded.model_seq_id, decoded.model_id) == ("sess-1", 2, None)
    assert decoded.optimizer_config == {"type": "adamw"}


def test_sdk_legacy_load_request_decodes() -> None:
    request = sdk.LoadWeightsRequest(model_id=MODEL_ID, seq_id=5, path="tinker://run/weights/a", optimizer=True)
    decoded = wire.decode_json(sdk_json(request), wire.LoadWeightsRequest)
    assert not decoded.creates_model
    assert (decoded.model_id, decoded.seq_id, decoded.optimizer) == (MODEL_ID, 5, True)


def test_load_request_mixing_both_addressing_modes_is_refused() -> None:
    body = (
        b'{"model_id": "m", "seq_id": 1, "session_id": "s", "model_seq_id": 0,'
        b' "path": "tinker://r/weights/a", "optimizer": false}'
    )
    with pytest.raises(BadRequest, match=r"invalid LoadWeightsRequest body: expected either session_id and model_seq_id"):
        wire.decode_json(body, wire.LoadWeightsRequest)


def test_sdk_unnamed_inflight_save_for_sampler_decodes() -> None:
    request = sdk.SaveWeightsForSamplerRequest(model_id=MODEL_ID, seq_id=3, sampling_session_seq_id=1, kind="inflight")
    decoded = wire.decode_json(sdk_json(request), wire.SaveWeightsForSamplerRequest)
    assert (decoded.path, decoded.sampling_session_seq_id, decoded.kind) == (None, 1, "inflight")


def test_inflight_save_under_a_path_is_refused() -> None:
    body = b'{"model_id": "m", "seq_id": 3, "path": "p", "kind": "inflight"}'
    with pytest.raises(BadRequest, match=r"kind 'inflight' cannot be saved under a path"):
        wire.decode_json(body, wire.SaveWeightsForSamplerRequest)


def test_unknown_sampler_kind_is_refused_naming_the_path() -> None:
    body = b'{"model_id": "m", "seq_id": 3, "path": "p", "kind": "live"}'
    with pytest.raises(BadRequest, match=r"Invalid enum value 'live' - at `\$\.kind`"):
        wire.decode_json(body, wire.SaveWeightsForSamplerRequest)


# ---------------------------------------------------------------- JSON: other requests


def _telemetry_events() -> list[Any]:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    common = {"event_id": "e", "event_session_index": 0, "severity": "INFO", "timestamp": now}
    return [
        sdk.SessionStartEvent(event="SESSION_START", **common),
        sdk.SessionEndEvent(event="SESSION_END", duration="0:00:05", **common),
        sdk.UnhandledExceptionEvent(
            event="UNHANDLED_EXCEPTION", error_type="ValueError", error_message="x", traceback="tb", **common
        ),
        GenericEvent(event="GENERIC_EVENT", event_name="user_error", event_data={"a": [1, 2]}, **common),
    ]


REQUESTS = [
    pytest.param(
        sdk.ClientConfigRequest(sdk_version="0.38.0"),
        wire.ClientConfigRequest,
        {"sdk_version": "0.38.0"},
        id="client-config",
    ),
    pytest.param(
        sdk.CreateSessionRequest(tags=["a"], user_metadata={}, sdk_version="0.38.0", project_id="p"),
        wire.CreateSessionRequest,
        {"tags": ["a"], "user_metadata": {}, "sdk_version": "0.38.0", "project_id": "p"},
        id="create-session",
    ),
    pytest.param(
        sdk.SessionHeartbeatRequest(session_id="s"), wire.SessionHeartbeatRequest, {"session_id": "s"}, id="heartbeat"
    ),
    pytest.param(
        sdk.TelemetrySendRequest(
            events=_telemetry_events(), platform="Linux", sdk_version="0.38.0", session_id="s", process_uuid="u"
        ),
        wire.TelemetryRequest,
        {"platform": "Linux", "session_id": "s", "process_uuid": "u"},
        id="telemetry",
    ),
    pytest.param(sdk.GetInfoRequest(model_id=MODEL_ID), wire.GetInfoRequest, {"model_id": MODEL_ID}, id="get-info"),
    pytest.param(
        sdk.SaveWeightsRequest(model_id=MODEL_ID, path="step-1", seq_id=2, ttl_seconds=3600, user_metadata={"k": "v"}),
        wire.SaveWeightsRequest,
        {"model_id": MODEL_ID, "path": "step-1", "seq_id": 2, "ttl_seconds": 3600, "overwrite": False,
         "user_metadata": {"k": "v"}},
        id="save-weights",
    ),
    pytest.param(
        sdk.SaveWeightsExternalRequest(model_id=MODEL_ID, path="hf", seq_id=2, age_encryption_recipients=["age1x"]),
        wire.SaveWeightsExternalRequest,
        {"model_id": MODEL_ID, "path": "hf", "seq_id": 2, "age_encryption_recipients": ["age1x"]},
        id="save-external",
    ),
    pytest.param(
        sdk.CreateSamplingSessionRequest(session_id="s", sampling_session_seq_id=1, model_path="tinker://r/sampler_weights/a"),
        wire.CreateSamplingSessionRequest,
        {"session_id": "s", "sampling_session_seq_id": 1, "model_path": "tinker://r/sampler_weights/a"},
        id="create-sampling-session",
    ),
    pytest.param(
        sdk.FutureRetrieveRequest(request_id="req-1", allow_metadata_only=True),
        wire.FutureRetrieveRequest,
        {"request_id": "req-1", "allow_metadata_only": True},
        id="retrieve-future",
    ),
    pytest.param(
        sdk.FuturesRetrieveRequest(
            target=sdk.SamplingSessionFuturesTarget(sampling_session_id="ss", cloned_sampler_id=3),
            prev_cursor=9, timeout=0.0, retrieved_request_ids=["a"],
        ),
        wire.FuturesRetrieveRequest,
        {"target": {"sampling_session_id": "ss", "cloned_sampler_id": 3}, "prev_cursor": 9, "timeout": 0.0,
         "retrieved_request_ids": ["a"]},
        id="retrieve-futures",
    ),
    pytest.param(
        sdk.CopyWeightsRequest(source_path="tinker://r/weights/a", destination_project_id="p", ttl_seconds=3600),
        wire.CopyWeightsRequest,
        {"source_path": "tinker://r/weights/a", "destination_project_id": "p", "ttl_seconds": 3600},
        id="copy-weights",
    ),
    pytest.param(
        sdk.SessionSearchRequest(
            display_name="run", limit=10,
            cursor=sdk.SessionSearchCursor(last_created_at=datetime(2026, 1, 1, tzinfo=UTC), last_session_id="s0"),
        ),
        wire.SessionSearchRequest,
        {"display_name": "run", "limit": 10,
         "cursor": {"last_created_at": "2026-01-01T00:00:00Z", "last_session_id": "s0"}},
        id="session-search",
    ),
]


@pytest.mark.parametrize(("sdk_request", "ours", "expected"), REQUESTS)
def test_sdk_request_bodies_decode_with_their_values(sdk_request: Any, ours: type, expected: dict[str, Any]) -> None:
    decoded = wire.decode_json(sdk_json(sdk_request), ours)
    assert {key: msgspec.to_builtins(getattr(decoded, key)) for key in expected} == expected


def test_session_search_owner_and_statuses_decode_to_their_variants() -> None:
    request = sdk.SessionSearchRequest(
        owner=sdk.UserSearchOwner(owner_urns=["u1", "u2"]),
        statuses=[sdk.ClientFinishedSessionStatusQuery(reasons=["errored"]), sdk.FailedSessionStatusQuery()],
    )
    decoded = wire.decode_json(sdk_json(request), wire.SessionSearchRequest)
    assert decoded.owner == wire.UserSearchOwner(owner_urns=["u1", "u2"])
    assert decoded.statuses == [wire.ClientFinishedStatusQuery(reasons=["errored"]), wire.FailedStatusQuery()]


def test_session_search_limit_over_200_is_refused_naming_the_path() -> None:
    with pytest.raises(BadRequest, match=r"Expected `int` <= 200 - at `\$\.limit`"):
        wire.decode_json(b'{"limit": 201}', wire.SessionSearchRequest)


def test_session_finish_body_decodes_with_explicit_null_detail() -> None:
    decoded = wire.decode_json(b'{"reason": {"type": "interrupted"}, "detail": null}', wire.SessionFinishRequest)
    assert (decoded.reason.type, decoded.detail) == ("interrupted", None)


def test_ttl_body_with_null_removes_the_expiry() -> None:
    assert wire.decode_json(b'{"ttl_seconds": null}', wire.TtlRequest).ttl_seconds is None


def test_unknown_keys_and_type_discriminators_are_ignored() -> None:
    body = b'{"model_id": "m", "type": "get_info", "added_in_sdk_0_39": [1, 2]}'
    assert wire.decode_json(body, wire.GetInfoRequest) == wire.GetInfoRequest(model_id="m")


def test_wrong_field_type_is_bad_request_naming_the_path() -> None:
    body = sdk_json(sample_request()).replace(b'"max_tokens": 8', b'"max_tokens": "eight"')
    message = r"invalid SampleRequest body: Expected `int \| null`, got `str` - at `\$\.sampling_params\.max_tokens`"
    with pytest.raises(BadRequest, match=message):
        wire.decode_json(body, wire.SampleRequest)


def test_missing_required_field_is_bad_request_naming_it() -> None:
    with pytest.raises(BadRequest, match=r"Object missing required field `model_id`"):
        wire.decode_json(b"{}", wire.GetInfoRequest)


def test_unknown_chunk_type_is_bad_request_naming_the_path() -> None:
    body = b'{"prompt": {"chunks": [{"type": "video", "frames": []}]}, "sampling_params": {}}'
    with pytest.raises(BadRequest, match=r"Invalid enum value 'video' - at `\$\.prompt\.chunks\[0\]\.type`"):
        wire.decode_json(body, wire.SampleRequest)


def test_malformed_json_is_bad_request() -> None:
    with pytest.raises(BadRequest, match=r"invalid GetInfoRequest body: not application/json: "):
        wire.decode_json(b'{"model_id": ', wire.GetInfoRequest)


# ---------------------------------------------------------------- JSON: responses


CREATED = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
CHECKPOINT = wire.Checkpoint(
    checkpoint_id="weights/step-1", checkpoint_type="training", time=CREATED,
    tinker_path=f"tinker://{MODEL_ID}/weights/step-1", size_bytes=1234, user_metadata={"k": "v"},
)
CURSOR = wire.Cursor(offset=0, limit=100, total_count=1)
TRAINING_RUN = wire.TrainingRun(
    training_run_id=MODEL_ID, base_model="tiny-llama", model_owner="u", is_lora=True,
    last_request_time=CREATED, lora_rank=8, last_checkpoint=CHECKPOINT,
)
FINISHED_SESSION = wire.SessionSummary(
    session_id="s1", created_at=CREATED, owner="u", project_id="p", checkpoints_count=2,
    status=wire.ClientSessionFinished(reason=wire.FinishReason(type="success")),
)
FAILED_SESSION = wire.SessionSummary(
    session_id="s2", created_at=CREATED, owner="u", project_id="p", checkpoints_count=0,
    status=wire.SessionFailed(
        category="user", message="m", reason=wire.FailedRequestReason(request_id="r", request_type="Sample")
    ),
)
HOUR = datetime(2026, 3, 4, 5, tzinfo=UTC)
BILLING_USAGE = wire.BillingUsageResponse(
    data=[
        wire.BillingUsageEvent(
            bucket_start=HOUR, bucket_end=datetime(2026, 3, 4, 6, tzinfo=UTC),
            event_info=wire.TrainingBillingEvent(token_count=76), base_model="tiny-llama",
            user_id="tml:user:u", user_name="u", session_id="s1", project_id="p",
        ),
        wire.BillingUsageEvent(
            bucket_start=HOUR, bucket_end=datetime(2026, 3, 4, 6, tzinfo=UTC),
            event_info=wire.SamplingPrefillBillingEvent(cached=False, token_count=12), session_id="s1",
        ),
        wire.BillingUsageEvent(
            bucket_start=HOUR, bucket_end=datetime(2026, 3, 4, 6, tzinfo=UTC),
            event_info=wire.SamplingSampleBillingEvent(token_count=8), session_id="s1",
        ),
        wire.BillingUsageEvent(
            bucket_start=HOUR, bucket_end=datetime(2026, 3, 4, 6, tzinfo=UTC),
            event_info=wire.CheckpointBillingEvent(count=2), session_id="s2",
        ),
    ],
    sessions={"s1": wire.BillingUsageSession(user_metadata={"k": "v"}), "s2": wire.BillingUsageSession()},
)
RESPONSES = [
    pytest.param(
        wire.ClientConfigResponse(proto_compress_fwdbwd=True, fwdbwd_max_chunk_len=64), sdk.ClientConfigResponse,
        id="client-config",
    ),
    pytest.param(
        wire.ClientDynamicConfigResponse(sample_cancel_enabled=True), ClientDynamicConfigResponse, id="dynamic-config"
    ),
    pytest.param(
        wire.CreateSessionResponse(session_id="sess-1", warning_message="w"), sdk.CreateSessionResponse,
        id="create-session",
    ),
    pytest.param(wire.SessionHeartbeatResponse(), sdk.SessionHeartbeatResponse, id="heartbeat"),
    pytest.param(wire.TelemetryResponse(), sdk.TelemetryResponse, id="telemetry"),
    pytest.param(
        wire.UntypedAPIFuture(request_id="req-1", sample_sequence_ids=["a", "b"]), sdk.UntypedAPIFuture, id="future"
    ),
    pytest.param(
        wire.TryAgainResponse(request_id="req-1", queue_state="paused_capacity"), TryAgainResponse, id="try-again"
    ),
    pytest.param(
        wire.RequestFailedResponse(error="bad loss input", category="user"), sdk.RequestFailedResponse, id="failed"
    ),
    pytest.param(
        wire.FuturesRetrieveResponse(
            completions=[
                wire.FutureFinished(request_id="a", response_payload_uncompressed_size=10),
                wire.FutureFailed(request_id="b"),
            ],
            cursor=4,
        ),
        sdk.FuturesRetrieveResponse,
        id="futures",
    ),
    pytest.param(wire.CreateModelResponse(model_id=MODEL_ID), sdk.CreateModelResponse, id="create-model"),
    pytest.param(
        wire.GetInfoResponse(
            model_data=wire.ModelData(arch="llama", model_name="tiny-llama", tokenizer_id="tiny-llama"),
            model_id=MODEL_ID, optimizer_config={"type": "adamw"}, is_lora=True, lora_rank=8, model_name="tiny-llama",
        ),
        sdk.GetInfoResponse,
        id="get-info",
    ),
    pytest.param(
        wire.OptimStepResponse(metrics={"grad_norm": 0.5, "learning_rate": 1e-4}), sdk.OptimStepResponse,
        id="optim-step",
    ),
    pytest.param(
        wire.SaveWeightsResponse(path=f"tinker://{MODEL_ID}/weights/a"), sdk.SaveWeightsResponse, id="save-weights"
    ),
    pytest.param(
        wire.SaveWeightsForSamplerResponse(sampling_session_id="sess-1:sample:1"),
        SaveWeightsForSamplerResponseInternal,
        id="save-for-sampler",
    ),
    pytest.param(
        wire.SaveWeightsExternalResponse(path=f"tinker://{MODEL_ID}/external_weights/a", size_bytes=99),
        SaveWeightsExternalResponseInternal,
        id="save-external",
    ),
    pytest.param(
        wire.LoadWeightsResponse(path="tinker://r/weights/a", model_id=MODEL_ID), sdk.LoadWeightsResponse,
        id="load-weights",
    ),
    pytest.param(
        wire.CreateSamplingSessionResponse(sampling_session_id="sess-1:sample:0"), sdk.CreateSamplingSessionResponse,
        id="create-sampling-session",
    ),
    pytest.param(
        wire.GetSamplerResponse(sampler_id="sess-1:sample:0", base_model="tiny-llama"), sdk.GetSamplerResponse,
        id="get-sampler",
    ),
    pytest.param(
        wire.GetServerCapabilitiesResponse(supported_models=[
            wire.SupportedModel(model_name="tiny-llama", max_context_length=2048, trainable=True, sampleable=False),
        ]),
        sdk.GetServerCapabilitiesResponse,
        id="capabilities",
    ),
    pytest.param(
        wire.WeightsInfoResponse(base_model="tiny-llama", is_lora=False, optimizer_config={"type": "dimuon", "version": 1}),
        sdk.WeightsInfoResponse,
        id="weights-info",
    ),
    pytest.param(wire.CopyWeightsResponse(tinker_path="tinker://r2/weights/a"), sdk.CopyWeightsResponse, id="copy-weights"),
    pytest.param(
        wire.CheckpointsListResponse(checkpoints=[CHECKPOINT], cursor=CURSOR), sdk.CheckpointsListResponse,
        id="checkpoints",
    ),
    pytest.param(
        wire.ExternalWeightsUrlsResponse(urls={"model.safetensors": "http://x/y"}, expires=CREATED),
        ExternalWeightsUrlsResponse,
        id="external-urls",
    ),
    pytest.param(
        wire.TrainingRunsResponse(training_runs=[TRAINING_RUN], cursor=CURSOR), sdk.TrainingRunsResponse,
        id="training-runs",
    ),
    pytest.param(wire.ListSessionsResponse(sessions=["sess-1"]), sdk.ListSessionsResponse, id="list-sessions"),
    pytest.param(
        wire.GetSessionResponse(training_run_ids=[MODEL_ID], sampler_ids=[], display_name="d"), sdk.GetSessionResponse,
        id="get-session",
    ),
    pytest.param(
        wire.SessionSearchResponse(
            sessions=[FINISHED_SESSION, FAILED_SESSION],
            next_cursor=wire.SessionSearchCursor(last_created_at=CREATED, last_session_id="s2"),
        ),
        sdk.SessionSearchResponse,
        id="session-search",
    ),
    pytest.param(
        wire.TraceExportResponse(status="ready", url="http://x/api/v1/trace/s1/trace.json?expires=1&sig=a"),
        SdkTraceExportPollResponse,
        id="trace-export",
    ),
    pytest.param(wire.HealthResponse(), sdk.HealthResponse, id="health"),
    # The SDK keeps an error's JSON body as it is; the CLI reads its `detail` (spec §1.6).
    pytest.param(wire.ErrorResponse(detail="no training run 'r'"), CliErrorResponse, id="error"),
    pytest.param(
        wire.AuditLogResponse(entries=[
            wire.AuditLogEntry(
                timestamp=CREATED, event="checkpoint_created",
                event_details={"tinker_path": f"tinker://{MODEL_ID}/weights/a", "model_id": MODEL_ID},
                tinker_path=f"tinker://{MODEL_ID}/weights/a", model_id=MODEL_ID,
            ),
            wire.AuditLogEntry(timestamp=CREATED, event="project_moved"),
        ]),
        sdk.AuditLogResponse,
        id="audit-log",
    ),
    pytest.param(BILLING_USAGE, sdk.BillingUsageResponse, id="billing-usage"),
    pytest.param(
        wire.CurrentCheckpointStorageUsageResponse(data=[
            wire.CurrentCheckpointStorageUsageItem(
                checkpoint_count=3, size_bytes=1_500_000_000, size_gigabytes=1.5, project_id="p",
                org_user_urn="tml:user:u", user_name="u",
            ),
            wire.CurrentCheckpointStorageUsageItem(checkpoint_count=1, size_bytes=0, size_gigabytes=0.0),
        ]),
        sdk.CurrentCheckpointStorageUsageResponse,
        id="checkpoint-storage",
    ),
    pytest.param(wire.AuthTokenResponse(jwt="eyJ.a.b"), AuthTokenResponse, id="auth-token"),
    pytest.param(
        wire.SelfApiKeyResponse(
            key_id=3, name="u key 3", note="n",
            details=wire.ApiKeyDetails(
                org_details=wire.ApiKeyOrgDetails(name="openrld"), user_details=wire.ApiKeyUserDetails(email=""),
            ),
        ),
        SelfApiKeyResponse,
        id="apikey-me",
    ),
]


def assert_kept(ours: Any, theirs: Any, where: str = "$") -> None:
    """Every value we wrote reads back unchanged from the SDK model's own JSON dump."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), where
        for key, value in ours.items():
            assert key in theirs, f"{where}.{key}"
            assert_kept(value, theirs[key], f"{where}.{key}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(theirs) == len(ours), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_kept(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


@pytest.mark.parametrize(("body", "sdk_type"), RESPONSES)
def test_response_validates_with_the_sdk_model_and_keeps_its_values(body: msgspec.Struct, sdk_type: type) -> None:
    parsed = as_sdk(body, sdk_type)
    assert_kept(json.loads(wire.encode_json(body)), parsed.model_dump(mode="json"))


@pytest.mark.parametrize(("body", "sdk_type"), RESPONSES)
def test_response_json_has_no_null_and_no_error_key_unless_failed(body: msgspec.Struct, sdk_type: type) -> None:
    encoded = json.loads(wire.encode_json(body))

    def walk(value: Any) -> None:
        assert value is not None
        if isinstance(value, dict):
            for child in value.values():
                walk(child)
        elif isinstance(value, list):
            for child in value:
                walk(child)

    walk(encoded)
    assert ("error" in encoded) == isinstance(body, wire.RequestFailedResponse)


def test_default_client_config_reads_as_the_sdk_defaults() -> None:
    assert wire.encode_json(wire.ClientConfigResponse()) == b"{}"
    assert as_sdk(wire.ClientConfigResponse(), sdk.ClientConfigResponse) == sdk.ClientConfigResponse()


def test_client_config_values_reach_the_sdk() -> None:
    parsed = as_sdk(wire.ClientConfigResponse(proto_compress_fwdbwd=True, fwdbwd_max_chunk_len=64), sdk.ClientConfigResponse)
    assert (parsed.proto_compress_fwdbwd, parsed.fwdbwd_max_chunk_len) == (True, 64)


def test_try_again_always_writes_type_and_queue_state() -> None:
    assert json.loads(wire.encode_json(wire.TryAgainResponse(request_id="r", queue_state="active"))) == {
        "type": "try_again", "request_id": "r", "queue_state": "active",
    }


def test_try_again_carries_the_queue_state_reason_the_sdk_reads_raw() -> None:
    # The SDK's retrieve loop reads queue_state_reason from the raw dict; its model lacks it.
    body = wire.TryAgainResponse(request_id="r", queue_state="paused_rate_limit", queue_state_reason="over quota")
    assert json.loads(wire.encode_json(body))["queue_state_reason"] == "over quota"


def test_acknowledgements_are_an_empty_object_which_the_sdk_reads_as_none() -> None:
    # publish, unpublish, TTL and project assignment: the SDK's RestClient casts their body to NoneType.
    from pathlib import Path

    from tinker.lib.public_interfaces import rest_client

    source = Path(rest_client.__file__).read_text()
    for route in ("/publish", "/ttl", "/project"):
        call = source[source.index(route):][:200]
        assert "cast_to=NoneType" in call, route
    assert msgspec.json.encode(wire.EmptyResponse()) == b"{}"


def test_metadata_only_response_has_the_status_the_sdk_classifies_on() -> None:
    assert json.loads(wire.encode_json(wire.MetadataOnlyResponse(response_payload_size=4096))) == {
        "status": "complete_metadata", "response_payload_size": 4096,
    }


def test_telemetry_response_is_exactly_accepted() -> None:
    assert json.loads(wire.encode_json(wire.TelemetryResponse())) == {"status": "accepted"}


def test_weights_info_keeps_a_false_is_lora_and_the_optimizer_config() -> None:
    info = wire.WeightsInfoResponse(base_model="m", is_lora=False, optimizer_config={"type": "adamw"})
    body = json.loads(wire.encode_json(info))
    assert body == {"base_model": "m", "is_lora": False, "optimizer_config": {"type": "adamw"}}


def test_get_info_optimizer_config_reaches_the_sdk() -> None:
    dimuon = {"type": "dimuon", "version": 1}
    body = wire.GetInfoResponse(model_data=wire.ModelData(), model_id="m", optimizer_config=dimuon)
    parsed = as_sdk(body, sdk.GetInfoResponse)
    assert (parsed.optimizer_config.type, parsed.optimizer_config.model_extra) == ("dimuon", {"version": 1})


def test_datetimes_are_written_as_rfc3339_with_timezone() -> None:
    encoded = json.loads(wire.encode_json(CHECKPOINT))
    assert encoded["time"] == "2026-03-04T05:06:07Z"
    assert as_sdk(CHECKPOINT, sdk.Checkpoint).time == CREATED


def test_billing_event_info_reaches_the_sdk_as_its_kind() -> None:
    parsed = as_sdk(BILLING_USAGE, sdk.BillingUsageResponse)
    infos = [event.event_info for event in parsed.data]
    assert [type(info).__name__ for info in infos] == [
        "TrainingBillingEvent", "SamplingPrefillBillingEvent", "SamplingSampleBillingEvent", "CheckpointBillingEvent",
    ]
    assert (infos[1].cached, infos[1].token_count, infos[3].count) == (False, 12, 2)


def test_naive_datetime_is_refused_where_the_response_is_built() -> None:
    with pytest.raises(ValueError, match=r"Checkpoint\.time must carry a timezone"):
        wire.Checkpoint(
            checkpoint_id="weights/a", checkpoint_type="training", time=datetime(2026, 1, 1),
            tinker_path="tinker://r/weights/a",
        )
