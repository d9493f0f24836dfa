"""vLLM's output types as the vLLM tests build them, and the sample job they share.

vLLM is not installed here (it needs CUDA). These dataclasses carry the fields of
vllm.outputs.RequestOutput / CompletionOutput and vllm.logprobs.Logprob, the edge
the mapping and the engine glue read; test_vllm_mapping.py and test_vllm_sampler.py
both build their fakes from them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from openrld.batches import SampleJob, SamplingSpec

VOCAB = 384
EOS = 0
PROMPT = np.array([5, 6, 7, 8], np.int64)


@dataclasses.dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class Completion:  # vllm.outputs.CompletionOutput
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    index: int = 0
    text: str = ""
    stop_reason: int | str | None = None  # the stop id or string that ended it; None for EOS or length


@dataclasses.dataclass
class Output:  # vllm.outputs.RequestOutput
    request_id: str
    outputs: list[Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = 0
    finished: bool = True


def job(num_samples: int = 1, **kwargs: object) -> SampleJob:
    params = {k: kwargs.pop(k) for k in list(kwargs) if k in SamplingSpec.__struct_fields__}
    return SampleJob(prompt=PROMPT, num_samples=num_samples, params=SamplingSpec(**params), **kwargs)  # type: ignore[arg-type]
