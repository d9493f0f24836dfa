"""Where a job, a sampling session, a session or a future lives: the cluster's job directory.

This module owns the answer to "which node is home to this id?" for a
clustered node, and the placements and relays this node made, which it
remembers because gossip shows them only after a refresh. The truth is, in
order: this node's own tables; what this node placed or relayed itself; the
jobs each member's gossip payload says it is home to; and for session and
request ids, the node tag at the front of the id (`ids.node_tag`).

A home that is dead or has left answers `LOST`, with the note the member
gossiped about the job (owner, base model, last checkpoint). An id nothing
here knows is `UNKNOWN`: the relay may ask the other members before
answering it locally. It never does I/O and never imports torch.
"""

from __future__ import annotations

import enum

import msgspec

from openrld import ids
from openrld.actors.jobs import JobTable
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.cluster.membership.messages import JobNote
from openrld.cluster.membership.node import MembershipNode
from openrld.cluster.membership.table import Member

RECORDS_KEPT = 100_000  # ids remembered from this node's own placements and relays; the oldest go first


class Where(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"
    LOST = "lost"
    UNKNOWN = "unknown"


class Home(msgspec.Struct, frozen=True):
    where: Where
    member: Member | None = None  # REMOTE and LOST: the home node
    note: JobNote | None = None  # LOST, for a job: what its home said of it


LOCAL = Home(Where.LOCAL)
UNKNOWN = Home(Where.UNKNOWN)


class Directory:
    def __init__(self, cluster: MembershipNode, jobs: JobTable, sampling: SamplingSessions) -> None:
        self._cluster = cluster
        self._jobs = jobs
        self._sampling = sampling
        self.local_tag = ids.node_tag(cluster.name)
        self._records: dict[str, str] = {}  # model or sampler id -> node name, from this node's placements and relays
        self._tags: dict[str, str] = {}  # member name -> its node tag

    @property
    def local_name(self) -> str:
        return self._cluster.name

    def record(self, some_id: str, node: str) -> None:
        """`some_id` (a model or sampling session) was created on `node` through this node."""
        self._records.pop(some_id, None)
        self._records[some_id] = node
        if len(self._records) > RECORDS_KEPT:
            del self._records[next(iter(self._records))]

    def model(self, model_id: str) -> Home:
        """The home of a training job (also of its run and its checkpoints).

        A run this node's store holds but does not run (from before a restart,
        or adopted from a shared checkpoint root) is local only if no member
        says it is home to the job: a job lost with its node stays lost here too.
        A job whose home died and that a survivor adopted (cluster/adoption.py)
        is at the live member whose gossip lists it, whatever this node placed
        or relayed before.
        """
        if self._jobs.is_running(model_id):
            return LOCAL
        name = self._records.get(model_id)
        recorded = self._cluster.member(name) if name is not None else None
        if recorded is not None and (recorded.is_alive or recorded.name == self._cluster.name):
            return self._home(recorded, model_id)
        gone = None
        for member in self._cluster.members():
            if member.name == self._cluster.name:
                continue  # this node's own payload may still list a job that has just left it
            if model_id in member.payload.jobs or model_id in member.payload.job_notes:
                if member.is_alive:
                    self.record(model_id, member.name)
                    return Home(Where.REMOTE, member)
                gone = gone or member
        if name is not None:
            return self._home(recorded, model_id)
        if gone is not None:
            return self._home(gone, model_id)
        return LOCAL if self._jobs.has_run(model_id) else UNKNOWN

    def sampler(self, sampler_id: str) -> Home:
        if self._sampling.is_home_to(sampler_id):
            return LOCAL
        name = self._records.get(sampler_id)
        return self._home(self._cluster.member(name), None) if name is not None else UNKNOWN

    def tagged(self, minted_id: str) -> Home:
        """The node that minted a session id, request id or id built on a session id, from its tag."""
        tag = ids.tag_of(minted_id)
        if tag is None or tag == self.local_tag:
            return LOCAL
        for member in self._cluster.members():
            if self._tag_of(member.name) == tag:
                return self._home(member, None)
        return UNKNOWN

    def _tag_of(self, name: str) -> str:
        # A hash per member per retrieve_future adds up in a large cluster; names do not change their tag.
        tag = self._tags.get(name)
        if tag is None:
            tag = self._tags[name] = ids.node_tag(name)
        return tag

    def member(self, name: str) -> Member | None:
        return self._cluster.member(name)

    def members(self) -> list[Member]:
        return self._cluster.members()

    def _home(self, member: Member | None, model_id: str | None) -> Home:
        if member is None:
            return UNKNOWN
        if member.name == self._cluster.name:
            return LOCAL
        if member.is_alive:
            return Home(Where.REMOTE, member)
        note = member.payload.job_notes.get(model_id) if model_id is not None else None
        return Home(Where.LOST, member, note)
