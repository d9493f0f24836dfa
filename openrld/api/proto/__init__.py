"""The protobuf half of the Tinker wire: the `tinker_public` schema and its codec.

`schema` builds the descriptor and message classes in a private pool; `codec`
turns forward_backward request bodies into engine batches and engine results
into the protobuf payloads retrieve_future serves. Nothing here imports torch
or the tinker SDK.
"""

from openrld.api.proto.codec import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    forward_backward_ids,
    forward_backward_model_id,
    forward_backward_seq_id,
)
from openrld.api.proto.schema import (
    ArrayRecord,
    BatchedTensor,
    Chunk,
    Datum,
    DmelChunk,
    DType,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    ImageChunk,
    ImageDimensions,
    LossConfigValue,
    PromptAltTokens,
    PromptProvenanceSpan,
    ProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SparseCsr,
    StopReason,
    StopStrings,
    StopTokens,
    Tensor,
    TopkLogprobs,
    build_file_descriptor_proto,
)

__all__ = [
    "ArrayRecord",
    "BatchedTensor",
    "Chunk",
    "DType",
    "Datum",
    "DmelChunk",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ForwardBackwardRequest",
    "ImageChunk",
    "ImageDimensions",
    "LossConfigValue",
    "PromptAltTokens",
    "PromptProvenanceSpan",
    "ProvenanceSpan",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingParams",
    "SparseCsr",
    "StopReason",
    "StopStrings",
    "StopTokens",
    "Tensor",
    "TopkLogprobs",
    "build_file_descriptor_proto",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
    "forward_backward_ids",
    "forward_backward_model_id",
    "forward_backward_seq_id",
]
