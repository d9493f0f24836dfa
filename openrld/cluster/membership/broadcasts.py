"""The queue of membership updates waiting to be gossiped, piggybacked on other packets.

Each update is sent in up to `retransmit_limit` packets and then dropped.
Only the newest update about a member is kept: a later Alive, Suspect or
Dead about the same name replaces the one queued before it. Packets are
filled with the least-sent updates first, within a byte budget, so fresh
news goes out before news most nodes have heard. Pure: no I/O, no clock.
"""

from __future__ import annotations

from openrld.cluster.membership.codec import encoded_size
from openrld.cluster.membership.messages import Broadcast

# msgpack puts an array header of up to 3 bytes in front of the messages in a datagram.
_ARRAY_HEADER_BYTES = 3


class _Queued:
    __slots__ = ("message", "size", "transmits", "order")

    def __init__(self, message: Broadcast, size: int, order: int) -> None:
        self.message = message
        self.size = size
        self.transmits = 0
        self.order = order


class BroadcastQueue:
    def __init__(self) -> None:
        self._by_name: dict[str, _Queued] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._by_name)

    def queue(self, message: Broadcast) -> None:
        self._order += 1
        self._by_name[message.name] = _Queued(message, encoded_size(message), self._order)

    def take(self, budget_bytes: int, limit: int, *, at_least_one: bool = False) -> list[Broadcast]:
        """Updates that fit in `budget_bytes`, each counted as sent once more.

        Args:
            budget_bytes: room left in the packet.
            limit: the retransmit limit; an update sent that many times leaves the queue.
            at_least_one: take the first update even if it alone is over the budget
                (it then goes in a datagram of its own).

        Returns:
            The updates, least-sent and then newest first.
        """
        budget = budget_bytes - _ARRAY_HEADER_BYTES
        taken: list[Broadcast] = []
        for entry in sorted(self._by_name.values(), key=lambda e: (e.transmits, -e.order)):
            if entry.size > budget and not (at_least_one and not taken):
                continue
            budget -= entry.size
            taken.append(entry.message)
            entry.transmits += 1
            if entry.transmits >= limit:
                del self._by_name[entry.message.name]
            if budget <= 0:
                break
        return taken
