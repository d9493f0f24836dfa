"""One suspicion: Lifeguard's timeout that shrinks as independent accusers confirm it.

A suspicion starts at the longest timeout and moves toward the shortest with
each distinct member that also suspects the node (the first accuser does not
count as a confirmation of itself). The class is pure: the node reads
`deadline_s` and sets its timer from it. No I/O, no trio.
"""

from __future__ import annotations

from openrld.cluster.membership.config import suspicion_timeout_s


class Suspicion:
    def __init__(self, *, accuser: str, started_s: float, minimum_s: float, maximum_s: float, expected: int) -> None:
        self.started_s = started_s
        self.minimum_s = minimum_s
        self.maximum_s = maximum_s
        self.expected = expected
        self._accusers = {accuser}

    @property
    def confirmations(self) -> int:
        return len(self._accusers) - 1

    def confirm(self, accuser: str) -> bool:
        """Count `accuser` once; True if it was new (and so worth gossiping on)."""
        if accuser in self._accusers or self.confirmations >= self.expected:
            return False
        self._accusers.add(accuser)
        return True

    @property
    def deadline_s(self) -> float:
        return self.started_s + suspicion_timeout_s(self.minimum_s, self.maximum_s, self.confirmations, self.expected)
