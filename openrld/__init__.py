"""openrld: a self-hosted Tinker-compatible service for RL post-training."""

import os

__version__ = "0.1.0"

# Torch's CPU thread pool (OpenMP) spins for a while at every barrier by default.
# A daemon runs torch from several threads at once (trainer, sampler, replicas)
# beside its event loop, often on a machine it shares: spinning threads then
# take the cores the working ones need. Measured here on the tiny Llama's
# forward+backward, 2 threads, machine under load: 800 ms spinning, 11 ms passive
# (9 ms on 1 thread). Measured again with a thread count per call (gpu/call_threads.py),
# an engine-like thread, load average 5-6, policies alternating: the tiny Llama's SFT step
# of 8 x 128 on two threads took 47-79 ms passive, 152-201 ms with GOMP_SPINCOUNT=10000 and
# 2,328-2,368 ms under libgomp's default spin (21-43 ms on one thread under each).
# A call too small to repay a wake-up runs on one thread and wakes none, so passive
# waits cost only the large calls, where a wake is small beside the work. It must be set
# before torch loads OpenMP, which is why it is here, where every openrld process passes
# first; an operator's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
