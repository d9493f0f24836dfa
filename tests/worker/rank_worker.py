"""A trainer for a torchrun group of the tests: each call runs on every rank, with gloo.

forward_backward's adapter name says what each rank does:
- "sum": every rank all-reduces its rank, 1, and the sum of the batch's tokens (which
  reached it through rank 0's broadcast); rank 0's answer carries the reduced values
  as metrics "ranks:sum", "world:size" and "tokens:sum";
- "fail:R": rank R (every rank, for "fail:all") raises ValueError("rank R refuses"); the
  others return at once;
- "block:R": rank R writes its pid to the FIFO Start.options["fifo"] names, so the test
  knows the call is in it (no sleep, no guess), then waits until it is killed; the other
  ranks all-reduce, and so wait on it.
Start.options["fail_build_on_rank"] = R makes rank R's build fail.
"""

import os
import threading

import numpy as np
import torch
import torch.distributed as dist

from openrld.batches import ForwardBackwardResult
from openrld.worker import base, server


class RankTrainer(base.TrainerWorker):
    def __init__(self, start):
        self.rank = dist.get_rank()
        if int(start.options.get("fail_build_on_rank", -1)) == self.rank:
            raise RuntimeError(f"no weights on rank {self.rank}")
        self.fifo = str(start.options.get("fifo", ""))

    def add_adapter(self, name, spec, optimizer):
        pass

    def forward_backward(self, name, batch):
        action, _, target = name.partition(":")
        if action == "fail" and target in ("all", str(self.rank)):
            raise ValueError(f"rank {self.rank} refuses")
        if action == "fail":
            return ForwardBackwardResult(logprobs=[], metrics={})
        if action == "block" and int(target) == self.rank:
            with open(self.fifo, "w") as fifo:
                fifo.write(str(os.getpid()))
            threading.Event().wait()
        tokens = sum(int(np.asarray(datum.tokens).sum()) for datum in batch.data)
        reduced = torch.tensor([float(self.rank), 1.0, float(tokens)], dtype=torch.float64)
        dist.all_reduce(reduced)
        ranks, world, tokens = reduced.tolist()
        return ForwardBackwardResult(logprobs=[], metrics={"ranks:sum": ranks, "world:size": world, "tokens:sum": tokens})


if __name__ == "__main__":
    server.serve(RankTrainer, engine="rank-test")
