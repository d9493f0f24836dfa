"""The engine calls a worker answers: each method's argument and result types.

Both ends read a call by these types, so a value that does not fit is refused
(`values.decode`) before an engine or an actor sees it. The methods are the
engine interfaces of `openrld.engine_types`, reshaped only where a Python value
does not cross as it is:
- the optimizer's hyperparameters travel as two optional fields, since msgpack
  cannot tell an untagged `AdamParams` from a `DimuonParams`;
- a step that fails after its pass succeeded travels as a `Failure`, not as an
  exception object;
- a sampler's `add` and `cancel` ride on its next `step` (`StepCall`): the actor
  calls them on the event loop, which must never wait on a worker;
- a result that updates `last_sync` carries it, so that the property is never a
  round trip.
"""

from __future__ import annotations

from typing import Any

import msgspec

from openrld.batches import (
    AdamParams,
    DimuonParams,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimParams,
    OptimResult,
    SampleJob,
    SampleResult,
    SyncStats,
)
from openrld.engine_types import ParkReport, ResumeReport
from openrld.worker.protocol import Failure
from openrld.worker.values import RequestFailure, WirePayload


class Method(msgspec.Struct, frozen=True):
    args: Any  # a tuple type
    result: Any


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


_Params = tuple[AdamParams | None, DimuonParams | None]

TRAINER_METHODS: dict[str, Method] = {
    "add_adapter": Method(tuple[str, LoraSpec | None, str], None),
    "drop_adapter": Method(tuple[str], None),
    "has_adapter": Method(tuple[str], bool),
    "forward_backward": Method(tuple[str, ForwardBackwardBatch], ForwardBackwardResult),
    "forward_backward_many": Method(tuple[str, list[ForwardBackwardBatch]], list[ForwardBackwardResult]),
    "forward_backward_then_step": Method(
        tuple[str, list[ForwardBackwardBatch], AdamParams | None, DimuonParams | None], StepOutcome
    ),
    "optim_step": Method(tuple[str, AdamParams | None, DimuonParams | None], OptimResult),
    "adapter_tensors": Method(tuple[str], WirePayload),
    "sampler_payload": Method(tuple[str, str], PayloadReply),
    "export_adapter": Method(tuple[str, str, str], int),
    "sampler_checkpoint": Method(tuple[str, str], int),
    "save_state": Method(tuple[str, str, bool], int),
    "load_state": Method(tuple[str, str, LoraSpec | None, bool, str], None),
    "park": Method(tuple[()], ParkReport),
    "resume": Method(tuple[()], ResumeReport),
}

SAMPLER_METHODS: dict[str, Method] = {
    "load_version": Method(tuple[str, WirePayload, LoraSpec | None], SyncStats | None),
    "load_checkpoint": Method(tuple[str, str], SyncStats | None),
    "drop_version": Method(tuple[str], None),
    "step": Method(tuple[StepCall], StepReply),
    "park": Method(tuple[()], ParkReport),
    "resume": Method(tuple[()], ResumeReport),
}

METHODS = {"trainer": TRAINER_METHODS, "sampler": SAMPLER_METHODS}


def split_params(params: OptimParams | None) -> _Params:
    if params is None:
        return None, None
    return (params, None) if isinstance(params, AdamParams) else (None, params)


def join_params(adam: AdamParams | None, dimuon: DimuonParams | None) -> OptimParams | None:
    return adam if adam is not None else dimuon
