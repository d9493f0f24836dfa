"""What a worker launched outside this node's process tree shares: a container (container.py) or a Pod (pod.py).

Its exit status is asked of its runtime, not reaped from a child process: `poll`
asks until the worker has ended and keeps the status from then on, and asks
nothing once the worker was removed. A worker its runtime no longer knows (removed
by someone else, its node gone) has ended, with status -1. Each launcher says how
its runtime is asked (`_ask_status`) and how a worker is stopped.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

LOST = -1  # the exit status of a worker whose runtime lost it: its own status went with it


class RemoteWorker:
    def __init__(self, name: str, device: str, worker: str) -> None:
        self.name = name  # the container's or Pod's name
        self.device = device
        self.worker = worker  # the worker's own name, for logs
        self._status: int | None = None  # its exit status, once it has ended
        self._removed = False  # stopped and removed: its runtime is asked no more

    def poll(self) -> int | None:
        if self._status is None and not self._removed:
            self._status = self._ask_status()
        return self._status

    def describe(self) -> str:
        raise NotImplementedError

    def _ask_status(self) -> int | None:
        """Its exit status as its runtime has it (`_gone()` where it has none); None while it runs."""
        raise NotImplementedError

    def _gone(self) -> int:
        logger.warning("worker %s: its %s is gone", self.worker, self.describe())
        return LOST
