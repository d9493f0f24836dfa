"""A call to a worker made in a thread of its own, so that a test can act while it runs
(kill the worker, cancel the call), and the FIFO through which a test worker says it is inside."""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class InCall:
    """`call()` running in a daemon thread; `outcome` gets its value or the error it raised."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.outcome: list[Any] = []
        self._call = call
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome.append(self._call())
        except BaseException as error:
            self.outcome.append(error)

    def join(self, timeout: float = 60.0) -> list[Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call never returned"
        return self.outcome


def entered(fifo: Path, what: str, timeout: float = 60.0) -> bytes:
    """What the worker wrote into `fifo` once inside the call (waits for it, at most `timeout`)."""
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([reader], [], [], timeout)
        assert ready, f"{what} never entered the call"
        return os.read(reader, 32)
    finally:
        os.close(reader)
