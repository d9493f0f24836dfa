"""A worker as a torchrun group: several ranks behind one worker endpoint.

The torchrun launcher (`launchers/torchrun.py`) starts `nproc` copies of a worker
program; `server.serve` sees WORLD_SIZE > 1 and hands each of them to `serve`
here. To the daemon the group is one worker: rank 0 connects, says hello and
speaks the protocol exactly as a single worker does (heartbeats included); no
other rank touches the socket. The ranks join a process group for control
(gloo, so that it runs on CPU as on GPU; one of its own, apart from the default
group the engine uses, since a collective waits at most its group's timeout and
a trainer may sit idle between calls for longer than any sensible one) and move
in lock step:

    Start   rank 0 receives it and broadcasts it; every rank builds its engine
            from it, with `device` set to its own (see `rank_device`)
    build   the ranks agree on success; if any failed, rank 0 sends
            Failure(0) naming the failed rank(s) and the first one's error
    Call    rank 0 broadcasts the method, the raw msgpack arguments and the
            frame's buffers; every rank decodes them and runs the same handler;
            the ranks agree on success; rank 0 sends its own value as the Result,
            or a Failure naming the failed rank(s) and the first one's error
    stop    on Bye, or the daemon's end of the connection while idle, rank 0
            broadcasts a stop; every rank closes its engine and exits 0

Everything broadcast is msgpack and raw bytes in uint8 tensors, a length first:
never `broadcast_object_list`, which pickles. A rank that dies (or a broken
control channel) ends the whole group: torchrun sees the lost rank, stops the
others and exits non-zero, and the daemon sees rank 0's connection end. If the
daemon's connection ends mid-call, rank 0 exits at once, with the same effect.

For engine writers: the engine is built once on every rank, from the same
`Start`, and each call runs on every rank with the same arguments; only rank 0's
return value reaches the daemon. The default process group is initialised before
the engine is built, so an engine learns where it runs from torch.distributed:
`torch.distributed.get_rank()`, `get_world_size()`, and LOCAL_RANK from the
environment torchrun sets; `start.device` is already this rank's device
("cuda:<LOCAL_RANK>" in a GPU group, made current with `torch.cuda.set_device`).
The default group's backend is gloo for CPU tensors and, where CUDA is
available, NCCL for CUDA tensors, so an engine's own collectives on its device
tensors run over NCCL; it may also make groups of its own (`new_group`). A call
must run the same collectives on every rank, as any SPMD program must.

A group over several nodes (a trainer wider than any node, `launchers/torchrun.py`
with a `SpanRendezvous`): every node's torchrun joins one c10d rendezvous hosted by
the home node, which numbers the nodes in its own order. Each rank's environment
says whether it runs on the home node (SPAN_HOME_ENV); before the default group is
made the ranks renumber themselves through torchrun's store, the home's first, so
global rank 0 is the home's local rank 0, the one that reaches the daemon. A member
node's ranks build on their own devices (SPAN_DEVICE_ENV) from their node's copy of
the model (SPAN_MODEL_DIR_ENV), the rest of rank 0's Start unchanged.

Signals: torchrun stops its ranks with SIGTERM (after a lost rank, or when it is
stopped itself), so a rank keeps SIGTERM's default even when
OPENRLD_WORKER_IGNORE_SIGNALS asks a worker to ignore it; it ignores SIGINT
only. Each rank dies with torchrun (PR_SET_PDEATHSIG): the ranks run in sessions
of their own, so a torchrun killed outright could not otherwise take them along.

Why by hand: torch.distributed gives the collectives, and nothing gives a
pickle-free way to move msgpack frames through them.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import torch
import torch.distributed as dist

from openrld.errors import OpenrldError
from openrld.worker import values
from openrld.worker.frames import FrameSocket, Limits, ProtocolError
from openrld.worker.launchers.torchrun import SPAN_DEVICE_ENV, SPAN_HOME_ENV, SPAN_MODEL_DIR_ENV
from openrld.worker.methods import METHODS
from openrld.worker.protocol import PROTOCOL_VERSION, Call, Failure, Hello, Ready, Result, Role, Start
from openrld.worker.server import (
    IGNORE_SIGNALS_ENV,
    ROLE_ENV,
    SOCKET_ENV,
    TOKEN_ENV,
    BuildEngine,
    _close,
    _Session,
    handlers,
)

logger = logging.getLogger("openrld.worker")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The control group's collectives wait this long: the followers wait for rank 0's next order
# through the whole idle time of a job (the default group's 30 minutes would end the group).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class Order(msgspec.Struct, frozen=True, array_like=True):
    """What rank 0 tells every rank to do next."""

    method: str  # an engine method; "" is the stop
    args: msgspec.Raw = msgspec.Raw(b"\x90")  # the Call's msgpack array, as the daemon sent it
    buffer_bytes: list[int] = []  # the size of each of the frame's buffers, in order


class RankError(msgspec.Struct, frozen=True, array_like=True):
    """The first failed rank's error, as every rank learns it."""

    kind: str
    message: str
    key: str | None
    trace: str


