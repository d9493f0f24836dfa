"""openrld: a self-hosted Tinker-compatible service for RL post-training."""

import os

__version__ = "0.1.0"

# Torch's CPU thread pool (libgomp) waits for the next parallel region: spinning, then asleep.
# A sampler's decode step is hundreds of small regions (SmolLM2: 211 matmuls and their LoRA
# terms a step, a few microseconds of Python between them), and waking a sleeping thread for
# each cost more than the work: under OMP_WAIT_POLICY=PASSIVE, SmolLM2's LoRA terms took 45 ms a
# step against 4.7 ms with a short spin, its packed matmuls 36 against 30 ms (bench/packed_linear.py).
# So the pool spins, briefly: ACTIVE, bounded by GOMP_SPINCOUNT to about a millisecond (libgomp
# counts ~100,000 spins a ms, give or take 5x by CPU) where ACTIVE alone spins for minutes, so an
# idle daemon's threads sleep (SmolLM2's daemon used 0.04 s of CPU in the 10 s after a sample and
# a training step). 10,000 spins served an AMD EPYC; on a Xeon (Sapphire Rapids) they ran out
# between a decode step's calls: the sampler engine's SmolLM2 sample of 8 x 32 took 2.38-2.48 s
# with 10,000, 1.93-2.13 s with 100,000 and 2.05-2.23 s with libgomp's default of 300,000.
# ACTIVE matters in a daemon: with a trainer's and a sampler's pools its threads outnumber the
# cores, and libgomp then cuts spinning to 1,000 spins under ACTIVE but to 100 (asleep at once,
# in effect) without it: an SDK client's LoRA sample of 8 x 32 took 2.1 s against 3.4 s.
# Spinning costs the small models nothing: their calls run on one thread and wake none
# (gpu/call_threads.py). Both must be set before torch loads libgomp, which is why they are
# here, where every openrld process passes first; an operator's own settings win.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "100000")
