"""The membership actor: SWIM failure detection with Lifeguard refinements, over a transport.

`MembershipNode` owns this node's view of the cluster (a `MemberTable`), the
gossip queue, local health and the running suspicions. Its `run` opens one
nursery with four loops: receive (decode, authenticate, apply), probe (one
member per round, round-robin over a shuffled list, with indirect probes
through `indirect_checks` others and nacks from them), gossip (queued updates
to a few random members) and push-pull (full state with one random member,
plus one member believed dead, which is how partitions heal). Updates also
ride on every ping and ack. Suspicions end in Dead after Lifeguard's
shrinking timeout unless the suspect refutes with a higher incarnation; a
suspect that is probed is told of the suspicion in the same packet (buddy
system) so it can refute at once, and a node that hears an accusation older
than what it knows sends the newer Alive straight back to the accuser's packet
(`_answer_stale_accusation`), so a refutation that gossip missed still lands.

Read API for placement and relaying: `members()`, `member(name)`,
`live_members()`, `statistics()`; the node's own payload is changed with
`set_payload`. `join(resolve_seeds)` pushes and pulls with the seeds over their
peer HTTP API, resolving them anew at every attempt while this node is alone (a
headless Service's records may not exist yet when a pod starts); `leave()` tells
the cluster this node is going. Time comes from
`trio.current_time()` and randomness from the injected `random.Random`, so
the protocol runs under trio's MockClock. It never imports torch and never
reaches into another actor.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import trio

from openrld.cluster.membership.awareness import Awareness
from openrld.cluster.membership.broadcasts import BroadcastQueue
from openrld.cluster.membership.codec import (
    HEADER_BYTES,
    BadFrame,
    DropReason,
    decode_push_pull,
    encode_messages,
    encode_push_pull,
    open_datagram,
    seal_datagram,
)
from openrld.cluster.membership.config import (
    MembershipConfig,
    expected_confirmations,
    push_pull_interval_s,
    retransmit_limit,
    suspicion_max_s,
    suspicion_min_s,
)
from openrld.cluster.membership.messages import (
    Ack,
    Alive,
    Broadcast,
    Dead,
    MemberState,
    Message,
    Nack,
    NodePayload,
    Ping,
    PingReq,
    PushPull,
    Suspect,
)
from openrld.cluster.membership.suspicion import Suspicion
from openrld.cluster.membership.table import Member, MemberTable, Outcome
from openrld.cluster.membership.transport import Packet, PeerUnreachable, PushPullClient, Transport

logger = logging.getLogger(__name__)

# Lifeguard: an indirect prober answers "no ack" at 80% of its probe timeout, so
# the nack reaches the requester before the requester's round ends.
_NACK_FRACTION = 0.8


class MembershipStatistics(msgspec.Struct, frozen=True):
    name: str
    incarnation: int
    alive: int
    suspect: int
    dead: int
    left: int
    awareness_score: int
    packets_sent: int
    bytes_sent: int
    packets_received: int
    bytes_received: int
    dropped: dict[str, int]  # datagrams and push-pull bodies dropped, by reason
    push_pulls_ok: int
    push_pulls_failed: int
    refutations: int
    stale_accusations_answered: int  # Alives sent straight back to a node behind on a refutation
    queued_broadcasts: int


class NotRunning(Exception):
    """A push-pull arrived before the protocol started or after this node left."""


class _AckWait:
    __slots__ = ("acked", "nacks")

    def __init__(self) -> None:
        self.acked = trio.Event()
        self.nacks = 0


class MembershipNode:
    def __init__(
        self,
        *,
        name: str,
        config: MembershipConfig,
        key: bytes,
        transport: Transport,
        push_pull: PushPullClient,
        payload: NodePayload,
        rng: random.Random,
    ) -> None:
        self.name = name
        self.config = config
        self._key = key
        self._transport = transport
        self._push_pull = push_pull
        self._rng = rng
        self._table = MemberTable(name, transport.local_addr, payload, trio.current_time())
        self._broadcasts = BroadcastQueue()
        self._has_broadcasts = trio.Event()  # set while updates wait, so an idle gossip loop sleeps
        self._awareness = Awareness(config.awareness_max_multiplier)
        self._suspicions: dict[str, tuple[Suspicion, trio.CancelScope]] = {}
        self._waits: dict[int, _AckWait] = {}
        self._seq = 0
        self._probe_order: list[str] = []
        self._resolve_seeds: Callable[[], Awaitable[Sequence[str]]] | None = None
        self._nursery: trio.Nursery | None = None
        self._counts: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()

    # --- read API

    def members(self) -> list[Member]:
        """Every member known, this node first: alive, suspect, dead and left ones."""
        return self._table.members()

    def member(self, name: str) -> Member | None:
        return self._table.get(name)

    def live_members(self) -> list[Member]:
        return [m for m in self._table.members() if m.is_alive]

    @property
    def local_addr(self) -> str:
        return self._transport.local_addr

    def statistics(self) -> MembershipStatistics:
        states = Counter(m.state for m in self._table.members())
        return MembershipStatistics(
            name=self.name,
            incarnation=self._table.local.incarnation,
            alive=states[MemberState.ALIVE],
            suspect=states[MemberState.SUSPECT],
            dead=states[MemberState.DEAD],
            left=states[MemberState.LEFT],
            awareness_score=self._awareness.score,
            packets_sent=self._counts["packets_sent"],
            bytes_sent=self._counts["bytes_sent"],
            packets_received=self._counts["packets_received"],
            bytes_received=self._counts["bytes_received"],
            dropped=dict(self._dropped),
            push_pulls_ok=self._counts["push_pulls_ok"],
            push_pulls_failed=self._counts["push_pulls_failed"],
            refutations=self._counts["refutations"],
            stale_accusations_answered=self._counts["stale_accusations_answered"],
            queued_broadcasts=len(self._broadcasts),
        )

    # --- this node's own state

    def set_payload(self, payload: NodePayload) -> None:
        """Publish a new payload for this node (gossiped under a new incarnation if it changed)."""
        alive = self._table.set_local_payload(payload, trio.current_time())
        if alive is not None:
            self._queue(alive)

    async def join(self, resolve_seeds: Callable[[], Awaitable[Sequence[str]]]) -> tuple[int, int]:
        """Push-pull with each seed's peer API: (how many answered, how many the seeds resolved to).

        The resolver is kept: while this node knows no live member it resolves
        the seeds again and tries one every push-pull round, so nodes may start
        in any order and a name that resolves late is still found.
        """
        self._resolve_seeds = resolve_seeds
        urls = await resolve_seeds()
        joined = 0
        for url in urls:
            if await self._exchange(url, is_join=True):
                joined += 1
        return joined, len(urls)

    async def leave(self) -> None:
        """Tell live members this node is leaving; it is then LEFT to them, not DEAD.

        The Dead goes straight to up to `gossip_nodes * indirect_checks` members, so
        the news is out before the node stops; they gossip it on.
        """
        dead = self._table.leave()
        self._queue(dead)
        fanout = self.config.gossip_nodes * self.config.indirect_checks
        for member in self._table.sample_others(self._rng, fanout, lambda m: m.is_alive):
            await self._send(member.addr, [dead])

    # --- the actor

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the protocol until cancelled; ready (and answering pings) when started."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # Announce ourselves: a seed gossips a joiner too, but two sources make a lost start rarer.
            self._queue(self._table.local_alive())
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._probe_loop)
            nursery.start_soon(self._gossip_loop)
            nursery.start_soon(self._push_pull_loop)
            logger.info("membership started node=%s addr=%s", self.name, self.local_addr)
            task_status.started()

    def count_dropped(self, reason: DropReason) -> None:
        """Count a push-pull that the peer API refused before it reached the node (no tag)."""
        self._dropped[reason.value] += 1

    def handle_push_pull(self, body: bytes, tag_hex: str) -> tuple[bytes, str]:
        """Serve a peer's push-pull: merge its state, answer with ours.

        Raises:
            BadFrame: a wrong tag or an undecodable body (counted as dropped).
            NotRunning: the protocol has not started yet, or this node has left.
        """
        if self._nursery is None or self._table.local.state is not MemberState.ALIVE:
            raise NotRunning(f"membership of node {self.name} is not running")
        try:
            remote = decode_push_pull(self._key, body, tag_hex)
        except BadFrame as exc:
            self._dropped[exc.reason.value] += 1
            raise
        self._merge(remote)
        # Answer after merging, so a refutation the merge caused goes back at once.
        return encode_push_pull(self._key, PushPull(self.name, False, self._table.records()))

    # --- sending

    def _limit(self) -> int:
        return retransmit_limit(self.config.retransmit_mult, self._table.live_count())

    async def _send(self, addr: str, messages: list[Message]) -> None:
        frame = seal_datagram(self._key, encode_messages(messages))
        self._counts["packets_sent"] += 1
        self._counts["bytes_sent"] += len(frame)
        await self._transport.send(addr, frame)

    async def _send_with_gossip(self, addr: str, messages: list[Message]) -> None:
        """Send `messages` with as many queued updates as fit in the packet."""
        used = HEADER_BYTES + len(encode_messages(messages))
        extra = self._broadcasts.take(self.config.max_packet_bytes - used, self._limit())
        await self._send(addr, [*messages, *extra])

    # --- receiving

    async def _receive_loop(self) -> None:
        while True:
            await self._handle_packet(await self._transport.receive())

    async def _handle_packet(self, packet: Packet) -> None:
        self._counts["packets_received"] += 1
        self._counts["bytes_received"] += len(packet.frame)
        try:
            messages = open_datagram(self._key, packet.frame)
        except BadFrame as exc:
            self._dropped[exc.reason.value] += 1
            logger.debug("dropped datagram node=%s from=%s: %s", self.name, packet.source, exc)
            return
        if self._table.local.state is not MemberState.ALIVE:
            return  # a node that left answers nothing
        for message in messages:
            match message:
                case Ping():
                    if message.target == self.name:
                        await self._send_with_gossip(packet.source, [Ack(message.seq)])
                    else:
                        self._dropped["wrong_target"] += 1
                case PingReq():
                    assert self._nursery is not None
                    self._nursery.start_soon(self._probe_for, message, packet.source)
                case Ack():
                    wait = self._waits.get(message.seq)
                    if wait is not None:
                        wait.acked.set()
                case Nack():
                    wait = self._waits.get(message.seq)
                    if wait is not None:
                        wait.nacks += 1
                case Alive():
                    self._apply(message)
                case Suspect() | Dead():
                    if self._apply(message) is Outcome.IGNORED:
                        await self._answer_stale_accusation(message, packet.source)

    # --- the incarnation rules, applied

    def _apply(self, message: Broadcast, *, gossip: bool = True) -> Outcome:
        now = trio.current_time()
        match message:
            case Alive():
                outcome = self._table.apply_alive(message, now)
            case Suspect():
                outcome = self._table.apply_suspect(message, now)
            case Dead():
                outcome = self._table.apply_dead(message, now)
        if outcome is Outcome.REFUTE:
            self._refute(message.incarnation)
            return outcome
        if outcome is Outcome.IGNORED:
            return outcome
        if outcome is Outcome.NEW_SUSPICION:
            assert isinstance(message, Suspect)
            self._start_suspicion(message)
        elif outcome is Outcome.CONFIRMATION:
            assert isinstance(message, Suspect)
            if not self._confirm_suspicion(message):
                return Outcome.IGNORED
        else:
            self._end_suspicion(message.name)
            if isinstance(message, Dead):
                logger.info(
                    "member %s node=%s member=%s incarnation=%d by=%s",
                    "left" if message.source == message.name else "dead",
                    self.name, message.name, message.incarnation, message.source,
                )
        if gossip:
            self._queue(message)
        return outcome

    async def _answer_stale_accusation(self, message: Suspect | Dead, source: str) -> None:
        """Send the newer Alive straight back to a node that accuses a member at an old incarnation.

        The sender is behind: its queue keeps one update per member, so it would be gossiping
        the member's refutation if it had heard it. Gossip alone can miss it: the refutation
        leaves every queue after its retransmit limit, and the sender's own suspicion timer (a
        node that hears of a suspicion times it as the accuser does) then declares a live member
        dead. Under 20% loss that happened in 9 of 12 forty-node runs of 150 probe rounds
        (`tests/cluster/membership/test_membership_simulation.py`). One datagram per stale
        accusation received, and only while stale ones circulate.
        """
        member = self._table.get(message.name)
        if member is None or member.state is not MemberState.ALIVE or member.incarnation <= message.incarnation:
            return
        self._counts["stale_accusations_answered"] += 1
        await self._send(source, [Alive(member.name, member.incarnation, member.addr, member.payload)])

    def _refute(self, accused_incarnation: int) -> None:
        # Being accused suggests this node is the slow one (Lifeguard).
        self._awareness.apply(1)
        self._counts["refutations"] += 1
        alive = self._table.refute(accused_incarnation, trio.current_time())
        logger.info("refuting node=%s incarnation=%d", self.name, alive.incarnation)
        self._queue(alive)

    def _start_suspicion(self, message: Suspect) -> None:
        self._end_suspicion(message.name)
        n = self._table.live_count()
        suspicion = Suspicion(
            accuser=message.source,
            started_s=trio.current_time(),
            minimum_s=suspicion_min_s(self.config, n),
            maximum_s=suspicion_max_s(self.config, n),
            expected=expected_confirmations(self.config, n),
        )
        scope = trio.CancelScope(deadline=suspicion.deadline_s)
        self._suspicions[message.name] = (suspicion, scope)
        assert self._nursery is not None
        self._nursery.start_soon(self._suspicion_timer, message.name, message.incarnation, suspicion, scope)

    def _confirm_suspicion(self, message: Suspect) -> bool:
        entry = self._suspicions.get(message.name)
        if entry is None or not entry[0].confirm(message.source):
            return False
        entry[1].deadline = entry[0].deadline_s
        return True

    def _end_suspicion(self, name: str) -> None:
        entry = self._suspicions.pop(name, None)
        if entry is not None:
            entry[1].cancel()

    async def _suspicion_timer(self, name: str, incarnation: int, suspicion: Suspicion, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep_forever()
        entry = self._suspicions.get(name)
        if entry is None or entry[0] is not suspicion:
            return  # refuted, or superseded by a newer suspicion
        del self._suspicions[name]
        self._apply(Dead(name, incarnation, self.name))

    # --- probing

    def _next_probe_target(self) -> Member | None:
        """Round-robin over a shuffled list of the other live members."""
        while True:
            if not self._probe_order:
                self._probe_order = [m.name for m in self._table.others() if m.is_alive]
                self._rng.shuffle(self._probe_order)
                if not self._probe_order:
                    return None
            member = self._table.get(self._probe_order.pop())
            if member is not None and member.is_alive:
                return member

    async def _probe_loop(self) -> None:
        await trio.sleep(self._rng.uniform(0.0, self.config.probe_interval_s))
        while True:
            round_ends_s = trio.current_time() + self._awareness.scale(self.config.probe_interval_s)
            target = self._next_probe_target()
            if target is not None:
                await self._probe(target, round_ends_s)
            await trio.sleep_until(round_ends_s)

    def _new_wait(self) -> tuple[int, _AckWait]:
        self._seq += 1
        wait = _AckWait()
        self._waits[self._seq] = wait
        return self._seq, wait

    async def _probe(self, target: Member, round_ends_s: float) -> None:
        seq, wait = self._new_wait()
        try:
            messages: list[Message] = [Ping(seq, target.name, self.name)]
            if target.state is MemberState.SUSPECT:
                # Buddy system: tell the suspect directly, so it can refute now.
                messages.append(Suspect(target.name, target.incarnation, self.name))
            await self._send_with_gossip(target.addr, messages)
            with trio.move_on_after(self._awareness.scale(self.config.probe_timeout_s)):
                await wait.acked.wait()
            if wait.acked.is_set():
                self._awareness.apply(-1)
                return
            helpers = self._table.sample_others(
                self._rng, self.config.indirect_checks, lambda m: m.is_alive and m.name != target.name
            )
            for helper in helpers:
                await self._send(helper.addr, [PingReq(seq, target.name, target.addr, self.name)])
            # And one more direct ping on the same seq: a second path that needs no helper, as a
            # TCP ping is in other SWIM implementations. Under 10% loss it makes a false suspicion
            # about five times rarer (0.19 x 0.19 x 0.344^3 against 0.19 x 0.344^3 per probe).
            await self._send(target.addr, [Ping(seq, target.name, self.name)])
            with trio.move_on_at(round_ends_s):
                await wait.acked.wait()
            if wait.acked.is_set():
                return
            # Missing nacks mean our own messages are not getting through: we may be the sick one.
            self._awareness.apply(len(helpers) - wait.nacks if helpers else 1)
            current = self._table.get(target.name)
            if current is not None and current.is_alive:
                self._apply(Suspect(current.name, current.incarnation, self.name))
        finally:
            del self._waits[seq]

    async def _probe_for(self, request: PingReq, requester: str) -> None:
        """Ping `request.target` for a member that could not reach it; ack or nack back."""
        seq, wait = self._new_wait()
        try:
            await self._send(request.target_addr, [Ping(seq, request.target, self.name)])
            with trio.move_on_after(self._awareness.scale(self.config.probe_timeout_s * _NACK_FRACTION)):
                await wait.acked.wait()
            await self._send(requester, [Ack(request.seq) if wait.acked.is_set() else Nack(request.seq)])
        finally:
            del self._waits[seq]

    # --- gossip

    def _queue(self, message: Broadcast) -> None:
        self._broadcasts.queue(message)
        self._has_broadcasts.set()

    async def _gossip_loop(self) -> None:
        await trio.sleep(self._rng.uniform(0.0, self.config.gossip_interval_s))
        while True:
            if not self._broadcasts:
                # Nothing to say: wait for news rather than wake up every interval for nothing.
                self._has_broadcasts = trio.Event()
                await self._has_broadcasts.wait()
            await trio.sleep(self.config.gossip_interval_s)
            now = trio.current_time()
            # The recently dead get gossip too: if they are alive after all, they hear it and refute.
            def gossiped_to(m: Member, now: float = now) -> bool:
                return m.is_alive or (
                    m.state is MemberState.DEAD and now - m.state_since_s < self.config.gossip_to_the_dead_s
                )

            targets = self._table.sample_others(self._rng, self.config.gossip_nodes, gossiped_to)
            for member in targets:
                messages = self._broadcasts.take(self.config.max_packet_bytes - HEADER_BYTES, self._limit(), at_least_one=True)
                if not messages:
                    break
                await self._send(member.addr, list(messages))

    # --- push-pull

    async def _push_pull_loop(self) -> None:
        # The first exchange comes early, once the gossip about this node's start has
        # spread: a joiner then learns of members that joined alongside it, whom its
        # seed had not heard of yet.
        first_s = retransmit_limit(self.config.retransmit_mult, self._table.live_count()) * self.config.gossip_interval_s
        await trio.sleep(self._rng.uniform(1.0, 2.0) * first_s)
        while True:
            self._table.reap(trio.current_time(), self.config.dead_reclaim_s)
            others = self._table.others()
            live = [m for m in others if m.is_alive and m.peer_url]
            if live:
                await self._exchange(self._rng.choice(live).peer_url, is_join=False)
            elif self._resolve_seeds is not None:
                seeds = await self._resolve_seeds()
                if seeds:
                    await self._exchange(self._rng.choice(seeds), is_join=True)
            # Reconnect: one member believed dead, so that a healed partition merges again.
            dead = [m for m in others if m.state is MemberState.DEAD and m.peer_url]
            if dead:
                await self._exchange(self._rng.choice(dead).peer_url, is_join=False)
            interval_s = push_pull_interval_s(self.config, self._table.live_count())
            await trio.sleep(self._rng.uniform(0.5, 1.0) * interval_s)

    async def _exchange(self, peer_url: str, *, is_join: bool) -> bool:
        body, tag = encode_push_pull(self._key, PushPull(self.name, is_join, self._table.records()))
        answer: tuple[bytes, str] | None = None
        with trio.move_on_after(self.config.push_pull_timeout_s):
            try:
                answer = await self._push_pull.exchange(peer_url, body, tag)
            except PeerUnreachable as exc:
                logger.debug("push-pull node=%s peer=%s failed: %s", self.name, peer_url, exc)
        if answer is None:
            self._counts["push_pulls_failed"] += 1
            return False
        try:
            remote = decode_push_pull(self._key, *answer)
        except BadFrame as exc:
            self._dropped[exc.reason.value] += 1
            self._counts["push_pulls_failed"] += 1
            return False
        self._counts["push_pulls_ok"] += 1
        self._counts["bytes_sent"] += len(body)
        self._counts["bytes_received"] += len(answer[0])
        self._merge(remote, is_own_join=is_join)
        return True

    def _merge(self, remote: PushPull, *, is_own_join: bool = False) -> None:
        """Apply a peer's full state, gossiping on what was news here (but for a join).

        What a periodic exchange brings that this node lacked, others probably lack
        too, so it is gossiped on; what this node already knew is ignored and costs
        nothing. A joiner, though, learns the whole cluster from its seed, news to
        it alone: it gossips only the seed's own state, and its first periodic
        exchange, soon after (see `_push_pull_loop`), fills what the seed lacked.
        A member the peer believes suspect or dead becomes suspect here (never dead
        at once), so this node's own timers and the member's refutation decide.
        """
        for record in remote.members:
            gossip = not is_own_join or record.name == remote.source
            if record.state is MemberState.ALIVE or (
                record.state is MemberState.SUSPECT and self._table.get(record.name) is None
            ):
                self._apply(Alive(record.name, record.incarnation, record.addr, record.payload), gossip=gossip)
            if record.state in (MemberState.SUSPECT, MemberState.DEAD):
                self._apply(Suspect(record.name, record.incarnation, remote.source))
            elif record.state is MemberState.LEFT:
                self._apply(Dead(record.name, record.incarnation, record.name), gossip=gossip)
