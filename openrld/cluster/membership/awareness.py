"""Local health (Lifeguard's awareness): how much this node should distrust its own timing.

A node that misses acks it should have had, fails to hear nacks from its
indirect probers, or is itself suspected, is probably the slow one (a loaded
CPU, a long pause). Its score rises, and the node stretches its probe timeouts
and interval by `multiplier`, so it does not accuse healthy members of its own
slowness. A successful probe lowers the score. Pure: no I/O.
"""

from __future__ import annotations


class Awareness:
    def __init__(self, max_multiplier: int) -> None:
        if max_multiplier < 1:
            raise ValueError(f"awareness max_multiplier must be >= 1, got {max_multiplier}")
        self._max_score = max_multiplier - 1
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self._max_score, max(0, self.score + delta))

    @property
    def multiplier(self) -> int:
        return self.score + 1

    def scale(self, seconds: float) -> float:
        return seconds * self.multiplier