class GroupFailure(msgspec.Struct, frozen=True):
    failed: list[int]  # the ranks that failed, ascending
    first: RankError  # the error of the lowest of them

    def failure(self, call_id: int, world_size: int, prefix: str = "") -> Failure:
        ranks = ", ".join(map(str, self.failed))
        if len(self.failed) == 1:
            text = f"rank {ranks} of {world_size} failed: {self.first.message}"
        else:
            text = f"ranks {ranks} of {world_size} failed; rank {self.failed[0]}: {self.first.message}"
        return Failure(call_id, self.first.kind, prefix + text, self.first.key, self.first.trace)


_STOP = Order("")
_order_decoder = msgspec.msgpack.Decoder(Order)
_error_decoder = msgspec.msgpack.Decoder(RankError)
_start_decoder = msgspec.msgpack.Decoder(Start)


def rank_device(device: str, local_rank: int) -> str:
    """The device of one rank, from the group's device as the worker sees it.

    "cpu" -> "cpu"; "cuda" -> "cuda:<local_rank>"; "cuda:0,1" -> its local_rank-th entry;
    one device ("cuda:0") is every rank's.
    """
    kind, _, indices = device.partition(":")
    if kind != "cuda":
        return device
    if not indices:
        return f"cuda:{local_rank}"
    listed = indices.split(",")
    if len(listed) == 1:
        return device
    if local_rank >= len(listed):
        raise ValueError(f"rank {local_rank} has no device in {device!r}")
    return f"cuda:{listed[local_rank]}"


class RankGroup:
    """The group's control channel: rank 0's bytes to every rank, and agreement on failure."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group  # a torch.distributed ProcessGroup; None: the default one

    def share(self, data: bytes | None, src: int = 0) -> bytes:
        """`src`'s bytes (the others pass None), on every rank: a length, then the bytes."""
        mine = data if self.rank == src else None
        if self.rank == src and mine is None:
            raise ValueError(f"rank {src} shares its bytes: it passes bytes, not None")
        length = torch.tensor([0 if mine is None else len(mine)], dtype=torch.int64)
        dist.broadcast(length, src=src, group=self.group)
        size = int(length.item())
        if size == 0:
            return b""
        if mine is not None:
            dist.broadcast(torch.frombuffer(bytearray(mine), dtype=torch.uint8), src=src, group=self.group)
            return mine
        received = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(received, src=src, group=self.group)
        return received.numpy().tobytes()

    def share_order(
        self, order: Order | None, buffers: Sequence[memoryview] = ()
    ) -> tuple[Order, list[memoryview]]:
        """Rank 0's order and its buffers (one uint8 tensor, end to end), on every rank."""
        order = _order_decoder.decode(self.share(msgspec.msgpack.encode(order) if self.rank == 0 else None))
        total = sum(order.buffer_bytes)
        if total == 0:
            return order, [memoryview(b"")] * len(order.buffer_bytes)
        joined = torch.empty(total, dtype=torch.uint8)
        if self.rank == 0:
            flat, offset = joined.numpy(), 0
            for buffer in buffers:
                flat[offset : offset + buffer.nbytes] = memoryview(buffer).cast("B")
                offset += buffer.nbytes
        dist.broadcast(joined, src=0, group=self.group)
        if self.rank == 0:
            return order, list(buffers)
        whole, views, offset = memoryview(joined.numpy()), [], 0
        for nbytes in order.buffer_bytes:
            views.append(whole[offset : offset + nbytes])
            offset += nbytes
        return order, views

    def agree(self, error: BaseException | None) -> GroupFailure | None:
        """Which ranks failed (an all_reduce of one flag per rank), and the first one's error."""
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(error is not None)
        dist.all_reduce(flags, group=self.group)
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if not failed:
            return None
        mine = None
        if self.rank == failed[0]:
            assert error is not None  # this rank's own flag is among the failed
            kind, text, key = values.failure_fields(error)
            trace = "" if isinstance(error, OpenrldError) else "".join(traceback.format_exception(error))
            mine = msgspec.msgpack.encode(RankError(kind, text, key, trace))
        return GroupFailure(failed, _error_decoder.decode(self.share(mine, src=failed[0])))


