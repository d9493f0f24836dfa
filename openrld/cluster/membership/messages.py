"""What members say to each other: datagram messages, push-pull bodies, and each member's payload.

Every message is a frozen msgspec Struct encoded as a msgpack array (field
names never go on the wire) with an integer tag first. Tags are append-only:
a tag, once used, keeps its meaning forever; new messages take new tags and a
new protocol version. This module holds data only: no I/O, no decisions.
"""

from __future__ import annotations

import enum

import msgspec

# The versions this build speaks: the frame's first byte (codec.py) must lie in this range.
PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1


class MemberState(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3  # declared dead by itself: a graceful leave, never refuted


class DeviceSlot(msgspec.Struct, frozen=True, array_like=True):
    """One accelerator (or the CPU) on the node."""

    name: str  # "cpu", "cuda:0"
    kind: str  # "cpu", "cuda"
    memory_bytes: int
    free_bytes: int
    groups: int = 0  # worker groups placed on it (0: free for a new group)
    is_exclusive: bool = False  # held by an exclusive job: nothing else may be placed on it


class GroupLoad(msgspec.Struct, frozen=True, array_like=True):
    """One resident worker group: its base model, LoRA adapters in use, queued requests."""

    base_model: str
    adapters: int
    queue_depth: int


class JobNote(msgspec.Struct, frozen=True, array_like=True):
    """A job this node is home to, as the cluster reports it once the node is dead."""

    owner: str
    base_model: str
    fine_tuning_type: str  # "lora" or "full"
    is_exclusive: bool
    last_checkpoint: str = ""  # the newest weights/ checkpoint's tinker path; "" when it has none
    # optim_steps between the job's auto-saves on the shared checkpoint root (openrl.autosave_steps); 0: none,
    # and then no survivor can adopt it (cluster/adoption.py)
    autosave_steps: int = 0


class NodePayload(msgspec.Struct, frozen=True, array_like=True):
    """What a member tells the cluster about itself, besides being alive."""

    peer_url: str = ""  # the node's HTTP API, where push-pull and relayed requests go
    devices: tuple[DeviceSlot, ...] = ()
    groups: tuple[GroupLoad, ...] = ()
    jobs: tuple[str, ...] = ()  # model ids this node is home to
    # What the others need to say of a job if this node dies: keyed by model id.
    job_notes: dict[str, JobNote] = msgspec.field(default_factory=dict)
    segment: str = ""  # its network segment (config network_segment): a trainer that spans nodes keeps to one


class Ping(msgspec.Struct, frozen=True, array_like=True, tag=1):
    seq: int
    target: str  # the name the sender means; a node that is someone else ignores it
    source: str


class PingReq(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """Ask the receiver to ping `target` at `target_addr` and tell us if it answered."""

    seq: int
    target: str
    target_addr: str
    source: str


class Ack(msgspec.Struct, frozen=True, array_like=True, tag=3):
    seq: int


class Nack(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """From an indirect prober whose target stayed silent: "I am alive, it did not answer"."""

    seq: int


class Alive(msgspec.Struct, frozen=True, array_like=True, tag=5):
    name: str
    incarnation: int
    addr: str
    payload: NodePayload


class Suspect(msgspec.Struct, frozen=True, array_like=True, tag=6):
    name: str
    incarnation: int
    source: str  # who suspects it: each distinct source is one confirmation


class Dead(msgspec.Struct, frozen=True, array_like=True, tag=7):
    """`source == name` means the node left gracefully."""

    name: str
    incarnation: int
    source: str


Message = Ping | PingReq | Ack | Nack | Alive | Suspect | Dead
Broadcast = Alive | Suspect | Dead  # the messages that are gossiped


class MemberRecord(msgspec.Struct, frozen=True, array_like=True):
    """One member as a push-pull carries it."""

    name: str
    addr: str
    incarnation: int
    state: MemberState
    payload: NodePayload


class PushPull(msgspec.Struct, frozen=True, array_like=True):
    """A full-state exchange: the request and the answer have the same shape."""

    source: str
    is_join: bool
    members: tuple[MemberRecord, ...]
