"""forward_backward and forward bodies in JSON (SDKs before 0.25) decode as their protobuf twins do."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openrld.api import forward_json, wire
from openrld.errors import BadRequest, NotSupportedYet

MAX_BODY_BYTES = 1 << 20
# What SDK 0.16.1 sends (model_dump(exclude_unset=True)): no chunk `type`, no loss_fn_config.
SDK_0_16_BODY = {
    "forward_backward_input": {
        "data": [
            {
                "loss_fn_inputs": {
                    "target_tokens": {"data": [6, 7, 8], "dtype": "int64", "shape": [3]},
                    "weights": {"data": [1.0, 0.5, 0.0], "dtype": "float32", "shape": [3]},
                },
                "model_input": {"chunks": [{"tokens": [5, 6, 7]}]},
            }
        ],
        "loss_fn": "cross_entropy",
    },
    "model_id": "m",
    "seq_id": 3,
}


def decode(body: dict, *, forward_only: bool = False):
    return forward_json.decode(json.dumps(body).encode(), None, forward_only=forward_only, max_body_bytes=MAX_BODY_BYTES)


def test_sdk_0_16_body_decodes_to_the_batch_its_protobuf_twin_does() -> None:
    model_id, seq_id, batch = decode(SDK_0_16_BODY)
    [datum] = batch.data
    assert (model_id, seq_id, batch.loss_fn, batch.forward_only) == ("m", 3, "cross_entropy", False)
    assert datum.tokens.tolist() == [5, 6, 7] and datum.tokens.dtype == np.int64
    assert datum.inputs["target_tokens"].tolist() == [6, 7, 8] and datum.inputs["target_tokens"].dtype == np.int64
    assert datum.inputs["weights"].tolist() == [1.0, 0.5, 0.0] and datum.inputs["weights"].dtype == np.float32


def test_forward_body_names_its_input_forward_input_and_runs_forward_only() -> None:
    body = {"forward_input": SDK_0_16_BODY["forward_backward_input"], "model_id": "m", "seq_id": 4}
    model_id, seq_id, batch = decode(body, forward_only=True)
    assert (model_id, seq_id, batch.forward_only) == ("m", 4, True)


def test_csr_tensor_expands_as_in_protobuf() -> None:
    body = json.loads(json.dumps(SDK_0_16_BODY))
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"] = {
        "data": [2.0], "dtype": "float32", "shape": [1, 3], "sparse_crow_indices": [0, 1], "sparse_col_indices": [2],
    }
    _, _, batch = decode(body)
    assert batch.data[0].inputs["weights"].tolist() == [[0.0, 0.0, 2.0]]


def test_fractional_value_in_an_int64_tensor_is_bad_request_naming_the_path() -> None:
    body = json.loads(json.dumps(SDK_0_16_BODY))
    body["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["data"] = [6, 7.5, 8]
    with pytest.raises(
        BadRequest, match=r"data\[0\]\.loss_fn_inputs\['target_tokens'\]\.data: int64 data must hold whole numbers"
    ):
        decode(body)


def test_image_chunk_is_not_supported_yet_naming_the_datum() -> None:
    body = json.loads(json.dumps(SDK_0_16_BODY))
    body["forward_backward_input"]["data"][0]["model_input"]["chunks"].append(
        {"type": "image", "data": "iVBORw==", "format": "png"}
    )
    with pytest.raises(NotSupportedYet, match=r"data\[0\]\.model_input\[1\]: image chunks are not supported yet"):
        decode(body)


def test_body_that_is_not_json_is_bad_request_naming_the_type() -> None:
    with pytest.raises(BadRequest, match=r"invalid ForwardBackwardJsonRequest body: not application/json"):
        forward_json.decode(b"\x0a\x01m", None, forward_only=False, max_body_bytes=MAX_BODY_BYTES)


def test_ids_of_a_refused_body_are_still_readable_so_its_seq_id_can_be_burned() -> None:
    body = json.loads(json.dumps(SDK_0_16_BODY))
    body["forward_backward_input"]["data"][0]["model_input"]["chunks"][0]["tokens"] = [-1]
    raw = json.dumps(body).encode()
    with pytest.raises(BadRequest):
        forward_json.decode(raw, None, forward_only=False, max_body_bytes=MAX_BODY_BYTES)
    assert forward_json.ids(raw, None, forward_only=False, max_body_bytes=MAX_BODY_BYTES) == ("m", 3)


def test_untyped_prompt_chunk_is_encoded_text() -> None:
    # SDK 0.16.1's sample request, as it sends it.
    body = b'{"num_samples": 1, "prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 3}, ' \
           b'"sampling_session_id": "x", "seq_id": 0}'
    request = wire.decode_json(body, wire.SampleRequest)
    assert [(c.type, c.tokens) for c in request.prompt.chunks] == [("encoded_text", [1, 2])]


def test_body_without_seq_id_is_refused_naming_it() -> None:
    body = {key: value for key, value in SDK_0_16_BODY.items() if key != "seq_id"}
    with pytest.raises(BadRequest, match=r"^forward_backward: seq_id is required$"):
        decode(body)


def test_seq_id_past_int32_is_bad_request_not_a_crash() -> None:
    with pytest.raises(BadRequest, match=r"^forward_backward: a value is out of range: Value out of range: 4294967296$"):
        decode({**SDK_0_16_BODY, "seq_id": 2**32})
