"""AdamW exactly as Tinker applies it (the SDK's `AdamParams`: bias-corrected,
decoupled weight decay), and Dimuon v1
(openrld's own, labelled as such): its reference implementation is `Dimuon` below.

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
  the gradients are widened to the state dtype one tensor at a time, as each is applied, so a
  step never holds an fp32 copy of every gradient at once;
- a parameter narrower than fp32 (bf16 weights on a GPU) is trained through an fp32 master
  copy that the optimizer keeps with its moments: the update is applied to the master and the
  parameter receives it rounded, so steps smaller than a bf16 rounding step accumulate instead
  of being lost, and a bf16 run follows the fp32 run's arithmetic;
- decoupled decay comes first, then the moments and the update, as `torch.optim.AdamW`
  (foreach=False) does, so the two agree to float rounding;
- a tensor without a gradient is skipped (no decay, no moment update, t unchanged), and a
  step with no gradient at all is a no-op that still returns metrics.

The state exports to, and imports from, a flat `dict[str, torch.Tensor]` (for safetensors),
so a resumed run continues exactly as an uninterrupted one would.

`Dimuon` keeps the same contract (validation first, the same global norm and clipping, the
same metrics, gradients kept on invalid params, dropped on a non-finite norm); its state is
one momentum per matrix and a step count. What the two keep alike (the named tensors, the
per-tensor step counts, clearing gradients, and a step's norm, clipping and order) is
written once, in `_PerTensorOptimizer`. `optimizer_for` builds either by family name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

import torch

from openrld.batches import AdamParams, DimuonParams, OptimParams
from openrld.errors import BadRequest

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: n + 1e-6 keeps the factor finite at n = 0

# Suffixes of the flat state keys: "<tensor name>.<suffix>".
EXP_AVG, EXP_AVG_SQ, STEP = "exp_avg", "exp_avg_sq", "step"
MASTER = "master"  # the fp32 master copy of a parameter narrower than fp32 (optional in a checkpoint)
MOMENTUM = "momentum"

OPTIMIZER_FAMILIES = ("adamw", "dimuon")

# Dimuon v1's internal constants: quintic Newton–Schulz coefficients, step count,
# the normalisation epsilon, and the rank that the learning-rate correction refers to.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
DIMUON_EPS = 1e-7
DIMUON_REFERENCE_RANK = 32


def validate_adam_params(params: AdamParams) -> None:
    """Raise BadRequest naming the first field that is non-finite or out of range.

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
    """One tensor's state: m, v and t, and the fp32 master copy of a narrower parameter."""

    __slots__ = ("exp_avg", "exp_avg_sq", "step", "master")

    def __init__(
        self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, master: torch.Tensor | None = None
    ) -> None:
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.step = step
        self.master = master  # None: the parameter is in the state dtype and is its own master


class _TensorState(Protocol):
    step: int  # t: the steps this tensor has taken


_StateT = TypeVar("_StateT", bound=_TensorState)

# One tensor's update once its gradient is clipped: (name, parameter, gradient in the state dtype).
_TensorUpdate = Callable[[str, torch.Tensor, torch.Tensor], None]


class _PerTensorOptimizer(Generic[_StateT]):
    """What AdamW and Dimuon keep alike: a fixed set of named leaf tensors, a state per
    tensor that has stepped (with its step count), and the story of a step, so that both
    families clear gradients, count steps and clip the same way.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        """Args:
        params: name -> leaf tensor that receives gradients; the names key the exported state.
        """
        self._params = dict(params)
        self._state: dict[str, _StateT] = {}

    @property
    def steps_done(self) -> int:
        """The largest per-tensor step count (for LoRA every tensor steps together)."""
        return max((state.step for state in self._state.values()), default=0)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients ("none", not zeros, as torch does)."""
        for param in self._params.values():
            param.grad = None

    def reset(self) -> None:
        """Forget every tensor's state: the next step is a first step."""
        self._state.clear()

    def _step(self, params: OptimParams, update: _TensorUpdate) -> dict[str, float]:
        """A step with the accumulated gradients of already validated `params`, then clear them:
        the global norm and the clipping factor, then `update` of each tensor
        that has a gradient, with its clipped gradient. Returns the metrics and raises the
        non-finite norm as `AdamW.step` says."""
        named = [(name, p) for name, p in self._params.items() if p.grad is not None]
        metrics = {"grad_norm:mean": 0.0, "learning_rate:mean": float(params.learning_rate)}
        if not named:
            return metrics
        try:
            factor, metrics["grad_norm:mean"] = _clip_factor(named, params.grad_clip_norm)
        except BadRequest:
            self.zero_grad()
            raise
        with torch.no_grad():
            for name, param in named:
                update(name, param, _clipped(param, factor))
                param.grad = None  # this tensor's gradient is spent: its memory goes now, not after the loop
        self.zero_grad()
        return metrics

    def _refuse_unknown(self, flat: Mapping[str, torch.Tensor], suffixes: tuple[str, ...], why: str) -> None:
        """Raise BadRequest, saying `why`, if `flat` holds a key other than "<tensor name>.<suffix>"."""
        expected = {f"{name}.{suffix}" for name in self._params for suffix in suffixes}
        unknown = sorted(set(flat) - expected)
        if unknown:
            raise BadRequest(f"optimizer state has unknown tensors {unknown[:3]}; {why}")


