"""The engine calls a worker answers, derived from the engine Protocols.

Each method of `engine_types.TrainerEngine` and `SamplerEngine` is declared once, there: its
name, its parameters and its result. This module reads those signatures and makes, for each
call, its `Method`: the argument and result types on the wire (both ends read a call by
them, so a value that does not fit is refused by `values.decode` before an engine or an
actor sees it) and the conversions of each end. `client.py` makes the daemon's methods
from it and `server.py` its dispatch, so an engine call added to a Protocol crosses a worker
with no other edit. A Python value crosses as it is, but for what these say (by type):
- the optimizer's hyperparameters (`OptimParams`) travel as two optional fields, since
  msgpack cannot tell an untagged `AdamParams` from a `DimuonParams`;
- the trainer's weights for its sampler (`WeightPayload`) travel as a `WirePayload`, which
  the daemon holds without reading; a worker's engine takes them decoded (`values.local_payload`);
- a step that fails after its pass succeeded (`PassAndStep`) travels as a `Failure` inside
  a `StepOutcome`, not as an exception object;
- a call marked `updates_last_sync` carries the engine's `last_sync` with its result, so
  that the property is never a round trip.
And for what these say (by call): a sampler's `add` and `cancel` ride on its next `step`
(`StepCall`), since the actor calls them on the event loop, which must never wait on a
worker; `has_work` and `versions_in_use` the daemon's side answers from what it sent.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import msgspec

from openrld.batches import (
    AdamParams,
    DimuonParams,
    ForwardBackwardResult,
    OptimParams,
    OptimResult,
    SampleJob,
    SampleResult,
    SyncStats,
)
from openrld.engine_types import PassAndStep, SamplerEngine, TrainerEngine, WeightPayload
from openrld.worker.protocol import Failure
from openrld.worker.values import RequestFailure, WirePayload, error_from, failure_fields, local_payload, payload_of


class StepOutcome(msgspec.Struct, frozen=True):
    results: list[ForwardBackwardResult]
    step: OptimResult | None = None
    step_failure: Failure | None = None


class PayloadReply(msgspec.Struct, frozen=True):
    payload: WirePayload
    last_sync: SyncStats | None = None


class AddRequest(msgspec.Struct, frozen=True):
    request_id: str
    version: str | None
    job: SampleJob


class StepCall(msgspec.Struct, frozen=True):
    adds: list[AddRequest] = []
    cancels: list[str] = []
    steps: int = 1  # engine steps to run, back to back, before answering


class Done(msgspec.Struct, frozen=True):
    """A request a step finished: `engine_types.Finished` without its error (failures are `failed`)."""

    request_id: str
    result: SampleResult


class StepReply(msgspec.Struct, frozen=True):
    finished: list[Done] = []
    failed: list[RequestFailure] = []  # adds the engine refused, with why
    has_work: bool = False


# ---------------------------------------------------------------- one parameter, one result


class _Param(NamedTuple):
    """One Protocol parameter on the wire: its slots' types, and each end's conversion."""

    slots: tuple[Any, ...]
    send: Callable[[Any], tuple]  # the daemon's: the value as its slots
    take: Callable[..., Any]  # the worker's: the slots as the value


def _split_params(params: OptimParams | None) -> tuple[AdamParams | None, DimuonParams | None]:
    if params is None:
        return None, None
    return (params, None) if isinstance(params, AdamParams) else (None, params)


def _join_params(adam: AdamParams | None, dimuon: DimuonParams | None) -> OptimParams | None:
    return adam if adam is not None else dimuon


_OPTIM = _Param((AdamParams | None, DimuonParams | None), _split_params, _join_params)
_PARAMS: dict[Any, _Param] = {
    OptimParams: _OPTIM,
    OptimParams | None: _OPTIM,
    WeightPayload: _Param((WirePayload,), lambda payload: (payload_of(payload),), local_payload),
}


def _param(type_: Any) -> _Param:
    return _PARAMS.get(type_) or _Param((type_,), lambda value: (value,), lambda value: value)


class _Result(NamedTuple):
    """A Protocol result on the wire: its type, and each end's conversion."""

    wire: Any
    answer: Callable[[Any], Any]  # the worker's: the engine's value as sent
    take: Callable[[Any], Any]  # the daemon's: the reply as the Protocol returns it


