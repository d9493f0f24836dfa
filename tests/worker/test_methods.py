"""The worker's calls, derived from the engine Protocols: the wire types, and both ends.

The daemon's side (`client.RemoteTrainer`, `RemoteSampler`) and the worker's (`server.handlers`)
are joined here by a loop in memory that does what the protocol does with a call (encode,
decode by the method's types, answer, encode, decode), so each end's conversions are tested
without a process. A call added to a Protocol crosses with no other edit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import torch

from openrld.batches import (
    AdamParams,
    DimuonParams,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    OptimParams,
    OptimResult,
    SyncStats,
)
from openrld.engine_types import (
    ParkReport,
    ResumeReport,
    SamplerEngine,
    SnapshotFile,
    StateSnapshot,
    TrainerEngine,
    WeightPayload,
)
from openrld.errors import BadRequest, NotSupportedYet
from openrld.worker import base, client, methods, server, values
from openrld.worker.engines import InprocSampler
from openrld.worker.methods import PayloadReply, StepCall, StepOutcome, StepReply
from openrld.worker.values import WirePayload

SYNC = SyncStats(mode="delta", changed_fraction=0.5, bytes_moved=8, full_bytes=16, dense_tensors=0, compute_s=0.1)


class Loop:
    """A `WorkerConnection` in memory: each call crosses as the protocol carries it."""

    def __init__(self, role: str, engine: Any, table: dict[str, methods.Method] | None = None) -> None:
        self.table = table or methods.METHODS[role]
        self.answers = server.handlers(role, engine)  # type: ignore[arg-type]
        if table is not None:
            self.answers.update({name: (lambda args, m=m: m.call(engine, args)) for name, m in table.items()})

    def call(self, name: str, *args: Any) -> Any:
        method = self.table[name]
        sent = values.Encoding()
        raw = sent.encode(args)
        value = self.answers[name](values.decode(raw, method.args, sent.buffers, torch_tensors=True))
        back = values.Encoding()
        return values.decode(back.encode(value), method.result, back.buffers)


class Trainer(base.TrainerWorker):
    """An engine that notes what reached it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple]] = []
        self._sync: SyncStats | None = None

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        self.seen.append(("forward_backward", (name, batch)))
        return ForwardBackwardResult(logprobs=[np.zeros(2, np.float32)], metrics={"loss:sum": 1.0})

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        self.seen.append(("optim_step", (name, params)))
        if params.learning_rate < 0:
            raise BadRequest("learning_rate must be >= 0", key="learning_rate")
        return OptimResult(metrics={"learning_rate:mean": params.learning_rate})

    def sampler_payload(self, name: str, version: str) -> WeightPayload:
        self._sync = SYNC
        return {"w": torch.arange(4, dtype=torch.bfloat16)}

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int:
        self.seen.append(("save_state", (name, directory, with_optimizer)))
        return 7

    @property
    def last_sync(self) -> SyncStats | None:
        return self._sync


def batch() -> ForwardBackwardBatch:
    return ForwardBackwardBatch(data=[], loss_fn="cross_entropy", loss_config={}, forward_only=False)


def test_the_wire_types_are_protocol_version_1s():
    """What each call sends and answers, as `PROTOCOL_VERSION` 1 states it: an image built on an
    older openrld reads every call of this one."""
    adam_dimuon = (AdamParams | None, DimuonParams | None)
    wire = {role: {name: (m.args, m.result) for name, m in table.items()} for role, table in methods.METHODS.items()}
    assert wire["trainer"] == {
        "add_adapter": (tuple[str, LoraSpec | None, str], None),
        "drop_adapter": (tuple[str], None),
        "has_adapter": (tuple[str], bool),
        "forward_backward": (tuple[str, ForwardBackwardBatch], ForwardBackwardResult),
        "forward_backward_many": (tuple[str, list[ForwardBackwardBatch]], list[ForwardBackwardResult]),
        "forward_backward_then_step": (tuple[(str, list[ForwardBackwardBatch], *adam_dimuon)], StepOutcome),
        "optim_step": (tuple[(str, *adam_dimuon)], OptimResult),
        "adapter_tensors": (tuple[str], WirePayload),
        "sampler_payload": (tuple[str, str], PayloadReply),
        "export_adapter": (tuple[str, Path, str], int),  # a Path travels as its str
        "sampler_checkpoint": (tuple[str, Path], int),
        "save_state": (tuple[str, Path, bool], int),
        "snapshot_state": (tuple[str, bool], StateSnapshot | None),
        "load_state": (tuple[str, Path, LoraSpec | None, bool, str], None),
        "park": (tuple[()], ParkReport),
        "resume": (tuple[()], ResumeReport),
    }
    assert wire["sampler"] == {
        "load_version": (tuple[str, WirePayload, LoraSpec | None], SyncStats | None),
        "load_checkpoint": (tuple[str, Path], SyncStats | None),
        "drop_version": (tuple[str], None),
        "step": (tuple[StepCall], StepReply),
        "park": (tuple[()], ParkReport),
        "resume": (tuple[()], ResumeReport),
    }


def test_a_path_travels_as_the_str_it_always_did():
    encoding = values.Encoding()
    assert bytes(encoding.encode(("m", Path("/ckpt/a"), True))) == bytes(values.Encoding().encode(("m", "/ckpt/a", True)))


