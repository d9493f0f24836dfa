"""A worker whose forward_backward runs until the daemon cancels it (or 30 s pass).

It writes OPENRLD_TEST_MARKER when the call has begun, so a test cancels a call
that is surely running.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from openrld.errors import Gone
from openrld.worker.base import TrainerWorker
from openrld.worker.server import cancelled, serve


class Patient(TrainerWorker):
    def __init__(self, start) -> None:
        pass

    def has_adapter(self, name: str) -> bool:
        return True

    def forward_backward(self, name, batch):
        Path(os.environ["OPENRLD_TEST_MARKER"]).write_text("running")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if cancelled():
                raise Gone("forward_backward stopped: the daemon cancelled it")
            time.sleep(0.01)
        raise AssertionError("never cancelled")


if __name__ == "__main__":
    serve(Patient, role="trainer", engine="patient")