def _outcome(value: PassAndStep) -> StepOutcome:
    results, stepped = value
    if isinstance(stepped, BaseException):
        kind, text, key = failure_fields(stepped)
        return StepOutcome(results, step_failure=Failure(0, kind, text, key))
    return StepOutcome(results, step=stepped)


def _pass_and_step(outcome: StepOutcome) -> PassAndStep:
    failure = outcome.step_failure
    if failure is not None:
        return outcome.results, error_from(failure.kind, failure.message, failure.key)
    return outcome.results, outcome.step


def _same(value: Any) -> Any:
    return value


_RESULTS: dict[Any, _Result] = {
    type(None): _Result(None, _same, _same),
    WeightPayload: _Result(WirePayload, payload_of, _same),  # the daemon holds it as it came
    PassAndStep: _Result(StepOutcome, _outcome, _pass_and_step),
}


def _result(type_: Any) -> _Result:
    return _RESULTS.get(type_) or _Result(type_, _same, _same)


# ---------------------------------------------------------------- one call


class Method:
    """One engine call as a worker carries it, from its declaration (a Protocol's method): the
    wire types, and each end's conversions."""

    def __init__(self, declared: Callable[..., Any]) -> None:
        hints = typing.get_type_hints(declared, include_extras=True)
        self.name = declared.__name__
        self.signature = inspect.signature(declared)  # `self` included
        self.doc = declared.__doc__
        self._params = [_param(hints[name]) for name in list(self.signature.parameters)[1:]]
        self._result = _result(hints["return"])
        self.syncs = getattr(declared, "__updates_last_sync__", False)  # the reply carries the engine's last_sync
        self.args: Any = tuple.__class_getitem__(tuple(slot for param in self._params for slot in param.slots))
        if not self.syncs:
            self.result: Any = self._result.wire
        elif self._result.wire is None:
            self.result = SyncStats | None  # the reply is the last_sync alone
        elif self._result.wire is WirePayload:
            self.result = PayloadReply
        else:
            raise TypeError(f"{self.name}: a call that updates last_sync returns None or a WeightPayload")

    # The daemon's side.

    def send(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """The Protocol's arguments (after `self`) as the call's wire arguments."""
        if kwargs:
            args = self.signature.bind(None, *args, **kwargs).args[1:]
        if len(args) != len(self._params):
            raise TypeError(f"{self.name}() takes {len(self._params)} arguments; {len(args)} given")
        wire: list[Any] = []
        for param, value in zip(self._params, args):
            wire += param.send(value)
        return wire

    def returned(self, reply: Any) -> tuple[Any, SyncStats | None]:
        """The reply as (what the Protocol returns, the engine's last_sync when `syncs`)."""
        if not self.syncs:
            return self._result.take(reply), None
        if self.result is PayloadReply:
            return reply.payload, reply.last_sync
        return None, reply

    # The worker's side.

    def call(self, engine: Any, wire: tuple) -> Any:
        """Run the call on `engine` with the decoded wire arguments; its reply, as sent."""
        args, at = [], 0
        for param in self._params:
            width = len(param.slots)
            args.append(param.take(*wire[at:at + width]))
            at += width
        value = self._result.answer(getattr(engine, self.name)(*args))
        if not self.syncs:
            return value
        if self.result is PayloadReply:
            return PayloadReply(value, engine.last_sync)
        return engine.last_sync


# Calls the daemon's side answers itself, and the call that carries them, which server.py answers.
SAMPLER_LOCAL = frozenset({"add", "cancel", "has_work", "versions_in_use"})


class _StepsOnTheWire(Protocol):
    """The sampler's `step` as a worker's carries it: with the adds and cancels since the last one."""

    def step(self, call: StepCall) -> StepReply: ...


def _methods(protocol: type, local: frozenset[str] = frozenset()) -> dict[str, Method]:
    """Every call of `protocol` (its properties and `close` are not calls) but those in `local`."""
    return {
        name: Method(member)
        for layer in reversed(protocol.__mro__) if layer.__module__ not in ("builtins", "typing")
        for name, member in vars(layer).items()
        if inspect.isfunction(member) and not name.startswith("_") and name != "close" and name not in local
    }


TRAINER_METHODS: dict[str, Method] = _methods(TrainerEngine)
SAMPLER_METHODS: dict[str, Method] = {**_methods(SamplerEngine, SAMPLER_LOCAL | {"step"}), **_methods(_StepsOnTheWire)}

METHODS = {"trainer": TRAINER_METHODS, "sampler": SAMPLER_METHODS}
