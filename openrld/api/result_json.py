"""forward_backward and sample results in JSON, for clients whose `Accept` asks for it.

SDK 0.16 reads every result as JSON (`Accept: application/json`), 0.18 to 0.20
ask for protobuf for sample results only, and 0.21 and later ask for protobuf
for both. This module holds the JSON form of those two results: the SDK's
`ForwardBackwardOutput` (per-datum `logprobs` as TensorData JSON) and
`SampleResponse` (tokens and logprobs as lists, `null` where the protobuf form
has NaN or the top-k sentinel), built from the same engine results the
protobuf encoder takes, so a client sees one result in either form.

Never: imports torch or the SDK, or does I/O.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from openrld.api.proto.codec import LOGPROBS_FIELD, OUTPUT_TYPE
from openrld.api.wire import ResponseBody
from openrld.batches import ForwardBackwardResult, SampleResult, TopK
from openrld.errors import ServerError

MASK_LOGPROB = -99999.0  # a top-k cell that holds no candidate (TopK's empty-cell value)
_STOP_REASONS = frozenset({"stop", "length"})


class TensorDataOut(ResponseBody, frozen=True):
    data: list[float]
    dtype: str  # "float32": logprobs are the one output tensor
    shape: list[int]


class ForwardBackwardOutputJson(ResponseBody, frozen=True):
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorDataOut]]
    metrics: dict[str, float]


class SampledSequenceJson(ResponseBody, frozen=True):
    stop_reason: str
    tokens: list[int]
    logprobs: list[float] | None = None


class SampleResponseJson(ResponseBody, tag_field="type", tag="sample", frozen=True):
    sequences: list[SampledSequenceJson]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


_encoder = msgspec.json.Encoder()


def encode_forward_backward_output(result: ForwardBackwardResult) -> bytes:
    """The JSON ForwardBackwardOutput of one forward_backward request.

    Raises:
        ServerError: a metric key is not `name:reduction`, or a value is not finite
            (JSON has no NaN, and the SDK's float fields refuse null).
    """
    outputs = []
    for i, logprobs in enumerate(result.logprobs):
        array = np.asarray(logprobs, dtype=np.float32)
        if array.ndim == 0:
            raise ServerError(f"logprobs of datum {i} is 0-d; expected shape (N,) or (N, K)")
        outputs.append({LOGPROBS_FIELD: TensorDataOut(_finite(f"logprobs of datum {i}", array), "float32", list(array.shape))})
    for key in result.metrics:
        if key.count(":") != 1:
            raise ServerError(f"metric key {key!r} must be 'name:reduction' with exactly one colon")
    metrics = {key: float(value) for key, value in result.metrics.items()}
    return _encoder.encode(ForwardBackwardOutputJson(OUTPUT_TYPE, outputs, metrics))


def encode_sample_response(result: SampleResult) -> bytes:
    """The JSON SampleResponse of one asample request.

    Raises:
        ServerError: a stop reason other than "stop"/"length", or tokens and
            logprobs of different lengths.
    """
    sequences = []
    for i, sequence in enumerate(result.sequences):
        if sequence.stop_reason not in _STOP_REASONS:
            raise ServerError(f"sequence {i}: stop_reason must be 'stop' or 'length', got {sequence.stop_reason!r}")
        if len(sequence.tokens) != len(sequence.logprobs):
            raise ServerError(f"sequence {i}: {len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs")
        sequences.append(
            SampledSequenceJson(
                stop_reason=sequence.stop_reason,
                tokens=np.asarray(sequence.tokens, dtype=np.int64).tolist(),
                logprobs=_finite(f"sequence {i} logprobs", np.asarray(sequence.logprobs, dtype=np.float32)),
            )
        )
    prompt = None
    if result.prompt_logprobs is not None:
        # NaN marks a position not scored (the first token): the SDK's list form has None there.
        prompt = [None if math.isnan(v) else v for v in np.asarray(result.prompt_logprobs, dtype=np.float32).tolist()]
    topk = _topk_lists(result.topk_prompt) if result.topk_prompt is not None else None
    return _encoder.encode(SampleResponseJson(sequences, prompt, topk))


def _topk_lists(topk: TopK) -> list[list[tuple[int, float]] | None]:
    """Per position, its (token_id, logprob) candidates without the trailing empty cells; None when it has none."""
    rows: list[list[tuple[int, float]] | None] = []
    for ids, logprobs in zip(topk.token_ids.tolist(), np.asarray(topk.logprobs, dtype=np.float32).tolist()):
        pairs = list(zip(ids, logprobs))
        while pairs and pairs[-1] == (0, MASK_LOGPROB):
            pairs.pop()
        rows.append(pairs or None)
    return rows


def _finite(where: str, array: np.ndarray) -> list[float]:
    # JSON has no infinities, and the SDK's float lists refuse null: a token the model gives
    # probability 0 (log -inf) goes out as the most negative float32, which reads the same in any loss.
    array = np.where(np.isneginf(array), np.finfo(np.float32).min, array)
    if not np.isfinite(array).all():
        raise ServerError(f"{where}: holds NaN or +inf, which JSON cannot carry")
    return array.ravel().tolist()