def test_every_call_of_the_protocols_crosses_but_what_the_daemons_side_answers():
    def calls(protocol: type) -> set[str]:
        return {
            name for layer in protocol.__mro__ if layer.__module__ == "openrld.engine_types"
            for name, member in vars(layer).items() if callable(member) and not name.startswith("_")
        } - {"close"}

    assert set(methods.TRAINER_METHODS) == calls(TrainerEngine)
    assert set(methods.SAMPLER_METHODS) == calls(SamplerEngine) - methods.SAMPLER_LOCAL
    assert {"add", "cancel", "has_work", "versions_in_use"} == methods.SAMPLER_LOCAL


def test_a_trainers_calls_reach_the_engine_as_the_protocol_types_them():
    engine = Trainer()
    remote = client.RemoteTrainer(Loop("trainer", engine))  # type: ignore[arg-type]
    assert remote.optim_step("m", DimuonParams(learning_rate=0.5)) == OptimResult({"learning_rate:mean": 0.5})
    assert engine.seen[-1] == ("optim_step", ("m", DimuonParams(learning_rate=0.5)))  # not an AdamParams
    assert remote.save_state("m", Path("/ckpt/a"), with_optimizer=False) == 7  # keywords too
    assert engine.seen[-1] == ("save_state", ("m", Path("/ckpt/a"), False))
    results, step = remote.forward_backward_then_step("m", [batch(), batch()], AdamParams(learning_rate=-1.0))
    assert len(results) == 2 and isinstance(step, BadRequest) and step.key == "learning_rate"  # the pass stands
    results, step = remote.forward_backward_then_step("m", [batch()], None)
    assert len(results) == 1 and step is None


def test_a_state_snapshot_crosses_as_its_files_bytes():
    class Copies(Trainer):
        def snapshot_state(self, name: str, with_optimizer: bool) -> StateSnapshot | None:
            body = torch.arange(3, dtype=torch.float32).view(torch.uint8).numpy()
            return StateSnapshot([SnapshotFile("a.safetensors", b"head", body), SnapshotFile("state.json", b"{}")])

    remote = client.RemoteTrainer(Loop("trainer", Copies()))  # type: ignore[arg-type]
    snapshot = remote.snapshot_state("m", True)
    assert [(f.name, f.head) for f in snapshot.files] == [("a.safetensors", b"head"), ("state.json", b"{}")]
    assert bytes(snapshot.files[0].body) == np.arange(3, dtype=np.float32).tobytes() and snapshot.files[1].body is None
    assert client.RemoteTrainer(Loop("trainer", Trainer())).snapshot_state("m", True) is None  # type: ignore[arg-type]


def test_a_call_that_updates_last_sync_brings_it_back_with_its_result():
    remote = client.RemoteTrainer(Loop("trainer", Trainer()))  # type: ignore[arg-type]
    assert remote.last_sync is None
    payload = remote.sampler_payload("m", "v1")
    assert isinstance(payload, WirePayload) and remote.last_sync == SYNC  # the daemon holds it undecoded
    assert torch.equal(values.local_payload(payload)["w"], torch.arange(4, dtype=torch.bfloat16))


def test_a_samplers_payload_is_decoded_at_the_workers_edge():
    class Sampler(base.SamplerWorker):
        got: Any = None

        def load_version(self, version, payload, spec):
            self.got = payload

        @property
        def last_sync(self):
            return SYNC

    engine = Sampler()
    remote = client.RemoteSampler(Loop("sampler", engine))  # type: ignore[arg-type]
    remote.load_version("v1", {"w": torch.ones(3)}, LoraSpec(rank=2))
    assert torch.equal(engine.got["w"], torch.ones(3)) and remote.last_sync == SYNC

    inproc = Sampler()
    received = values.payload_of({"w": values.HostTensor("float32", (1,), memoryview(bytearray(4)))})  # as a trainer's came
    InprocSampler(inproc).load_version("v1", received, None)
    assert torch.equal(inproc.got["w"], torch.zeros(1))  # a torch tensor, as a worker's engine gets it
    assert InprocSampler(inproc).step() == [] and InprocSampler(inproc).is_parked is False  # the rest is the engine's


def test_a_call_added_to_a_protocol_crosses_with_no_other_edit():
    class Extended(TrainerEngine, Protocol):
        def rewind(self, name: str, directory: Path, params: OptimParams | None) -> WeightPayload: ...

    class Engine(Trainer):
        def rewind(self, name, directory, params):
            return {"at": torch.tensor([float(len(str(directory)))]), "lr": torch.tensor([params.learning_rate])}

    table = methods._methods(Extended)
    assert table["rewind"].args == tuple[str, Path, AdamParams | None, DimuonParams | None]

    class Remote(client.RemoteTrainer):
        pass

    client._calls(Remote, table)
    payload = Remote(Loop("trainer", Engine(), table)).rewind("m", Path("/a/b"), DimuonParams(learning_rate=2.0))  # type: ignore[attr-defined]
    got = values.local_payload(payload)
    assert got.keys() == {"at", "lr"} and got["at"].item() == 4.0 and got["lr"].item() == 2.0


def test_a_custom_engine_refuses_what_it_does_not_write_by_name():
    with pytest.raises(NotSupportedYet, match=r"does not implement load_state$"):
        base.TrainerWorker().load_state("m", Path("/a"), None, True, "adamw")
    with pytest.raises(NotSupportedYet, match=r"does not implement add$"):
        base.SamplerWorker().add("r", None, None)  # type: ignore[arg-type]
    assert base.SamplerWorker().step() == [] and base.TrainerWorker().is_parked is False
