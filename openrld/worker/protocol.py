"""The worker protocol's messages: what a daemon and a worker say to each other.

One connection per worker, a Unix stream socket; each message is one frame
(`frames.py`). The order of a worker's life:

    worker -> Hello      version, the token it was started with, what it can do
    daemon -> Start      what to build (a built-in engine's kind, the model, the device)
    worker -> Ready      or Failure(id 0): the build failed, and why
    daemon -> Call       one engine method and its arguments; one call at a time
    worker -> Result     or Failure, with the call's id; Heartbeat while a call runs
    daemon -> Cancel     the call in flight need not finish (a worker may still answer it)
    daemon -> Bye        finish the call in hand, then exit

Tags are append-only: a new message gets a new tag, an old tag never changes
meaning. `PROTOCOL_VERSION` goes up when a message changes shape; a worker
whose Hello states another version is refused with both versions named.
Arguments and results are msgpack values (`values.py`), with tensors as
extension values that point at the frame's raw buffers.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1

Scalar = str | int | float | bool
Role = Literal["trainer", "sampler"]


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    version: int
    token: str  # the one the daemon gave this worker's launch; proves it is that worker
    role: Role
    pid: int
    # "shared_memory": it can send and take buffers as sealed memfds over the socket.
    capabilities: list[str] = []
    engine: str = ""  # what the worker calls itself, for logs: "builtin", "my-trainer:1.2"


class Start(msgspec.Struct, frozen=True, tag="start", forbid_unknown_fields=True):
    kind: str  # a built-in engine, one of `builtin.KINDS`: "lora_trainer", "full_sampler", "vllm_full_sampler", ...
    model_dir: str  # the base model's directory, as the worker sees it
    device: str  # "cpu", "cuda", "cuda:0": the device as the worker sees it
    threads: int | None = None  # torch intra-op threads; None: torch's default
    shared_memory: bool = False  # both ends can: large buffers travel as sealed memfds (frames.py)
    heartbeat_s: float = 2.0  # how often to send a Heartbeat while building or running a call
    options: dict[str, Scalar] = {}  # the kind's own settings: max_batch_tokens, weight_sync, ...


class Ready(msgspec.Struct, frozen=True, tag="ready", forbid_unknown_fields=True):
    info: dict[str, Scalar] = {}  # facts the daemon may use: vocab_size, max_context, ...


class Call(msgspec.Struct, frozen=True, tag="call", forbid_unknown_fields=True):
    id: int
    method: str
    args: msgspec.Raw  # a msgpack array, decoded by the method's argument types (values.py)


class Result(msgspec.Struct, frozen=True, tag="result", forbid_unknown_fields=True):
    id: int
    value: msgspec.Raw


class Failure(msgspec.Struct, frozen=True, tag="failure", forbid_unknown_fields=True):
    """A call (or, with id 0, the build) failed. `kind` names the error class (values.py
    maps the known ones back; any other is a fault of the worker's)."""

    id: int
    kind: str
    message: str
    key: str | None = None  # the openrl.* setting a BadRequest names
    trace: str = ""  # the worker's traceback, for the daemon's log


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True):
    busy: bool = False  # a call is running


class Cancel(msgspec.Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    id: int


class Bye(msgspec.Struct, frozen=True, tag="bye", forbid_unknown_fields=True):
    pass


Message = Hello | Start | Ready | Call | Result | Failure | Heartbeat | Cancel | Bye