def _check_stored(key: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """Raise BadRequest if the stored state tensor `key` has another shape than its parameter."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise BadRequest(f"optimizer state {key!r} has shape {list(tensor.shape)}; expected {list(param.shape)}")


def _check_step_count(key: str, step: torch.Tensor) -> None:
    """Raise BadRequest unless the stored `key` is one step count >= 0."""
    if step.numel() != 1 or int(step) < 0:
        raise BadRequest(f"optimizer state {key!r} must be one count >= 0; got {step.tolist()}")


class AdamW(_PerTensorOptimizer[_Moments]):
    """Decoupled-weight-decay Adam over a fixed set of named tensors."""

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
        return self._step(params, lambda name, param, grad: self._update(name, param, grad, params))

    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor, hp: AdamParams) -> None:
        """One tensor's step: t += 1, decay, moments, bias-corrected update."""
        moments = self._state.get(name)
        if moments is None:
            moments = _Moments(torch.zeros_like(grad), torch.zeros_like(grad), 0)
            self._state[name] = moments
        if moments.master is None and param.dtype != grad.dtype:
            # A bf16 (or fp16) parameter: its exact fp32 value starts the master copy.
            moments.master = param.detach().to(grad.dtype, copy=True)
        moments.step += 1
        # Work in the state dtype: the master copy, or for fp32 parameters the parameter itself.
        work = param if moments.master is None else moments.master
        work.mul_(1 - hp.learning_rate * hp.weight_decay)
        moments.exp_avg.lerp_(grad, 1 - hp.beta1)  # m = β1·m + (1 - β1)·g
        moments.exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
        bias_correction1 = 1 - hp.beta1**moments.step
        bias_correction2 = 1 - hp.beta2**moments.step
        denominator = (moments.exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(hp.eps)
        work.addcdiv_(moments.exp_avg, denominator, value=-hp.learning_rate / bias_correction1)
        if work is not param:
            param.copy_(work)

    def live_state(self) -> list[torch.Tensor]:
        """The state tensors themselves (m, v and any master copy, not copies), for `offload` to move in place."""
        found = [t for moments in self._state.values() for t in (moments.exp_avg, moments.exp_avg_sq)]
        return found + [moments.master for moments in self._state.values() if moments.master is not None]

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """The fp32 master copies (the tensors themselves) of the parameters narrower than fp32
        that have stepped; empty when every parameter is its own master."""
        return {name: moments.master for name, moments in self._state.items() if moments.master is not None}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as detached CPU clones: "<name>.exp_avg", "<name>.exp_avg_sq" and
        "<name>.step" (0-d int64) for every tensor that has stepped, and "<name>.master"
        for a parameter trained through an fp32 master copy."""
        return {key: tensor.detach().cpu().clone() for key, tensor in self.state_items()}

    def state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`state_tensors`' keys and tensors, in its order, as the live state (not copies; a step
        count is a new 0-d tensor): for a caller that saves them one at a time."""
        for name, moments in self._state.items():
            yield f"{name}.{EXP_AVG}", moments.exp_avg
            yield f"{name}.{EXP_AVG_SQ}", moments.exp_avg_sq
            yield f"{name}.{STEP}", torch.tensor(moments.step, dtype=torch.int64)
            if moments.master is not None:
                yield f"{name}.{MASTER}", moments.master

    def load_state_tensors(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Replace the state with `flat` (the format of `state_tensors`); tensors absent from
        it start fresh. Everything is checked before anything changes.

        A "<name>.master" is optional: without it a narrower parameter's master copy starts
        from the parameter at its next step.

        Raises:
            BadRequest: an unknown key, an incomplete triple, a shape that differs from the
                tensor's, or a negative step.
        """
        self._refuse_unknown(flat, (EXP_AVG, EXP_AVG_SQ, STEP, MASTER), "it belongs to another model shape")
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
            master_key = f"{name}.{MASTER}"
            master = flat.get(master_key)
            for key, tensor in ((keys[0], exp_avg), (keys[1], exp_avg_sq), (master_key, master)):
                if tensor is not None:
                    _check_stored(key, tensor, param)
            _check_step_count(keys[2], step)
            dtype = _state_dtype(param)
            state[name] = _Moments(
                exp_avg.to(device=param.device, dtype=dtype).clone(),
                exp_avg_sq.to(device=param.device, dtype=dtype).clone(),
                int(step),
                # Only a narrower parameter has a master; an fp32 one is its own.
                master.to(device=param.device, dtype=dtype).clone() if master is not None and param.dtype != dtype else None,
            )
        self._state = state


def _clip_factor(
    named: list[tuple[str, torch.Tensor]], grad_clip_norm: float
) -> tuple[torch.Tensor | None, float]:
    """The clipping factor (None: no clipping) and the pre-clip global norm (one norm
    shared by both families). Each norm is taken in the state dtype without a widened copy of
    the gradient; `_clipped` then widens and scales one gradient at a time.

    Raises:
        BadRequest: the norm is NaN or inf (the caller drops the gradients).
    """
    # Per tensor, then over the tensors, as clip_grad_norm_ does; in the state dtype (fp32 or wider).
    norms = [torch.linalg.vector_norm(p.grad, 2, dtype=_state_dtype(p)) for _, p in named]
    dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms])
    norm = torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), 2)
    grad_norm = float(norm)
    if not math.isfinite(grad_norm):
        raise BadRequest("non-finite gradient norm (check loss inputs)", key="grad_norm")
    if grad_clip_norm <= 0:
        return None, grad_norm
    return torch.clamp(grad_clip_norm / (norm + CLIP_EPS), max=1.0), grad_norm


def _clipped(param: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """`param`'s gradient in the state dtype, times the clipping factor: a new tensor (the
    accumulated gradient is left as it is), one gradient at a time."""
    grad = param.grad.to(_state_dtype(param))
    if factor is None:
        return grad
    return grad * factor.to(grad.dtype)


# ---------------------------------------------------------------- Dimuon v1 (openrld)


def validate_dimuon_params(params: DimuonParams) -> None:
    """Raise BadRequest naming the first field that is non-finite or out of range."""
    for field in ("learning_rate", "grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent"):
        value = getattr(params, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"dimuon_params.{field} must be a finite number; got {value!r}", key=field)
    if params.learning_rate < 0:
        raise BadRequest(f"dimuon_params.learning_rate must be >= 0; got {params.learning_rate!r}", key="learning_rate")
    if not 0 <= params.beta1 < 1:
        raise BadRequest(f"dimuon_params.beta1 must be in [0, 1); got {params.beta1!r}", key="beta1")
    if params.damping <= 0:
        raise BadRequest(f"dimuon_params.damping must be > 0; got {params.damping!r}", key="damping")


def rank_lr_correction(rank: int, exponent: float) -> float:
    """κ = (32 / r)^e: one learning-rate factor for every LoRA matrix.

    The sign of the exponent's effect is the spec's proposal ("relative to rank 32" is all
    the docs say); it lives here alone so that it can be replaced in one place.
    """
    return (DIMUON_REFERENCE_RANK / rank) ** exponent


def matrix_sign(x: torch.Tensor) -> torch.Tensor:
    """K quintic Newton–Schulz steps from X₀ = X / (‖X‖_F + ε), over the last two dims.

    The caller orients X so that X·Xᵀ is the small (r × r) Gram matrix.
    """
    a, b, c = NS_COEFFICIENTS
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + DIMUON_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def dimuon_direction(momentum: torch.Tensor, rank: int, damping: float, is_lora_b: bool) -> torch.Tensor:
    """D for one matrix (or a stack [E, ·, ·] of them), in fp32.

    Matrices whose momentum is all zero get D = 0 (no update this step).
    """
    energy = momentum.square()  # (..., m, n)
    mu = energy.mean(dim=(-2, -1), keepdim=True)
    live = mu > 0
    mu = torch.where(live, mu, torch.ones_like(mu))
    rows = energy.mean(dim=-1, keepdim=True) / mu  # ρ: (..., m, 1), averages 1
    cols = energy.mean(dim=-2, keepdim=True) / mu  # γ: (..., 1, n), averages 1
    y = (rows + damping).pow(-0.25) * momentum * (cols + damping).pow(-0.25)
    # A is (r, n) and B is (m, r): B is transposed so that the Gram matrix is r × r.
    sign = matrix_sign(y.mT).mT if is_lora_b else matrix_sign(y)
    direction = math.sqrt(rank) * sign / (torch.linalg.matrix_norm(sign, keepdim=True) + DIMUON_EPS)
    return torch.where(live, direction, torch.zeros_like(direction))


class _Momentum:
    __slots__ = ("buffer", "step")

    def __init__(self, buffer: torch.Tensor, step: int) -> None:
        self.buffer = buffer
        self.step = step


class Dimuon(_PerTensorOptimizer[_Momentum]):
    """Dimuon v1 (openrld) over the LoRA matrices of one adapter of rank `rank`."""

    def __init__(self, params: Mapping[str, torch.Tensor], rank: int) -> None:
        """Args:
        params: name -> leaf tensor (2-D, or 3-D for stacked experts); names containing
            "lora_B" are B matrices, the rest A matrices.
        rank: the adapter's LoRA rank r.
        """
        for name, param in params.items():
            assert param.dim() >= 2, f"Dimuon needs matrices; {name} has shape {list(param.shape)}"
        super().__init__(params)
        self._rank = rank

    def step(self, params: DimuonParams) -> dict[str, float]:
        """One Dimuon step with the accumulated gradients, then clear them.

        Returns and raises as `AdamW.step` does, with `validate_dimuon_params`.
        """
        validate_dimuon_params(params)
        return self._step(params, lambda name, param, grad: self._update(name, param, grad, params))

    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor, hp: DimuonParams) -> None:
        """One matrix's step: momentum, t += 1, direction, scaled update."""
        # First, before any state changes: κ can overflow for an extreme exponent, and then
        # nothing has moved and the gradients are kept.
        scale = hp.learning_rate * rank_lr_correction(self._rank, hp.rank_lr_correction_exponent)
        momentum = self._state.get(name)
        if momentum is None:
            momentum = _Momentum(torch.zeros_like(grad), 0)
            self._state[name] = momentum
        momentum.buffer.lerp_(grad, 1 - hp.beta1)  # M = β·M + (1 − β)·G
        momentum.step += 1
        direction = dimuon_direction(momentum.buffer, self._rank, hp.damping, "lora_B" in name)
        work = param if param.dtype == grad.dtype else param.to(grad.dtype)
        work.sub_(direction, alpha=scale)
        if work is not param:
            param.copy_(work)

    def live_state(self) -> list[torch.Tensor]:
        """The momentum tensors themselves (not copies), for `offload` to move in place."""
        return [momentum.buffer for momentum in self._state.values()]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """"<name>.momentum" and "<name>.step" (0-d int64) for every tensor that has stepped."""
        return {key: tensor.detach().cpu().clone() for key, tensor in self.state_items()}

    def state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`state_tensors`' keys and tensors, in its order, as the live state (not copies; a step
        count is a new 0-d tensor): for a caller that copies them in one go (`state_snapshot`)."""
        for name, momentum in self._state.items():
            yield f"{name}.{MOMENTUM}", momentum.buffer
            yield f"{name}.{STEP}", torch.tensor(momentum.step, dtype=torch.int64)

    def load_state_tensors(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Replace the state with `flat` (the format of `state_tensors`); checked first.

        Raises:
            BadRequest: an unknown key (AdamW state included), an incomplete pair, a shape
                that differs from the tensor's, or a negative step.
        """
        self._refuse_unknown(flat, (MOMENTUM, STEP), "it is not Dimuon state of this model")
        state: dict[str, _Momentum] = {}
        for name, param in self._params.items():
            keys = (f"{name}.{MOMENTUM}", f"{name}.{STEP}")
            present = [key in flat for key in keys]
            if not any(present):
                continue
            if not all(present):
                raise BadRequest(f"optimizer state for {name!r} is incomplete: missing {keys[present.index(False)]!r}")
            buffer, step = flat[keys[0]], flat[keys[1]]
            _check_stored(keys[0], buffer, param)
            _check_step_count(keys[1], step)
            state[name] = _Momentum(buffer.to(device=param.device, dtype=_state_dtype(param)).clone(), int(step))
        self._state = state


Optimizer = AdamW | Dimuon


def optimizer_for(family: str, params: Mapping[str, torch.Tensor], rank: int) -> Optimizer:
    """A fresh optimizer of `family` ("adamw" or "dimuon") over `params`."""
    if family == "adamw":
        return AdamW(params)
    if family == "dimuon":
        return Dimuon(params, rank)
    raise BadRequest(f"unsupported optimizer type {family!r}; supported: {', '.join(OPTIMIZER_FAMILIES)}")


def family_of(params: OptimParams) -> str:
    """"adamw" for AdamParams, "dimuon" for DimuonParams."""
    return "dimuon" if isinstance(params, DimuonParams) else "adamw"


def _state_dtype(param: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower parameters (the spec's precision rule); fp64 stays fp64."""
    return torch.promote_types(param.dtype, torch.float32)
