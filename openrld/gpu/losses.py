"""Tinker's built-in losses, as pure functions of the target log-probabilities.

This module owns three things, all as Tinker defines its losses:

- the loss functions. Each takes lp, the trainer's (differentiable) log-probabilities of
  the target tokens, plus the datum constants, and returns `(loss, metrics)`;
- `validate_request`, which checks a whole `forward_backward` request against the closed
  registry `LOSSES` before anything runs;
- `pack_inputs`, which lays the inputs of several datums end to end so that one call of
  a loss function covers a whole micro-batch.

Notation: for position i, lpᵢ is the trainer's log-probability of `target_tokens[i]`,
qᵢ = `logprobs[i]` (the sampler's), Aᵢ = `advantages[i]`, Δᵢ = lpᵢ − qᵢ, rᵢ = exp(Δᵢ), and
sg(·) is stop-gradient. Every loss is a plain sum over positions and datums, never a mean.

Packed layout: a loss function sees lp and its inputs flattened and concatenated over
the datums of a micro-batch, in datum order, row-major within a datum: shape (T,). Only
`gspo` couples positions, within one datum, so it also takes `segments` (T,) int64, the
datum index of each position (None means that all positions belong to one datum).

Guarantees:
- a position whose coefficient (weight or advantage) is exactly 0 contributes exactly 0
  to value and gradient, even next to ±inf: done with `torch.where`, and the
  masked positions' ratio inputs are zeroed too, so that no 0·inf reaches backward;
- every loss emits the same metric keys every time, all `name:sum`;
- the loss functions never validate: `validate_request` does, once, on the numpy inputs.

It never touches a model, a device lease or the gradient buffers; the trainer does.
`stable_reinforce` reads the sampler logprobs the server recorded (attached to each datum
by actors/stability.py before the request reaches the trainer); server-side `custom`
losses are refused with `NotSupportedYet`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import msgspec
import numpy as np
import torch

from openrld.batches import TrainDatum
from openrld.errors import BadRequest, NotSupportedYet

LossFn = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float], torch.Tensor | None],
    tuple[torch.Tensor, dict[str, float]],
]

# Keys of loss_fn_inputs that hold floats (everything but target_tokens).
FLOAT_INPUTS = frozenset(
    {"weights", "logprobs", "advantages", "clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask"}
)
THRESHOLD_KEYS = ("clip_low_threshold", "clip_high_threshold")


# ---------------------------------------------------------------- the losses


def cross_entropy(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −wᵢ·lpᵢ (or −Σₖ wᵢₖ·lpᵢₖ for (N, K) targets); ∂L/∂lpᵢ = −wᵢ.

    Args:
        lp: target log-probs, any shape; `inputs["weights"]` (optional, default 1) matches it.
    Returns:
        (L = Σ ℓ, {"loss:sum", "tokens:sum"}), tokens = number of non-zero weights.
    """
    weights = inputs.get("weights")
    w = torch.ones_like(lp) if weights is None else weights.to(lp.dtype)
    active = w != 0
    terms = torch.where(active, -w * lp, 0.0)
    loss = terms.sum()
    return loss, _metrics(loss, tokens=active.sum())


