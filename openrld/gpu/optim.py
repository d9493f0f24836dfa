"""AdamW exactly as Tinker applies it (`shared/spec/optimizers.md` §2–§3).

`AdamW` owns the optimizer state of one set of named tensors (one LoRA adapter): per tensor
the first and second moments m, v (fp32 or wider) and an integer step count t. It reads
and clears the tensors' accumulated `.grad`; it never computes a gradient.

Guarantees, per `step`:
- hyperparameters come from that call's `AdamParams` alone; nothing carries over, and the
  bias correction uses this step's β₁, β₂;
- values are checked first: an invalid one is a `BadRequest` and nothing changes, not
  even the accumulated gradient;
- the global gradient norm is taken over every tensor that has a gradient, in fp32 (fp64
  for fp64 tensors). If it is NaN or inf the gradient is discarded and the step fails
  with a `BadRequest`;
- clipping is torch's `clip_grad_norm_` (factor min(1, c / (n + 1e-6))), before the moments;
- decoupled decay comes first, then the moments and the update, as `torch.optim.AdamW`
  (foreach=False) does, so the two agree to float rounding;
- a tensor without a gradient is skipped (no decay, no moment update, t unchanged), and a
  step with no gradient at all is a no-op that still returns metrics.

The state exports to, and imports from, a flat `dict[str, torch.Tensor]` (for safetensors),
so a resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from openrld.batches import AdamParams
from openrld.errors import BadRequest

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: n + 1e-6 keeps the factor finite at n = 0

# Suffixes of the flat state keys: "<tensor name>.<suffix>".
EXP_AVG, EXP_AVG_SQ, STEP = "exp_avg", "exp_avg_sq", "step"


def validate_adam_params(params: AdamParams) -> None:
    """Raise BadRequest naming the first field that is non-finite or out of range (§2).

    grad_clip_norm ≤ 0 means "no clipping" and is valid.
    """
    for field in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"adam_params.{field} must be a finite number; got {value!r}", key=field)
    for field in ("learning_rate", "eps", "weight_decay"):
        value = getattr(params, field)
        if value < 0:
            raise BadRequest(f"adam_params.{field} must be >= 0; got {value!r}", key=field)
    for field in ("beta1", "beta2"):
        value = getattr(params, field)
        if not 0 <= value < 1:
            raise BadRequest(f"adam_params.{field} must be in [0, 1); got {value!r}", key=field)


class _Moments:
    """One tensor's state: m, v and t."""

    __slots__ = ("exp_avg", "exp_avg_sq", "step")

    def __init__(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.step = step


class AdamW:
    """Decoupled-weight-decay Adam over a fixed set of named tensors."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        """Args:
        params: name -> leaf tensor that receives gradients; the names key the exported state.
        """
        self._params = dict(params)
        self._state: dict[str, _Moments] = {}

    @property
    def steps_done(self) -> int:
        """The largest per-tensor step count (for LoRA every tensor steps together)."""
        return max((moments.step for moments in self._state.values()), default=0)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients ("none", not zeros, as torch does)."""
        for param in self._params.values():
            param.grad = None

    def reset(self) -> None:
        """Forget m, v and t: the next step is a first step."""
        self._state.clear()

    def step(self, params: AdamParams) -> dict[str, float]:
        """Apply one AdamW step with the accumulated gradients, then clear them.

        Returns:
            {"grad_norm:mean": pre-clip global norm (0.0 without gradients),
             "learning_rate:mean": the learning rate used}.
        Raises:
            BadRequest: invalid `params` (gradients kept), or a non-finite gradient norm
                (gradients discarded, nothing updated): "non-finite gradient norm (check loss inputs)".
        """
        validate_adam_params(params)
        named = [(name, p) for name, p in self._params.items() if p.grad is not None]
        metrics = {"grad_norm:mean": 0.0, "learning_rate:mean": float(params.learning_rate)}
        if not named:
            return metrics
        grads = [p.grad.to(_state_dtype(p)) for _, p in named]
        # Per tensor, then over the tensors, as clip_grad_norm_ does; in the state dtype (fp32 or wider).
        norms = [torch.linalg.vector_norm(g, 2) for g in grads]
        dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms])
        norm = torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), 2)
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            self.zero_grad()
            raise BadRequest("non-finite gradient norm (check loss inputs)", key="grad_norm")
        metrics["grad_norm:mean"] = grad_norm
        if params.grad_clip_norm > 0:
            factor = torch.clamp(params.grad_clip_norm / (norm + CLIP_EPS), max=1.0)
            grads = [g * factor.to(g.dtype) for g in grads]
        with torch.no_grad():
            for (name, param), grad in zip(named, grads):
                self._update(name, param, grad, params)
        self.zero_grad()
        return metrics

    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor, hp: AdamParams) -> None:
        """One tensor's step: t += 1, decay, moments, bias-corrected update (§3.2 step 3)."""
        moments = self._state.get(name)
        if moments is None:
            moments = _Moments(torch.zeros_like(grad), torch.zeros_like(grad), 0)
            self._state[name] = moments
        moments.step += 1
        # Work in the state dtype; for fp32 parameters `work` is the parameter itself.
        work = param if param.dtype == grad.dtype else param.to(grad.dtype)
        work.mul_(1 - hp.learning_rate * hp.weight_decay)
        moments.exp_avg.lerp_(grad, 1 - hp.beta1)  # m = β1·m + (1 - β1)·g
        moments.exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
        bias_correction1 = 1 - hp.beta1**moments.step
        bias_correction2 = 1 - hp.beta2**moments.step
        denominator = (moments.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(hp.eps)
        work.addcdiv_(moments.exp_avg, denominator, value=-hp.learning_rate / bias_correction1)
        if work is not param:
            param.copy_(work)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as detached CPU clones: "<name>.exp_avg", "<name>.exp_avg_sq" and
        "<name>.step" (0-d int64) for every tensor that has stepped."""
        flat: dict[str, torch.Tensor] = {}
        for name, moments in self._state.items():
            flat[f"{name}.{EXP_AVG}"] = moments.exp_avg.detach().cpu().clone()
            flat[f"{name}.{EXP_AVG_SQ}"] = moments.exp_avg_sq.detach().cpu().clone()
            flat[f"{name}.{STEP}"] = torch.tensor(moments.step, dtype=torch.int64)
        return flat

    def load_state_tensors(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Replace the state with `flat` (the format of `state_tensors`); tensors absent from
        it start fresh. Everything is checked before anything changes.

        Raises:
            BadRequest: an unknown key, an incomplete triple, a shape that differs from the
                tensor's, or a negative step.
        """
        expected = {f"{name}.{suffix}" for name in self._params for suffix in (EXP_AVG, EXP_AVG_SQ, STEP)}
        unknown = sorted(set(flat) - expected)
        if unknown:
            raise BadRequest(f"optimizer state has unknown tensors {unknown[:3]}; it belongs to another model shape")
        state: dict[str, _Moments] = {}
        for name, param in self._params.items():
            keys = [f"{name}.{suffix}" for suffix in (EXP_AVG, EXP_AVG_SQ, STEP)]
            present = [key in flat for key in keys]
            if not any(present):
                continue
            if not all(present):
                missing = [key for key, there in zip(keys, present) if not there]
                raise BadRequest(f"optimizer state for {name!r} is incomplete: missing {missing}")
            exp_avg, exp_avg_sq, step = (flat[key] for key in keys)
            for key, tensor in ((keys[0], exp_avg), (keys[1], exp_avg_sq)):
                if tuple(tensor.shape) != tuple(param.shape):
                    raise BadRequest(
                        f"optimizer state {key!r} has shape {list(tensor.shape)}; expected {list(param.shape)}"
                    )
            if step.numel() != 1 or int(step) < 0:
                raise BadRequest(f"optimizer state {keys[2]!r} must be one count >= 0; got {step.tolist()}")
            dtype = _state_dtype(param)
            state[name] = _Moments(
                exp_avg.to(device=param.device, dtype=dtype).clone(),
                exp_avg_sq.to(device=param.device, dtype=dtype).clone(),
                int(step),
            )
        self._state = state


def _state_dtype(param: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower parameters (the spec's precision rule); fp64 stays fp64."""
    return torch.promote_types(param.dtype, torch.float32)
