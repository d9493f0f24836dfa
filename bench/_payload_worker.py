"""A worker whose trainer hands out a fixed set of tensors: the payload of bench/worker_launchers.py.

Its `sampler_payload` returns the same tensors (made once, at build: `options["mib"]` MiB of
float32 in 32 tensors) every call, so that a call's time is the transfer's, not the making's.
"""

from __future__ import annotations

import torch

from openrld.worker.base import TrainerWorker
from openrld.worker.server import serve


class PayloadTrainer(TrainerWorker):
    def __init__(self, start) -> None:
        total = int(start.options["mib"]) * 2**20 // 4
        generator = torch.Generator().manual_seed(0)
        self.tensors = {f"w{i}": torch.randn(total // 32, generator=generator) for i in range(32)}

    def sampler_payload(self, name: str, version: str):
        return self.tensors


if __name__ == "__main__":
    serve(PayloadTrainer, role="trainer", engine="bench-payload")