def importance_sampling(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −rᵢ·Aᵢ; ∂ℓᵢ/∂lpᵢ = −Aᵢ·rᵢ, nothing detached.

    Returns:
        (L, {"loss:sum", "tokens:sum"}), tokens = positions with Aᵢ ≠ 0.
    """
    advantages, active, ratio = _ratio(lp, inputs)
    terms = torch.where(active, -ratio * advantages, 0.0)
    loss = terms.sum()
    return loss, _metrics(loss, tokens=active.sum())


def ppo(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −min(rᵢAᵢ, clip(rᵢ, loᵢ, hiᵢ)·Aᵢ), defaults lo = 0.8, hi = 1.2.

    The gradient is −Aᵢrᵢ, or 0 where the clipped branch is strictly smaller: (A > 0 and
    r > hi) or (A < 0 and r < lo). Per-position `clip_*_threshold` inputs override config.

    Returns:
        (L, {"loss:sum", "tokens:sum", "clipped_tokens:sum"}).
    """
    advantages, active, ratio = _ratio(lp, inputs)
    lo, hi = _thresholds(lp, inputs, config, PPO_DEFAULTS)
    return _clipped_surrogate(ratio, advantages, active, lo, hi)


def cispo(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −sg(clip(rᵢ, loᵢ, hiᵢ))·lpᵢ·Aᵢ, defaults lo = 0.0, hi = 4.0.

    ∂ℓᵢ/∂lpᵢ = −clip(rᵢ)·Aᵢ: clipping bounds the coefficient and never zeroes a gradient.

    Returns:
        (L, {"loss:sum", "tokens:sum", "clipped_tokens:sum"}), clipped = positions whose
        ratio the clip changed.
    """
    advantages, active, ratio = _ratio(lp, inputs)
    lo, hi = _thresholds(lp, inputs, config, CISPO_DEFAULTS)
    coefficient = ratio.clamp(lo, hi).detach()
    terms = torch.where(active, -coefficient * lp * advantages, 0.0)
    loss = terms.sum()
    clipped = active & ((ratio < lo) | (ratio > hi))
    return loss, _metrics(loss, tokens=active.sum(), clipped_tokens=clipped.sum())


def dro(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −(lpᵢ·Aᵢ − ½·β·(lpᵢ − qᵢ)²), default β = 0.05.

    ∂ℓᵢ/∂lpᵢ = −Aᵢ + β·(lpᵢ − qᵢ). The quadratic term has no coefficient, so it applies at
    every position, prompt padding included, exactly as documented.

    Returns:
        (L, {"loss:sum", "tokens:sum"}), tokens = positions with Aᵢ ≠ 0.
    """
    beta = config.get("beta", DRO_DEFAULTS["beta"])
    advantages = inputs["advantages"].to(lp.dtype)
    sampled = inputs["logprobs"].to(lp.dtype)
    active = advantages != 0
    reward = torch.where(active, lp * advantages, 0.0)
    terms = -(reward - 0.5 * beta * (lp - sampled) ** 2)
    loss = terms.sum()
    return loss, _metrics(loss, tokens=active.sum())


def gspo(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: ℓᵢ = −min(sᵢAᵢ, clip(sᵢ, loᵢ, hiᵢ)·Aᵢ), defaults 0.8 / 1.2.

    Per datum d with M = {i : sequence_ratio_mask[i] ≠ 0}: S = mean_{i∈M}(sg(lpᵢ) − qᵢ),
    s = exp(S), and sᵢ = exp(S + lpᵢ − sg(lpᵢ)), whose value is s and whose gradient is s.
    The clip rule is PPO's with s for rᵢ.

    Args:
        segments: (T,) int64 datum index of each position; None means one datum.
    Returns:
        (L, {"loss:sum", "tokens:sum", "clipped_tokens:sum"}).
    """
    advantages = inputs["advantages"].to(lp.dtype)
    sampled = inputs["logprobs"].to(lp.dtype)
    in_ratio = inputs["sequence_ratio_mask"] != 0
    active = advantages != 0
    if segments is None:
        segments = torch.zeros(lp.shape, dtype=torch.int64, device=lp.device)
    # A buffer of T slots always has room for every datum index, and needs no host sync.
    log_ratio = torch.where(in_ratio, lp.detach() - sampled, 0.0)
    totals = torch.zeros_like(lp).index_add_(0, segments, log_ratio)
    counts = torch.zeros_like(lp).index_add_(0, segments, in_ratio.to(lp.dtype))
    sequence_log_ratio = (totals / counts)[segments]  # (T,): S of each position's datum
    # Where A = 0 the own-token term is zeroed so that lp = -inf there cannot make NaN.
    own_token = torch.where(active, lp - lp.detach(), 0.0)
    ratio = torch.exp(sequence_log_ratio + own_token)
    lo, hi = _thresholds(lp, inputs, config, GSPO_DEFAULTS)
    return _clipped_surrogate(ratio, advantages, active, lo, hi)


def stable_reinforce(
    lp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """openrld's proposal: CISPO with bounds [0, 4] on sampled tokens, driven by the
    server-recorded sampler logprobs q̂, plus κ times the k3 estimator of KL(q‖p).

    For i ∈ T (target positions under a SampledProvenanceSpan), with Δᵢ = lpᵢ − q̂ᵢ and
    rᵢ = exp(Δᵢ): ℓᵢ = −sg(min(rᵢ, 4))·Aᵢ·lpᵢ + κ·(rᵢ − 1 − Δᵢ); for i ∉ T, ℓᵢ = 0.
    ∂ℓᵢ/∂lpᵢ = −min(rᵢ, 4)·Aᵢ + κ·(rᵢ − 1). κ = `kl_coeff` (default 0).

    Args:
        inputs: `advantages`, and the server-attached `sampler_logprobs` (q̂, 0 off T) and
            `sampled_mask` (1 on T, 0 elsewhere); the client's `logprobs` is not used.
    Returns:
        (L, {"loss:sum", "tokens:sum" (= |T|), "kl:sum" (Σ_T rᵢ − 1 − Δᵢ), "clipped_tokens:sum"
        (positions of T with Aᵢ ≠ 0 and rᵢ > 4)}).
    """
    kl_coeff = config.get("kl_coeff", STABLE_REINFORCE_DEFAULTS["kl_coeff"])
    advantages = inputs["advantages"].to(lp.dtype)
    sampled = inputs["sampled_mask"] != 0
    # Δ is zeroed off T so that prompt positions (any lp, q̂ = 0) never reach exp or backward.
    delta = torch.where(sampled, lp - inputs["sampler_logprobs"].to(lp.dtype), 0.0)
    ratio = torch.exp(delta)
    active = sampled & (advantages != 0)
    policy = torch.where(active, -ratio.clamp(max=STABLE_REINFORCE_RATIO_CAP).detach() * advantages * lp, 0.0)
    kl = torch.where(sampled, ratio - 1 - delta, 0.0)
    loss = policy.sum() + kl_coeff * kl.sum() if kl_coeff != 0 else policy.sum()
    clipped = active & (ratio > STABLE_REINFORCE_RATIO_CAP)
    return loss, _metrics(loss, tokens=sampled.sum(), kl=kl.detach().sum(), clipped_tokens=clipped.sum())


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, A ≠ 0, r). Δ is zeroed where A = 0, so a huge or infinite Δ on a prompt position
    (for example a poor pad value of q) never turns into inf·0 = NaN in backward."""
    advantages = inputs["advantages"].to(lp.dtype)
    sampled = inputs["logprobs"].to(lp.dtype)
    active = advantages != 0
    ratio = torch.exp(torch.where(active, lp - sampled, 0.0))
    return advantages, active, ratio


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, active: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """ℓᵢ = −min(rᵢAᵢ, clip(rᵢ, loᵢ, hiᵢ)·Aᵢ) summed over the active positions, with the tokens
    whose clipped branch is strictly smaller counted (PPO's and GSPO's objective)."""
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)
    terms = torch.where(active, -surrogate, 0.0)
    loss = terms.sum()
    clipped = active & (((advantages > 0) & (ratio > hi)) | ((advantages < 0) & (ratio < lo)))
    return loss, _metrics(loss, tokens=active.sum(), clipped_tokens=clipped.sum())


def _thresholds(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float], defaults: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per position: the input where given, else the config value, else the default."""
    bounds = []
    for key in THRESHOLD_KEYS:
        per_position = inputs.get(key)
        if per_position is None:
            bounds.append(torch.full_like(lp, config.get(key, defaults[key])))
        else:
            bounds.append(per_position.to(lp.dtype))
    return bounds[0], bounds[1]


def _metrics(loss: torch.Tensor, **sums: torch.Tensor) -> dict[str, float]:
    """`loss:sum` plus `<name>:sum` for each extra, read back with one host sync."""
    values = torch.stack([loss.detach().to(torch.float64)] + [v.to(torch.float64) for v in sums.values()])
    keys = ["loss:sum"] + [f"{name}:sum" for name in sums]
    return dict(zip(keys, values.tolist()))


# ---------------------------------------------------------------- the registry


class LossSpec(msgspec.Struct, frozen=True):
    """What one loss accepts: its function, input keys, config keys and defaults."""

    fn: LossFn
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    config_defaults: dict[str, float]  # every accepted config key, with its default
    metric_keys: tuple[str, ...]
    allows_2d_targets: bool = False  # only cross_entropy scores K targets per position

    @property
    def allowed_inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


PPO_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
CISPO_DEFAULTS = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}  # the newest tutorial's one-sided clip
GSPO_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # PPO's
DRO_DEFAULTS = {"beta": 0.05}  # the docs' only example
STABLE_REINFORCE_DEFAULTS = {"kl_coeff": 0.0}  # no default is documented
STABLE_REINFORCE_RATIO_CAP = 4.0  # CISPO's default upper bound
# Inputs the server attaches to stable_reinforce datums from the stability records; a
# client cannot send them (they are not in any loss's allowed keys).
RECORDED_INPUTS = ("sampler_logprobs", "sampled_mask")

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_BASIC_METRICS = ("loss:sum", "tokens:sum")
_CLIP_METRICS = ("loss:sum", "tokens:sum", "clipped_tokens:sum")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(
        cross_entropy, ("target_tokens",), ("weights",), {}, _BASIC_METRICS, allows_2d_targets=True
    ),
    "importance_sampling": LossSpec(importance_sampling, _RL_INPUTS, (), {}, _BASIC_METRICS),
    "ppo": LossSpec(ppo, _RL_INPUTS, THRESHOLD_KEYS, PPO_DEFAULTS, _CLIP_METRICS),
    "cispo": LossSpec(cispo, _RL_INPUTS, THRESHOLD_KEYS, CISPO_DEFAULTS, _CLIP_METRICS),
    "dro": LossSpec(dro, _RL_INPUTS, (), DRO_DEFAULTS, _BASIC_METRICS),
    "gspo": LossSpec(gspo, _RL_INPUTS + ("sequence_ratio_mask",), THRESHOLD_KEYS, GSPO_DEFAULTS, _CLIP_METRICS),
    "stable_reinforce": LossSpec(
        stable_reinforce, ("target_tokens", "advantages"), ("logprobs",), STABLE_REINFORCE_DEFAULTS,
        ("loss:sum", "tokens:sum", "kl:sum", "clipped_tokens:sum"),
    ),
}

# Known Tinker losses that this server refuses, with the reason it gives.
NOT_SUPPORTED: dict[str, str] = {
    "custom": (
        "server-side custom losses are not supported by this server (loss_fn 'custom'); "
        "use forward_backward_custom with custom_loss_server_side=false"
    ),
}


def loss_spec(loss_fn: str) -> LossSpec:
    """The registry entry for `loss_fn`.

    Raises:
        NotSupportedYet: for `custom`.
        BadRequest: for any other unknown name, listing the supported ones.
    """
    spec = LOSSES.get(loss_fn)
    if spec is not None:
        return spec
    if loss_fn in NOT_SUPPORTED:
        raise NotSupportedYet(NOT_SUPPORTED[loss_fn], key="loss_fn")
    raise BadRequest(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(LOSSES)}", key="loss_fn")


# ---------------------------------------------------------------- validation


class CheckedRequest(msgspec.Struct, frozen=True):
    """A request that passed `validate_request`: inputs normalised to int64 / float32."""

    loss_fn: str
    spec: LossSpec
    config: dict[str, float]  # every accepted key, defaults filled in
    inputs: list[dict[str, np.ndarray]]  # per datum, the datum's loss_fn_inputs


def validate_request(
    loss_fn: str, data: Sequence[TrainDatum], config: Mapping[str, float | str], *, vocab_size: int
) -> CheckedRequest:
    """Check a whole request against the losses' input rules before anything is computed.

    Each datum's N is `len(datum.tokens)`; the caller has checked the model input itself.

    Returns:
        The request with `target_tokens` as int64 and float inputs as float32.
    Raises:
        NotSupportedYet: `custom`.
        BadRequest: unknown loss; empty data; a missing or unknown input key; a shape
            other than (N,) (or (N, K) for cross_entropy targets, with weights alike); a
            target id outside [0, vocab_size); a non-finite or non-numeric float input;
            an unknown config key, a text or non-finite config value; thresholds with
            lo < 0 or lo > hi, or β < 0; a gspo mask that marks no position. The message
            names the datum index, the key, what was expected and what was received.
    """
    spec = loss_spec(loss_fn)
    resolved = _resolve_config(loss_fn, spec, config)
    if not data:
        raise BadRequest(f"forward_backward needs at least one datum; got none for loss {loss_fn!r}", key="data")
    checked = [_check_datum(index, datum, loss_fn, spec, resolved, vocab_size) for index, datum in enumerate(data)]
    return CheckedRequest(loss_fn=loss_fn, spec=spec, config=resolved, inputs=checked)


def _resolve_config(loss_fn: str, spec: LossSpec, config: Mapping[str, float | str]) -> dict[str, float]:
    resolved = dict(spec.config_defaults)
    for key, value in config.items():
        if key not in spec.config_defaults:
            accepted = ", ".join(spec.config_defaults) if spec.config_defaults else "none"
            raise BadRequest(
                f"loss_fn_config key {key!r} is not accepted by loss {loss_fn!r}; accepted keys: {accepted}", key=key
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"loss_fn_config[{key!r}] must be a number for loss {loss_fn!r}; got {value!r}", key=key)
        if not math.isfinite(value):
            raise BadRequest(f"loss_fn_config[{key!r}] must be finite for loss {loss_fn!r}; got {value!r}", key=key)
        resolved[key] = float(value)
    if "kl_coeff" in resolved and resolved["kl_coeff"] < 0:
        raise BadRequest(
            f"loss_fn_config['kl_coeff'] must be >= 0 for loss {loss_fn!r}; got {resolved['kl_coeff']!r}",
            key="kl_coeff",
        )
    if "beta" in resolved and resolved["beta"] < 0:
        raise BadRequest(
            f"loss_fn_config['beta'] must be >= 0 for loss {loss_fn!r}; got {resolved['beta']!r}", key="beta"
        )
    if "clip_low_threshold" in resolved:
        lo, hi = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if lo < 0:
            raise BadRequest(
                f"loss_fn_config['clip_low_threshold'] must be >= 0 for loss {loss_fn!r}; got {lo!r}",
                key="clip_low_threshold",
            )
        if lo > hi:
            raise BadRequest(
                f"clip_low_threshold {lo!r} > clip_high_threshold {hi!r} in loss_fn_config for loss {loss_fn!r}",
                key="clip_low_threshold",
            )
    return resolved


def _check_datum(
    index: int, datum: TrainDatum, loss_fn: str, spec: LossSpec, config: Mapping[str, float], vocab_size: int
) -> dict[str, np.ndarray]:
    where = f"datum {index}"
    n = len(datum.tokens)
    for key in spec.required_inputs:
        if key not in datum.inputs:
            raise BadRequest(
                f"{where}: loss_fn_inputs is missing {key!r}, which loss {loss_fn!r} requires "
                f"(required: {', '.join(spec.required_inputs)})",
                key=key,
            )
    for key in datum.inputs:
        if key not in spec.allowed_inputs:
            raise BadRequest(
                f"{where}: loss_fn_inputs[{key!r}] is not accepted by loss {loss_fn!r}; "
                f"allowed keys: {', '.join(spec.allowed_inputs)}",
                key=key,
            )
    targets = _as_token_ids(where, datum.inputs["target_tokens"], loss_fn)
    is_2d = spec.allows_2d_targets and targets.ndim == 2 and targets.shape[1] > 0
    if targets.shape[:1] != (n,) or not (targets.ndim == 1 or is_2d):
        expected = f"[{n}] or [{n}, K]" if spec.allows_2d_targets else f"[{n}]"
        _shape_error(where, "target_tokens", targets.shape, f"{expected} (model_input length)", loss_fn)
    if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
        bad = int(np.flatnonzero((targets.reshape(-1) < 0) | (targets.reshape(-1) >= vocab_size))[0])
        position = _position(targets.shape, bad)
        raise BadRequest(
            f"{where}: loss_fn_inputs['target_tokens'] has token id {int(targets.reshape(-1)[bad])} at position "
            f"{position}; expected ids in [0, {vocab_size}) for loss {loss_fn!r}",
            key="target_tokens",
        )
    checked: dict[str, np.ndarray] = {"target_tokens": targets}
    for key, raw in datum.inputs.items():
        if key == "target_tokens":
            continue
        values = _as_floats(where, key, raw, loss_fn)
        expected_shape = targets.shape if key == "weights" else (n,)
        if values.shape != expected_shape:
            reason = "the shape of target_tokens" if key == "weights" else "model_input length"
            _shape_error(where, key, values.shape, f"{list(expected_shape)} ({reason})", loss_fn)
        if not np.isfinite(values).all():
            bad = int(np.flatnonzero(~np.isfinite(values.reshape(-1)))[0])
            raise BadRequest(
                f"{where}: loss_fn_inputs[{key!r}] has a non-finite value ({_shown(values.reshape(-1)[bad])}) "
                f"at position {_position(values.shape, bad)} for loss {loss_fn!r}",
                key=key,
            )
        checked[key] = values
    if "clip_low_threshold" in spec.allowed_inputs:
        _check_thresholds(where, checked, config, n, loss_fn)
    if loss_fn == "stable_reinforce":
        checked.update(_recorded_inputs(where, datum, n))
    if "sequence_ratio_mask" in checked and not (checked["sequence_ratio_mask"] != 0).any():
        raise BadRequest(
            f"{where}: loss_fn_inputs['sequence_ratio_mask'] marks no position; loss {loss_fn!r} needs at least one",
            key="sequence_ratio_mask",
        )
    return checked


def _recorded_inputs(where: str, datum: TrainDatum, n: int) -> dict[str, np.ndarray]:
    """q̂ and the sampled-position mask from the records the server attached (actors/stability.py)."""
    recorded = datum.recorded_logprobs
    if recorded is None or recorded.shape != (n,):
        raise BadRequest(
            f"{where}: stable_reinforce needs provenance on every datum (model_input_spans and "
            "loss_fn_input_spans naming sequences sampled with record_stability_info=True)",
            key="loss_fn_input_spans",
        )
    sampled = ~np.isnan(recorded)
    return {
        "sampler_logprobs": np.where(sampled, recorded, 0.0).astype(np.float32),
        "sampled_mask": sampled.astype(np.float32),
    }


def _check_thresholds(
    where: str, checked: Mapping[str, np.ndarray], config: Mapping[str, float], n: int, loss_fn: str
) -> None:
    lo = checked.get("clip_low_threshold", np.full(n, config["clip_low_threshold"]))
    hi = checked.get("clip_high_threshold", np.full(n, config["clip_high_threshold"]))
    if (lo < 0).any():
        i = int(np.flatnonzero(lo < 0)[0])
        raise BadRequest(
            f"{where}: clip_low_threshold must be >= 0; got {_shown(lo[i])} at position {i} for loss {loss_fn!r}",
            key="clip_low_threshold",
        )
    if (lo > hi).any():
        i = int(np.flatnonzero(lo > hi)[0])
        raise BadRequest(
            f"{where}: clip_low_threshold {_shown(lo[i])} > clip_high_threshold {_shown(hi[i])} "
            f"at position {i} for loss {loss_fn!r}",
            key="clip_low_threshold",
        )


def _as_token_ids(where: str, raw: np.ndarray, loss_fn: str) -> np.ndarray:
    """int64 ids; float arrays are accepted only when every value is integral."""
    values = np.asarray(raw)
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    if values.dtype.kind == "f":
        flat = values.reshape(-1)
        bad = ~np.isfinite(flat) | (flat != np.round(flat))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise BadRequest(
                f"{where}: loss_fn_inputs['target_tokens'] has non-integral value {_shown(flat[i])} at position "
                f"{_position(values.shape, i)}; expected token ids for loss {loss_fn!r}",
                key="target_tokens",
            )
        return values.astype(np.int64)
    raise BadRequest(
        f"{where}: loss_fn_inputs['target_tokens'] has dtype {values.dtype}; expected integers for loss {loss_fn!r}",
        key="target_tokens",
    )


def _as_floats(where: str, key: str, raw: np.ndarray, loss_fn: str) -> np.ndarray:
    """float32; integer arrays are widened (Tinker's dtype leniency), anything else refused."""
    values = np.asarray(raw)
    if values.dtype.kind not in "iuf":
        raise BadRequest(
            f"{where}: loss_fn_inputs[{key!r}] has dtype {values.dtype}; expected floats for loss {loss_fn!r}", key=key
        )
    return values.astype(np.float32, copy=False)


def _shape_error(where: str, key: str, shape: tuple[int, ...], expected: str, loss_fn: str) -> NoReturn:
    raise BadRequest(
        f"{where}: loss_fn_inputs[{key!r}] has shape {list(shape)}; expected {expected} for loss {loss_fn!r}", key=key
    )


def _shown(value: float) -> str:
    """A float32 input as the client wrote it: 1.3, not 1.2999999523162842."""
    return f"{float(value):.7g}"


def _position(shape: tuple[int, ...], flat_index: int) -> int | tuple[int, ...]:
    """A flat index as the user would write it: i for 1-D, (i, k) for 2-D."""
    if len(shape) == 1:
        return flat_index
    return tuple(int(i) for i in np.unravel_index(flat_index, shape))


def check_finite_loss(loss: torch.Tensor, loss_fn: str) -> float:
    """The loss value, or a user error if it is NaN or ±inf, before any backward.

    Raises:
        BadRequest: "loss for 'ppo' is not finite (inf); no gradient was applied ...".
    """
    value = float(loss.detach())
    if not math.isfinite(value):
        raise BadRequest(
            f"loss for {loss_fn!r} is not finite ({value}); no gradient was applied "
            "(for ratio losses, a large lp - logprobs with a non-zero advantage overflows exp)",
            key="loss_fn_inputs",
        )
    return value


# ---------------------------------------------------------------- packing


class PackedInputs(msgspec.Struct, frozen=True):
    """The float inputs of some datums, flattened and laid end to end (the packed layout)."""

    inputs: dict[str, torch.Tensor]  # key -> (T,) float32
    segments: torch.Tensor  # (T,) int64: index of each position's datum within the pack


def pack_inputs(request: CheckedRequest, datum_indices: Sequence[int], device: torch.device) -> PackedInputs:
    """Lay out the float inputs of `datum_indices`, in that order, for one loss call.

    An optional key present on only some datums is filled on the others with what the loss
    would use without it: weight 1, or the resolved config threshold. `target_tokens` is not
    packed: the trainer turns it into lp.
    """
    per_datum = [request.inputs[i] for i in datum_indices]
    sizes = [int(d["target_tokens"].size) for d in per_datum]
    keys = sorted({key for d in per_datum for key in d if key != "target_tokens"})
    packed: dict[str, torch.Tensor] = {}
    for key in keys:
        fill = 1.0 if key == "weights" else request.config.get(key, 0.0)
        parts = [
            d[key].reshape(-1) if key in d else np.full(size, fill, np.float32) for d, size in zip(per_datum, sizes)
        ]
        packed[key] = torch.from_numpy(np.concatenate(parts)).to(device)
    segments = torch.from_numpy(np.repeat(np.arange(len(per_datum), dtype=np.int64), sizes)).to(device)
    return PackedInputs(inputs=packed, segments=segments)
