"""forward_backward and sample results in JSON, the form SDK 0.16 reads (and 0.18 to 0.20 for forward_backward).

The SDK side of these bodies is checked end to end by tests/e2e/test_sdk_matrix.py,
where SDK 0.16.1 parses them with its own models; here, their exact contents.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from openrld.api import result_json
from openrld.batches import ForwardBackwardResult, SampledSequence, SampleResult, TopK
from openrld.errors import ServerError


def test_forward_backward_output_carries_each_datums_logprobs_as_tensor_data() -> None:
    result = ForwardBackwardResult(
        logprobs=[np.array([-0.5, -1.25], np.float32), np.array([[-1.0, -2.0]], np.float32)],
        metrics={"loss:sum": 3.5},
    )
    assert json.loads(result_json.encode_forward_backward_output(result)) == {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": {"data": [-0.5, -1.25], "dtype": "float32", "shape": [2]}},
            {"logprobs": {"data": [-1.0, -2.0], "dtype": "float32", "shape": [1, 2]}},
        ],
        "metrics": {"loss:sum": 3.5},
    }


def test_a_log_zero_goes_out_as_the_most_negative_float32() -> None:
    result = ForwardBackwardResult(logprobs=[np.array([-np.inf], np.float32)], metrics={})
    [output] = json.loads(result_json.encode_forward_backward_output(result))["loss_fn_outputs"]
    assert output["logprobs"]["data"] == [float(np.finfo(np.float32).min)]


def test_nan_logprob_is_a_server_error_not_a_null() -> None:
    with pytest.raises(ServerError, match=r"logprobs of datum 0: holds NaN or \+inf"):
        result_json.encode_forward_backward_output(ForwardBackwardResult(logprobs=[np.array([np.nan], np.float32)], metrics={}))


def test_sample_response_has_lists_with_none_where_the_prompt_was_not_scored() -> None:
    result = SampleResult(
        sequences=[SampledSequence(tokens=np.array([7, 8], np.int32), logprobs=np.array([-0.5, -0.25], np.float32), stop_reason="length")],
        prompt_logprobs=np.array([np.nan, -1.5], np.float32),
        topk_prompt=TopK(
            token_ids=np.array([[0, 0], [4, 0]], np.int32), logprobs=np.array([[-99999.0, -99999.0], [-0.5, -99999.0]], np.float32)
        ),
    )
    assert json.loads(result_json.encode_sample_response(result)) == {
        "type": "sample",
        "sequences": [{"stop_reason": "length", "tokens": [7, 8], "logprobs": [-0.5, -0.25]}],
        "prompt_logprobs": [None, -1.5],
        "topk_prompt_logprobs": [None, [[4, -0.5]]],
    }
