"""Adoption: when a job's home node dies, exactly one survivor takes the job over from its auto-save.

Every member runs an `AdoptionWatcher` when the node has a shared checkpoint
root. It looks at the membership view each round; a member newly seen dead
(or gone: a graceful leave, as on a drained or preempted Kubernetes node)
whose last gossip listed jobs that auto-save (`JobNote.autosave_steps`) is
mourned once, and for each of those jobs the watcher decides whether this
node is the one to adopt it:

- **Who.** The candidates are the live members that take jobs (they publish
  devices). They are ordered by rendezvous hashing of the model id with each
  name (`adopter_order`): every survivor that shares the membership view
  computes the same order, so two nodes noticing the death at once pick the
  same adopter, and a job's adopter moves only when that node itself comes or
  goes. The first candidate tries at once; the k-th waits k * `STAGGER_S`, and
  tries only if nobody has claimed the job meanwhile (the first could not
  hold it, or died too).
- **Claim.** Before taking anything over, the node claims the job on the
  shared root (`store/job_claims.py`): an exclusive create of the chain's next
  claim. Views that disagree (a partition, a late gossip) can make two nodes
  try; one claim wins and the other node adopts nothing. Before claiming, the
  node checks that it can hold the job (`JobHost.refusal`: its base model,
  its engines), so a claim is never made by a node that must then give it up.
- **Adopt.** The winner creates the trainer from the newest auto-save, takes
  over the job's model id, step and seq_id (`JobHost.adopt`, actors/job_adoption.py),
  and publishes its gossip payload at once, so that the directory of every
  member sends the job's later calls to it (`directory.py`).

A node that holds a job another node has since claimed (it was declared dead,
yet lived on behind a partition) stops serving it (`JobHost.superseded`): the
watcher checks its own auto-saving jobs' claims every `FENCE_S`.

Without a shared root, or for a job without an auto-save, nothing is adopted:
the job is lost with its node, as before (410 naming its last checkpoint).
File work runs in threads; the decisions here are pure (`adopter_order`,
`candidates`) and tested apart.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import msgspec
import trio

from openrld.autosave import Autosave, latest_autosave
from openrld.cluster.membership.messages import JobNote, MemberState
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import RelayCounters
from openrld.store.job_claims import Claim, is_superseded, latest_claim, try_claim

logger = logging.getLogger(__name__)

WATCH_S = 0.2  # how often the membership view is looked at: a death is acted on this soon after it is known
STAGGER_S = 5.0  # the k-th candidate in a job's order waits k times this before it tries
FENCE_S = 5.0  # how often a node checks that nobody has claimed the jobs it holds
_GONE = (MemberState.DEAD, MemberState.LEFT)


class JobHost(Protocol):
    """What the watcher needs of this node's jobs: their adoption (actors/job_adoption.py)."""

    def is_running(self, model_id: str) -> bool: ...
    def refusal(self, autosave: Autosave) -> str | None: ...
    async def adopt(self, autosave: Autosave, claim: Claim) -> None: ...
    def claimed_jobs(self) -> list[tuple[str, int]]: ...
    def superseded(self, model_id: str, claim: Claim) -> None: ...


class AdoptionStatistics(msgspec.Struct, frozen=True):
    adopted: int  # jobs this node took over from a dead node
    lost_claims: int  # claims another node made first (a split view; the other node adopted)
    refused: int  # jobs this node was first in line for but could not hold (the next candidate takes them)
    failed: int  # adoptions that failed after the claim (logged; the job is lost)
    superseded: int  # jobs this node held that another node had adopted (this node was declared dead)


def adopter_order(model_id: str, names: list[str]) -> list[str]:
    """The candidates in the order they try to adopt job `model_id`: rendezvous (highest random weight)
    hashing, the same on every node that knows the same names, whatever order it lists them in."""

    def weight(name: str) -> bytes:
        return hashlib.sha256(model_id.encode() + b"\0" + name.encode()).digest()

    return sorted(set(names), key=weight, reverse=True)


def candidates(members: list[Member], dead: str) -> list[str]:
    """The members that may adopt a job of `dead`: alive (or suspect) and taking jobs (publishing devices)."""
    return [m.name for m in members if m.is_alive and m.name != dead and m.payload.devices]


