"""A bounded mailbox and a wake-up signal: the two primitives every actor loop uses.

`Mailbox` is a memory channel whose sender never blocks the API: `post` uses
`send_nowait` and turns a full box into `TooManyRequests` (429), so a flood of
requests is refused at the door rather than buffered without bound.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import trio

from openrld.errors import TooManyRequests

T = TypeVar("T")


class Mailbox(Generic[T]):
    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self._send, self.receive = trio.open_memory_channel[T](capacity)

    def post(self, message: T) -> None:
        """Queue `message` now or refuse it with 429; never waits."""
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            raise TooManyRequests(f"{self.name} queue is full; retry shortly") from None

    def close(self) -> None:
        self._send.close()

    def depth(self) -> int:
        return self._send.statistics().current_buffer_used
