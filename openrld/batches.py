"""The plain data that crosses from the API and the actors to the engines.

Arrays here are numpy, never torch, so that `api/` can build these and
`actors/` can carry them without importing torch; `gpu/` turns them into
tensors. Every struct is a frozen msgspec Struct. Shapes follow the Tinker
conventions of its losses: position i of a datum's `tokens`
predicts `inputs["target_tokens"][i]`, and the server never shifts.
"""

from __future__ import annotations

import msgspec
import numpy as np


class LoraSpec(msgspec.Struct, frozen=True):
    """How a LoRA adapter is shaped: the fields of the SDK's LoraConfig."""

    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class ProvenanceSpan(msgspec.Struct, frozen=True):
    """One run of a datum's provenance: positions [offset, offset+length)
    of sequence `sequence_id`'s request prompt (`is_sampled` False) or sampled tokens (True)."""

    sequence_id: str
    offset: int
    length: int
    is_sampled: bool


class TrainDatum(msgspec.Struct, frozen=True):
    tokens: np.ndarray  # int64 (N,): the model input
    inputs: dict[str, np.ndarray]  # loss_fn_inputs: target_tokens int64, floats float32; (N,) or (N, K)
    # Provenance as the client sent it (both or neither); only stable_reinforce reads it.
    model_input_spans: tuple[ProvenanceSpan, ...] | None = None
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = None
    # Set by the server only (actors/stability.py), never decoded from a body: per target
    # position, the recorded sampler logprob (log q_T) under a SampledProvenanceSpan, NaN elsewhere.
    recorded_logprobs: np.ndarray | None = None  # float32 (N,)


class ForwardBackwardBatch(msgspec.Struct, frozen=True):
    data: list[TrainDatum]
    loss_fn: str
    loss_config: dict[str, float | str]
    forward_only: bool


class ForwardBackwardResult(msgspec.Struct, frozen=True):
    logprobs: list[np.ndarray]  # float32, per datum, the shape of its target_tokens
    metrics: dict[str, float]  # "name:reduction" -> value


class AdamParams(msgspec.Struct, frozen=True):
    """The six AdamParams fields of SDK 0.38.0, with its defaults."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class DimuonParams(msgspec.Struct, frozen=True):
    """DimuonParams of SDK 0.38.0 plus the two fields SDK 0.29.1 sends."""

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


# One optim_step's hyperparameters; the type says the family (adamw or dimuon).
OptimParams = AdamParams | DimuonParams


class OptimResult(msgspec.Struct, frozen=True):
    metrics: dict[str, float]


class SamplingSpec(msgspec.Struct, frozen=True):
    """SamplingParams, normalised: `stop` split into strings and token ids."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True  # False when the client sent stop=[]


class SampleJob(msgspec.Struct, frozen=True):
    prompt: np.ndarray  # int64 (P,)
    num_samples: int
    params: SamplingSpec
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


class TopK(msgspec.Struct, frozen=True):
    token_ids: np.ndarray  # int32 (L, K); empty cells hold token 0
    logprobs: np.ndarray  # float32 (L, K); empty cells hold -99999.0


class SampledSequence(msgspec.Struct, frozen=True):
    tokens: np.ndarray  # int32 (T,), including a stop token or the tokens that complete a stop string
    logprobs: np.ndarray  # float32 (T,): log q_T of each sampled token
    stop_reason: str  # "stop" or "length"
    topk: TopK | None = None


class SampleResult(msgspec.Struct, frozen=True):
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None  # float32 (P,), NaN where not scored (always position 0)
    topk_prompt: TopK | None = None
    prompt_cache_hit_tokens: int = 0


class SyncStats(msgspec.Struct, frozen=True):
    """One weight sync of a full fine-tuning job, trainer to sampler (gpu/delta.py), as the
    trainer and sampler statistics (and the model status API) report it."""

    mode: str  # "delta" or "full"
    changed_fraction: float  # changed elements / all elements
    bytes_moved: int  # indices + values actually sent
    full_bytes: int  # what sending every tensor would move
    dense_tensors: int  # tensors sent whole (all of them under "full")
    compute_s: float  # trainer side: comparing, gathering and the digest
    apply_s: float = 0.0  # sampler side: patching in place and the digest check
