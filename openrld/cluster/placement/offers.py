"""Cross-node placement: a new job is offered to the ranked nodes in turn until one takes it.

The node that got a job-creating request (create_model, a restore whose home
is lost, a base-model sampler on a node that takes no jobs) offers it to the
nodes `ranking` orders. Each offered node checks against its own,
authoritative device pool and either takes the job or refuses for lack of
room; then the next is tried. Any other answer (a bad request, a node that
does not answer) stands, and the job is not placed.

`OfferRound` holds one job's round (pure: no trio, no I/O): which node is
next, and what an answer means. `ClusterPlacer` is the async shell: it asks
each node through a callable it is given (the relay's own app for this node,
the peer client for another), records where the job went, and counts.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

from openrld.cluster.directory import Directory
from openrld.cluster.membership.messages import JobNote
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import RelayCounters
from openrld.cluster.placement.ranking import Booking, JobNeeds, Placer, too_large
from openrld.settings import JobSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Reply(enum.Enum):
    """What an offered node answered."""

    TAKEN = "taken"  # it created the job
    NO_ROOM = "no room"  # it has no room now: the next node is tried
    FAILED = "failed"  # anything else: the answer stands and the job is not placed


def needs_of_settings(settings: JobSettings, base_model: str) -> JobNeeds:
    """What a new job with these settings asks of a node (`base_model` already resolved)."""
    own_group = (
        settings.fine_tuning_type.value == "full" or settings.exclusive or settings.trainer_backend == "automodel"
        or settings.trainer_image is not None or settings.sampler_image is not None
    )
    return JobNeeds(
        base_model=base_model, own_group=own_group,
        is_exclusive=settings.exclusive, devices=settings.trainer_gpus,
    )


def needs_of_note(note: JobNote | None) -> JobNeeds:
    """What a lost job, restored from its checkpoint, asks of its new node (from its home's gossiped note)."""
    return JobNeeds(
        base_model=note.base_model if note is not None else "",
        own_group=note is not None and (note.fine_tuning_type == "full" or note.is_exclusive),
        is_exclusive=note is not None and note.is_exclusive,
    )


class OfferRound:
    """One job's offers: the ranked nodes in turn, each counted by the placer while it is asked."""

    def __init__(
        self, placer: Placer, members: Iterable[Member], needs: JobNeeds, last_resort: str | None = None
    ) -> None:
        self._placer = placer
        self._needs = needs
        self._order = placer.rank(members, needs)  # node names, best first
        if not self._order and last_resort is not None:
            # No node ranks for it in this view, which lags each pool by a refresh: the node that got the
            # request (when it takes jobs) asks its own pool, the authority, rather than refusing unseen.
            self._order = [last_resort]
        self._booking: Booking | None = None  # the node being asked now
        self.refused = 0  # nodes that answered NO_ROOM

    def next(self, member_of: Callable[[str], Member | None]) -> Member | None:
        """The next node to offer the job to, or None when none is left; a node gone since ranking is skipped.

        It is counted before it answers, so that placements running at the same time spread out.
        """
        while self._order:
            member = member_of(self._order.pop(0))
            if member is not None:
                self._booking = self._placer.placed(member, self._needs)
                return member
        return None

    def answered(self, reply: Reply) -> bool:
        """The node asked last answered: True if its answer stands, False if the next node is to be tried."""
        assert self._booking is not None, "answered() before next()"
        if reply is not Reply.TAKEN:
            self._placer.forget(self._booking)
        self._booking = None
        if reply is Reply.NO_ROOM:
            self.refused += 1
            return False
        return True


class ClusterPlacer(Generic[T]):
    """Offers new jobs to the cluster's nodes; the async shell around `OfferRound`."""

    def __init__(self, directory: Directory, counters: RelayCounters, accept_jobs: bool) -> None:
        self._directory = directory
        self._last_resort = directory.local_name if accept_jobs else None  # asked when no node ranks
        self._counters = counters  # placed and refused, for /metrics
        self._placer = Placer()  # remembers this node's recent placements across rounds

    def too_large(self, needs: JobNeeds) -> str | None:
        """Why no node of the cluster can ever take the job (`ranking.too_large`), or None."""
        return too_large(self._directory.members(), needs)

    async def offer(
        self, needs: JobNeeds, created_id: str, ask: Callable[[Member], Awaitable[tuple[Reply, T]]]
    ) -> T | None:
        """The answer of the first node that takes the job or fails it; else the last refusal; None if no node
        was offered it. `ask` offers the job to one node and says what its answer means."""
        offers = OfferRound(self._placer, self._directory.members(), needs, self._last_resort)
        last: T | None = None
        while (member := offers.next(self._directory.member)) is not None:
            reply, answer = await ask(member)
            if offers.answered(reply):
                if reply is Reply.TAKEN:
                    self._counters.placed += 1
                    if member.name != self._directory.local_name:
                        self._directory.record(created_id, member.name)
                    logger.info("placed id=%s node=%s", created_id, member.name)
                return answer
            self._counters.refused += 1
            last = answer
        return last
