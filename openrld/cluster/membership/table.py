"""The member table: who is in the cluster, in which state, under the incarnation rules.

`MemberTable` is pure: it takes Alive/Suspect/Dead updates and a time, and
answers what the update did (`Outcome`), so that the node decides what to
gossip, which timers to start and when to refute. It guarantees SWIM's
ordering: an update about a member counts only if its incarnation is newer
than what is known (or, for a suspicion, as new as it); only the member
itself raises its own incarnation, which is how it refutes; dead and left
members stay dead until they come back with a higher incarnation. It does
no I/O and keeps no timers.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable

import msgspec

from openrld.cluster.membership.messages import Alive, Dead, MemberRecord, MemberState, NodePayload, Suspect


class Member(msgspec.Struct, frozen=True):
    """One member as this node sees it: the read API that placement and relaying use."""

    name: str
    addr: str  # its gossip address, "host:port"
    incarnation: int
    state: MemberState
    payload: NodePayload
    state_since_s: float  # trio time at which this node saw the state begin

    @property
    def peer_url(self) -> str:
        return self.payload.peer_url

    @property
    def is_alive(self) -> bool:
        """Alive or suspect: a suspect is still a member until the suspicion ends."""
        return self.state in (MemberState.ALIVE, MemberState.SUSPECT)


class Outcome(enum.Enum):
    IGNORED = "ignored"  # stale, or about someone unknown: nothing to do
    APPLIED = "applied"  # the table changed: gossip the update on
    NEW_SUSPICION = "new_suspicion"  # start a suspicion timer, gossip it on
    CONFIRMATION = "confirmation"  # one more accuser of a current suspicion
    REFUTE = "refute"  # the update accuses this node: raise the incarnation and gossip Alive


class MemberTable:
    """Members by name, this node included."""

    def __init__(self, local_name: str, local_addr: str, payload: NodePayload, now_s: float) -> None:
        self.local_name = local_name
        self._members: dict[str, Member] = {
            local_name: Member(local_name, local_addr, 0, MemberState.ALIVE, payload, now_s)
        }
        self._live = 1  # kept in step by _put: the gossip path asks for it on every packet
        self._other_names: list[str] = []  # for sampling without scanning every member

    def _put(self, member: Member) -> None:
        old = self._members.get(member.name)
        if old is None and member.name != self.local_name:
            self._other_names.append(member.name)
        self._live += int(member.is_alive) - int(old is not None and old.is_alive)
        self._members[member.name] = member

    # --- reads

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    @property
    def local(self) -> Member:
        return self._members[self.local_name]

    def members(self) -> list[Member]:
        """Every known member, this node first, then by name."""
        others = sorted((m for n, m in self._members.items() if n != self.local_name), key=lambda m: m.name)
        return [self.local, *others]

    def others(self) -> list[Member]:
        return [m for n, m in self._members.items() if n != self.local_name]

    def sample_others(self, rng: random.Random, k: int, accept: Callable[[Member], bool]) -> list[Member]:
        """Up to k distinct other members that `accept` takes, chosen uniformly at random.

        Rejection sampling over the names: in a healthy cluster nearly every member is
        accepted, so this costs O(k) where filtering every member would cost O(n) on
        every gossip round. After a few misses in a row it falls back to a full scan.
        """
        chosen: dict[str, Member] = {}
        misses = 0
        names = self._other_names
        while len(chosen) < k and names and misses < 3 * k + 3:
            member = self._members[names[rng.randrange(len(names))]]
            if member.name not in chosen and accept(member):
                chosen[member.name] = member
                misses = 0
            else:
                misses += 1
        if len(chosen) < k and names:
            rest = [m for m in self.others() if m.name not in chosen and accept(m)]
            chosen.update((m.name, m) for m in rng.sample(rest, min(k - len(chosen), len(rest))))
        return list(chosen.values())

    def live_count(self) -> int:
        """Members alive or suspect, this node included: the n of the timer math."""
        return self._live

    def records(self) -> tuple[MemberRecord, ...]:
        return tuple(MemberRecord(m.name, m.addr, m.incarnation, m.state, m.payload) for m in self._members.values())

    def local_alive(self) -> Alive:
        me = self.local
        return Alive(me.name, me.incarnation, me.addr, me.payload)

    # --- the local member's own changes

    def refute(self, accused_incarnation: int, now_s: float) -> Alive:
        """Raise this node's incarnation above an accusation; the Alive to gossip."""
        me = self.local
        incarnation = max(me.incarnation, accused_incarnation) + 1
        self._put(msgspec.structs.replace(me, incarnation=incarnation))
        return self.local_alive()

    def set_local_payload(self, payload: NodePayload, now_s: float) -> Alive | None:
        """A new payload for this node, under a new incarnation; None if it did not change."""
        me = self.local
        if payload == me.payload:
            return None
        self._put(msgspec.structs.replace(me, payload=payload, incarnation=me.incarnation + 1))
        return self.local_alive()

    def leave(self) -> Dead:
        """Mark this node as left; the Dead (source = itself) to gossip."""
        me = self.local
        self._put(msgspec.structs.replace(me, state=MemberState.LEFT))
        return Dead(me.name, me.incarnation, me.name)

    # --- updates from others

    def apply_alive(self, msg: Alive, now_s: float) -> Outcome:
        if msg.name == self.local_name:
            me = self.local
            # Our own Alive coming back is stale news; one that is newer than ours, or the
            # same incarnation saying something else, was made by an earlier life of this node
            # or by an impostor: outbid it.
            is_conflict = msg.incarnation > me.incarnation or (
                msg.incarnation == me.incarnation and (msg.addr, msg.payload) != (me.addr, me.payload)
            )
            return Outcome.REFUTE if is_conflict and me.state is MemberState.ALIVE else Outcome.IGNORED
        known = self._members.get(msg.name)
        if known is not None and msg.incarnation <= known.incarnation:
            return Outcome.IGNORED
        since = known.state_since_s if known is not None and known.state is MemberState.ALIVE else now_s
        self._put(Member(msg.name, msg.addr, msg.incarnation, MemberState.ALIVE, msg.payload, since))
        return Outcome.APPLIED

    def apply_suspect(self, msg: Suspect, now_s: float) -> Outcome:
        if msg.name == self.local_name:
            me = self.local
            if msg.incarnation >= me.incarnation and me.state is MemberState.ALIVE:
                return Outcome.REFUTE
            return Outcome.IGNORED
        known = self._members.get(msg.name)
        if known is None or not known.is_alive or msg.incarnation < known.incarnation:
            return Outcome.IGNORED
        if known.state is MemberState.SUSPECT and msg.incarnation == known.incarnation:
            return Outcome.CONFIRMATION
        self._put(msgspec.structs.replace(
            known, incarnation=msg.incarnation, state=MemberState.SUSPECT, state_since_s=now_s
        ))
        return Outcome.NEW_SUSPICION

    def apply_dead(self, msg: Dead, now_s: float) -> Outcome:
        if msg.name == self.local_name:
            me = self.local
            if me.state is MemberState.ALIVE and msg.incarnation >= me.incarnation:
                return Outcome.REFUTE
            return Outcome.IGNORED
        known = self._members.get(msg.name)
        if known is None or not known.is_alive or msg.incarnation < known.incarnation:
            return Outcome.IGNORED
        state = MemberState.LEFT if msg.source == msg.name else MemberState.DEAD
        self._put(msgspec.structs.replace(known, incarnation=msg.incarnation, state=state, state_since_s=now_s))
        return Outcome.APPLIED

    def reap(self, now_s: float, dead_reclaim_s: float) -> list[str]:
        """Forget members dead or left for longer than `dead_reclaim_s`; their names."""
        gone = [
            m.name
            for m in self.others()
            if not m.is_alive and now_s - m.state_since_s >= dead_reclaim_s
        ]
        for name in gone:
            del self._members[name]
        if gone:
            self._other_names = [name for name in self._other_names if name in self._members]
        return gone