class AdoptionWatcher:
    """Adopts the auto-saved jobs of dead members; see the module docstring."""

    def __init__(
        self,
        *,
        local_name: str,
        root: Path,
        members: Callable[[], list[Member]],
        host: JobHost,
        published: Callable[[], None],
        counters: RelayCounters | None = None,
        stagger_s: float = STAGGER_S,
    ) -> None:
        self._counters = counters if counters is not None else RelayCounters()  # adoptions, for /metrics
        self._name = local_name
        self._root = root  # the shared checkpoint root
        self._members = members  # the membership view, this node included
        self._host = host
        self._published = published  # publish this node's gossip payload now
        self._stagger_s = stagger_s
        self._mourned: set[tuple[str, int]] = set()  # (name, incarnation) of the deaths already acted on
        self._busy: set[str] = set()  # model ids being considered here
        self._adopted = self._lost_claims = self._refused = self._failed = self._superseded = 0

    def statistics(self) -> AdoptionStatistics:
        return AdoptionStatistics(self._adopted, self._lost_claims, self._refused, self._failed, self._superseded)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fence_loop)
            task_status.started()
            while True:
                for member, model_id, note in self.newly_dead():
                    self._busy.add(model_id)
                    nursery.start_soon(self._consider, member, model_id, note)
                await trio.sleep(WATCH_S)

    def newly_dead(self) -> list[tuple[Member, str, JobNote]]:
        """The auto-saving jobs of members seen dead or gone since the last call (each death once)."""
        found = []
        for member in self._members():
            key = (member.name, member.incarnation)
            if member.state not in _GONE or member.name == self._name or key in self._mourned:
                continue
            self._mourned.add(key)
            for model_id, note in sorted(member.payload.job_notes.items()):
                if note.autosave_steps > 0 and model_id not in self._busy:
                    found.append((member, model_id, note))
        return found

    async def _consider(self, dead: Member, model_id: str, note: JobNote) -> None:
        try:
            await self._try_adopt(dead, model_id, note)
        except Exception:
            self._failed += 1
            logger.exception("adoption failed node=%s model_id=%s from=%s", self._name, model_id, dead.name)
        finally:
            self._busy.discard(model_id)

    async def _try_adopt(self, dead: Member, model_id: str, note: JobNote) -> None:
        order = adopter_order(model_id, candidates(self._members(), dead.name))
        if self._name not in order:
            return
        rank = order.index(self._name)
        if rank:
            await trio.sleep(rank * self._stagger_s)
            if self._adopted_elsewhere(model_id, dead.name):
                return
            claim = await trio.to_thread.run_sync(latest_claim, self._root, model_id)
            if claim is not None and claim.adopter != dead.name:
                return  # a candidate before this one took it
        if self._host.is_running(model_id):
            return
        autosave = await trio.to_thread.run_sync(latest_autosave, self._root, model_id)
        if autosave is None:
            logger.warning("model_id=%s of dead node %s has no complete auto-save: it is lost", model_id, dead.name)
            return
        refusal = self._host.refusal(autosave)
        if refusal is not None:
            self._refused += 1
            logger.warning("node=%s cannot adopt model_id=%s from %s: %s", self._name, model_id, dead.name, refusal)
            return
        manifest = autosave.manifest
        claim = await trio.to_thread.run_sync(
            partial(
                try_claim, self._root, model_id, adopter=self._name, previous_home=dead.name, step=manifest.step,
                seq_id=manifest.seq_id,
            )
        )
        if claim is None:
            self._lost_claims += 1
            logger.info("model_id=%s from %s: another node claimed it first", model_id, dead.name)
            return
        logger.info(
            "adopting model_id=%s from node=%s step=%d seq_id=%d generation=%d",
            model_id, dead.name, claim.step, claim.seq_id, claim.generation,
        )
        await self._host.adopt(autosave, claim)
        self._adopted += 1
        self._counters.adopted += 1
        self._published()

    def _adopted_elsewhere(self, model_id: str, dead: str) -> bool:
        """Some live member other than the dead home gossips that it is home to the job."""
        return any(m.is_alive and m.name != dead and model_id in m.payload.jobs for m in self._members())

    async def _fence_loop(self) -> None:
        while True:
            await trio.sleep(FENCE_S)
            for model_id, generation in self._host.claimed_jobs():
                newer = await trio.to_thread.run_sync(
                    partial(is_superseded, self._root, model_id, home=self._name, generation=generation)
                )
                if newer is not None and self._host.is_running(model_id):
                    self._superseded += 1
                    logger.warning(
                        "node=%s no longer holds model_id=%s: node %s adopted it (generation %d)",
                        self._name, model_id, newer.adopter, newer.generation,
                    )
                    self._host.superseded(model_id, newer)
