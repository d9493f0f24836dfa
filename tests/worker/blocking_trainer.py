"""A trainer worker whose forward_backward never returns: the container tests kill it mid-call.

On entering forward_backward it opens the FIFO named by Start's option "fifo" and
writes one byte, so the test knows the call is in the worker (no sleep, no guess),
then waits until it is killed.
"""

import threading

from openrld.worker import base, server


class BlockingTrainer(base.TrainerWorker):
    def __init__(self, start):
        self.fifo = str(start.options["fifo"])

    def add_adapter(self, name, spec, optimizer):
        pass

    def forward_backward(self, name, batch):
        with open(self.fifo, "wb") as fifo:
            fifo.write(b"x")
        threading.Event().wait()


if __name__ == "__main__":
    server.serve(BlockingTrainer, engine="blocking-test")
