"""An in-memory network for running many members in one trio run, under the fake clock.

`FakeNetwork` delivers datagrams between transports by name after a random
delay (or at once, with a zero delay, which costs no timer per packet), loses each with probability `loss`, and refuses anything across a
partition or to a crashed node; push-pull exchanges go through it as calls
to the peer's `handle_push_pull`, with the same delay and partition rules
but no loss (they stand for TCP). One delivery task (`run`) holds every
packet in flight in a heap, so a thousand nodes cost no task per packet.
Bytes are counted per sender, for the gossip-cost benchmark. It is for
tests and benchmarks only; production uses `UdpTransport` and `HttpPushPull`.
"""

from __future__ import annotations

import contextlib
import heapq
import random
from collections import Counter
from collections.abc import Callable, Iterable

import trio

from openrld.cluster.membership.codec import BadFrame
from openrld.cluster.membership.node import NotRunning
from openrld.cluster.membership.transport import Packet, PeerUnreachable

# A node's inbox holds this many datagrams; more are dropped, as a kernel drops
# datagrams when a socket's receive buffer is full.
INBOX_DATAGRAMS = 512

FAKE_URL_PREFIX = "fake://"

PushPullHandler = Callable[[bytes, str], tuple[bytes, str]]


class FakeNetwork:
    def __init__(self, rng: random.Random, *, loss: float = 0.0, min_delay_s: float = 0.001, max_delay_s: float = 0.005) -> None:
        self._rng = rng
        self.loss = loss
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self._inboxes: dict[str, trio.MemorySendChannel[Packet]] = {}
        self._handlers: dict[str, PushPullHandler] = {}
        self._side: dict[str, int] = {}  # partition side per name; absent = side 0
        self._crashed: set[str] = set()
        self._in_flight: list[tuple[float, int, str, Packet]] = []
        self._order = 0
        self._wake = trio.Event()
        self.bytes_sent: Counter[str] = Counter()
        self.push_pull_bytes: Counter[str] = Counter()

    # --- nodes

    def new_transport(self, name: str) -> FakeTransport:
        send, receive = trio.open_memory_channel[Packet](INBOX_DATAGRAMS)
        self._inboxes[name] = send
        self._crashed.discard(name)
        return FakeTransport(self, name, receive)

    def push_pull_client(self, name: str) -> FakePushPull:
        return FakePushPull(self, name)

    def serve_push_pull(self, name: str, handler: PushPullHandler) -> None:
        self._handlers[name] = handler

    @staticmethod
    def url(name: str) -> str:
        return FAKE_URL_PREFIX + name

    # --- faults

    def crash(self, name: str) -> None:
        """The node stops answering anything, at once (its tasks are the caller's to cancel)."""
        self._crashed.add(name)

    def partition(self, sides: Iterable[Iterable[str]]) -> None:
        """Split the network: nodes on different sides cannot reach each other."""
        self._side = {name: index for index, side in enumerate(sides, start=1) for name in side}

    def heal(self) -> None:
        self._side = {}

    def can_reach(self, source: str, dest: str) -> bool:
        return (
            dest in self._inboxes
            and dest not in self._crashed
            and source not in self._crashed
            and self._side.get(source, 0) == self._side.get(dest, 0)
        )

    def delay_s(self) -> float:
        return self._rng.uniform(self.min_delay_s, self.max_delay_s)

    # --- delivery

    def send(self, source: str, dest: str, frame: bytes) -> None:
        self.bytes_sent[source] += len(frame)
        if not self.can_reach(source, dest) or self._rng.random() < self.loss:
            return
        if self.max_delay_s == 0.0:
            self._deliver(dest, Packet(frame, source))  # no timer per packet: the cheapest simulation
            return
        self._order += 1
        heapq.heappush(self._in_flight, (trio.current_time() + self.delay_s(), self._order, dest, Packet(frame, source)))
        self._wake.set()

    async def run(self) -> None:
        """Deliver packets when their time comes; run it in the simulation's nursery."""
        while True:
            if not self._in_flight:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            with trio.move_on_at(self._in_flight[0][0]):
                await self._wake.wait()  # an earlier packet may be sent meanwhile
            if self._wake.is_set():
                self._wake = trio.Event()
            now = trio.current_time()
            while self._in_flight and self._in_flight[0][0] <= now:
                _, _, dest, packet = heapq.heappop(self._in_flight)
                self._deliver(dest, packet)

    def _deliver(self, dest: str, packet: Packet) -> None:
        if dest in self._crashed:
            return
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self._inboxes[dest].send_nowait(packet)  # a full or closed inbox loses the datagram

    async def exchange(self, source: str, peer_url: str, body: bytes, tag_hex: str) -> tuple[bytes, str]:
        dest = peer_url.removeprefix(FAKE_URL_PREFIX)
        self.push_pull_bytes[source] += len(body)
        if not self.can_reach(source, dest) or dest not in self._handlers:
            raise PeerUnreachable(f"{dest} is unreachable from {source}")
        if self.max_delay_s:
            await trio.sleep(self.delay_s())
        try:
            answer = self._handlers[dest](body, tag_hex)
        except (BadFrame, NotRunning) as exc:
            raise PeerUnreachable(f"{dest} refused the push-pull: {exc}") from exc
        if self.max_delay_s:
            await trio.sleep(self.delay_s())
        if not self.can_reach(source, dest):
            raise PeerUnreachable(f"{dest} became unreachable from {source}")
        self.push_pull_bytes[dest] += len(answer[0])
        return answer


class FakeTransport:
    def __init__(self, network: FakeNetwork, name: str, inbox: trio.MemoryReceiveChannel[Packet]) -> None:
        self._network = network
        self._name = name
        self._inbox = inbox

    @property
    def local_addr(self) -> str:
        return self._name

    async def send(self, addr: str, frame: bytes) -> None:
        self._network.send(self._name, addr, frame)

    async def receive(self) -> Packet:
        return await self._inbox.receive()

    async def aclose(self) -> None:
        await self._inbox.aclose()


class FakePushPull:
    def __init__(self, network: FakeNetwork, name: str) -> None:
        self._network = network
        self._name = name

    async def exchange(self, peer_url: str, body: bytes, tag_hex: str) -> tuple[bytes, str]:
        return await self._network.exchange(self._name, peer_url, body, tag_hex)
