"""The Automodel trainer for a test that reads what its saves did: each rank serves the built-in
engine (`worker/builtin.py`), whose `save_state` and `sampler_checkpoint` here also leave every
rank's `statistics()` as JSON beside the directory they wrote (`<directory>.rank<r>.statistics.json`),
since the worker protocol carries no statistics and returns rank 0's results only. Everything
else is the engine's own."""

from pathlib import Path

import msgspec
import torch.distributed as dist

from openrld.worker import server
from openrld.worker.builtin import build, ready_info


class SaveReporting:
    def __init__(self, start):
        self.engine = build(start)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def save_state(self, name, directory, with_optimizer):
        size = self.engine.save_state(name, directory, with_optimizer)
        self._report(directory)
        return size

    def sampler_checkpoint(self, name, directory):
        size = self.engine.sampler_checkpoint(name, directory)
        self._report(directory)
        return size

    def _report(self, directory: Path) -> None:
        report = directory.with_name(f"{directory.name}.rank{dist.get_rank()}.statistics.json")
        report.write_bytes(msgspec.json.encode(self.engine.statistics()))


if __name__ == "__main__":
    server.serve(SaveReporting, engine="automodel-save-reporting", info=lambda worker: ready_info(worker.engine))