def serve(
    build: BuildEngine, *, role: Role | None = None, socket_path: str | None = None, token: str | None = None,
    engine: str = "custom", info: Callable[[Any], dict] | None = None,
) -> None:
    """`server.serve` for one rank of a torchrun group (WORLD_SIZE > 1); exits the process."""
    _die_with_parent()
    if os.environ.get(IGNORE_SIGNALS_ENV) == "1":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # SIGTERM stays: it is how torchrun stops its ranks
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if SPAN_HOME_ENV in os.environ:
        rank, store = _span_rank()
        dist.init_process_group(
            backend=backend, store=dist.PrefixStore("openrld/pg", store), rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    else:
        dist.init_process_group(backend=backend)
    group = RankGroup(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    try:
        if group.rank == 0:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path or os.environ[SOCKET_ENV])
            frames = FrameSocket(sock, Limits())
            role = cast(Role, role or os.environ[ROLE_ENV])
            frames.send(Hello(PROTOCOL_VERSION, token or os.environ[TOKEN_ENV], role, os.getpid(), ["shared_memory"], engine))
            status = _Leader(frames, role, group).run(build, info)
        else:
            status = _follow(group, build, role or os.environ[ROLE_ENV])  # type: ignore[arg-type]
    except Exception:  # the control channel broke (a rank is gone); torchrun stops the rest
        logger.exception("rank %d of %d: the group's control channel failed", group.rank, group.world_size)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as server.serve: the engine's state goes with the process


def _die_with_parent() -> None:
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # torchrun died before the signal was armed
        os._exit(1)


def span_order(nodes: dict[int, tuple[bool, int]]) -> list[int]:
    """torchrun's node ranks in openrld's order: the home node first, then the others as torchrun numbered them.

    `nodes`: torchrun's node rank -> (is it the home, its ranks)."""
    return sorted(nodes, key=lambda node: (not nodes[node][0], node))


def _span_rank() -> tuple[int, Any]:
    """This rank's global rank in a group over several nodes, the home node's ranks first, and the store
    the ranks share (torchrun's, which its agents host; only keys under "openrld/" are ours)."""
    node, nodes = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    store = dist.PrefixStore("openrld/span", base)
    if local == 0:
        store.set(f"node/{node}", f"{os.environ[SPAN_HOME_ENV]},{local_world}")
    keys = [f"node/{n}" for n in range(nodes)]
    store.wait(keys)
    told = {n: store.get(key).decode().split(",") for n, key in enumerate(keys)}
    layout = {n: (home == "1", int(ranks)) for n, (home, ranks) in told.items()}
    order = span_order(layout)
    first = sum(layout[n][1] for n in order[: order.index(node)])
    return first + local, base


def _own_start(start: Start) -> Start:
    device = os.environ.get(SPAN_DEVICE_ENV, start.device)
    own = msgspec.structs.replace(start, device=rank_device(device, int(os.environ.get("LOCAL_RANK", "0"))))
    model_dir = os.environ.get(SPAN_MODEL_DIR_ENV)
    return own if model_dir is None else msgspec.structs.replace(own, model_dir=model_dir)


def _build(build: BuildEngine, start: Start) -> tuple[Any, BaseException | None]:
    try:
        if start.device.startswith("cuda"):
            torch.cuda.set_device(start.device)  # NCCL's collectives use the current device
        return build(start), None
    except BaseException as error:  # the build's error is reported by rank 0, naming this rank
        return None, error


def _perform(
    answers: dict[str, Callable[[tuple], Any]], role: Role, order: Order, buffers: list[memoryview]
) -> tuple[Any, BaseException | None]:
    try:
        args = values.decode(order.args, METHODS[role][order.method].args, buffers, torch_tensors=True)
        return answers[order.method](args), None
    except BaseException as error:  # the engine's error is the call's; the group serves on
        return None, error


def _follow(group: RankGroup, build: BuildEngine, role: Role) -> int:
    """Every rank but 0: do what rank 0 orders, until it says stop."""
    shared = group.share(None)
    if not shared:
        return 1  # rank 0 got no Start
    engine, error = _build(build, _own_start(_start_decoder.decode(shared)))
    if group.agree(error) is not None:
        return 1
    answers = handlers(role, engine)
    while True:
        order, buffers = group.share_order(None)
        if order.method == "":
            _close(engine)
            return 0
        _, error = _perform(answers, role, order, buffers)
        group.agree(error)


class _Leader(_Session):
    """Rank 0: the protocol's worker side, as `server._Session`, with the group behind each step."""

    def __init__(self, frames: FrameSocket, role: Role, group: RankGroup) -> None:
        super().__init__(frames, role)
        self.group = group

    def run(self, build: BuildEngine, info: Callable[[Any], dict] | None) -> int:
        try:
            start, _ = self.frames.receive(timeout=None)
        except (EOFError, OSError, ProtocolError):
            start = None
        if not isinstance(start, Start):
            self.group.share(b"")  # the other ranks have nothing to build, and exit
            return 1
        self.group.share(msgspec.msgpack.encode(start))
        self.frames.shared_memory = start.shared_memory
        self.heartbeat_s = start.heartbeat_s
        threading.Thread(target=self._heartbeats, daemon=True, name="openrld-worker-heartbeat").start()
        threading.Thread(target=self._read, daemon=True, name="openrld-worker-reader").start()
        self.busy.set()
        engine, error = _build(build, _own_start(start))
        failed = self.group.agree(error)
        self.busy.clear()
        if failed is not None:
            self.frames.send(failed.failure(0, self.group.world_size, "the worker could not build its engine: "))
            return 1
        self.frames.send(Ready(info=info(engine) if info is not None else {}))
        answers = handlers(self.role, engine)
        while True:
            item = self.inbox.get()
            if item is None:  # Bye, or the daemon is gone
                self.group.share_order(_STOP)
                _close(engine)
                return 0
            call, buffers = item
            if call.id in self.cancelled:
                self.cancelled.discard(call.id)
                self._send(Failure(call.id, "Gone", f"call {call.id} was cancelled before it ran"))
                continue
            self._answer(answers, call, buffers)

    def _answer(self, answers: dict[str, Callable[[tuple], Any]], call: Call, buffers: list[memoryview]) -> None:
        if call.method not in METHODS[self.role] or call.method not in answers:
            # Every rank has the same handlers: none would run it, so none is told.
            self._send(Failure(call.id, "fault", f"this worker has no method {call.method!r}"))
            return
        self.busy.set()
        try:
            order, buffers = self.group.share_order(Order(call.method, call.args, [b.nbytes for b in buffers]), buffers)
            value, error = _perform(answers, self.role, order, buffers)
            encoding, encoded = values.Encoding(), None
            if error is None:
                try:
                    encoded = encoding.encode(value)
                except BaseException as encode_error:  # a value that cannot travel fails the call, on rank 0
                    error = encode_error
            failed = self.group.agree(error)
        finally:
            self.busy.clear()
        if failed is not None:
            self._send(failed.failure(call.id, self.group.world_size))
        else:
            assert encoded is not None  # no rank failed, this one's encoding included
            self._send(Result(call.id, encoded), encoding.buffers)

    def _send(self, message: Any, buffers: Sequence[memoryview] = ()) -> None:
        with contextlib.suppress(OSError):  # the daemon is gone; the reader has queued the stop
            self.frames.send(message, buffers)

    def _daemon_gone(self) -> None:
        if self.busy.is_set():
            # Mid-call the group cannot take a stop; rank 0's exit makes torchrun end every rank.
            os._exit(1)
        self.inbox.put(None)
