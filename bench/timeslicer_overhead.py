"""What the device lease costs an engine call, as ratios against a bare CapacityLimiter.

Every trainer op and sampler step now takes the device lease from the
time-slicer before it takes the device's thread limiter. This measures the
event-loop cost of that, with a no-op "engine call" so the cost is all there is:

- uncontended: one worker alone on its device (the common case: the lease is
  granted at once, `try_grant_now`), against `async with limiter` alone;
- same party: two workers of one LoRA group alternating (no parking), the
  slicer's actor task granting each turn;
- two parties: two groups alternating with a zero-cost park/resume, every
  handover going through park then resume.

Blocks of each kind alternate (A B A B ...) and the median of the per-block
ratios is printed, so load from other processes on the machine falls on both
sides. Run: `python bench/timeslicer_overhead.py`.
"""

from __future__ import annotations

import statistics
import time

import trio

from openrld.actors.timeslicer import TimeSlicer

CALLS = 2000
BLOCKS = 7


class _FreePark:
    async def park(self) -> bool:
        return True

    async def resume(self) -> None:
        return None


async def _bare(limiter: trio.CapacityLimiter) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        async with limiter:
            await trio.lowlevel.checkpoint()
    return time.perf_counter() - start


async def _leased(lease, limiter: trio.CapacityLimiter, calls: int) -> None:
    for done in range(1, calls + 1):
        async with lease.hold(has_more=lambda done=done: done < calls), limiter:
            await trio.lowlevel.checkpoint()


async def _run_alone(slicer: TimeSlicer, limiter: trio.CapacityLimiter) -> float:
    lease = slicer.register("alone", "alone", _FreePark())
    lease.claim_resident()
    start = time.perf_counter()
    await _leased(lease, limiter, CALLS)
    lease.close()
    return time.perf_counter() - start


async def _run_pair(slicer: TimeSlicer, limiter: trio.CapacityLimiter, parties: tuple[str, str]) -> float:
    leases = [slicer.register(f"w{i}", party, _FreePark()) for i, party in enumerate(parties)]
    leases[0].claim_resident()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for lease in leases:
            nursery.start_soon(_leased, lease, limiter, CALLS // 2)
    for lease in leases:
        lease.close()
    return time.perf_counter() - start


async def main() -> None:
    ratios: dict[str, list[float]] = {"uncontended": [], "same party": [], "two parties": []}
    bare_us: list[float] = []
    async with trio.open_nursery() as nursery:
        slicer = await nursery.start(TimeSlicer("cpu:0", quantum_s=0.0).run)
        limiter = trio.CapacityLimiter(1)
        for _ in range(BLOCKS):
            bare = await _bare(limiter)
            bare_us.append(bare / CALLS * 1e6)
            ratios["uncontended"].append(await _run_alone(slicer, limiter) / bare)
            bare = await _bare(limiter)
            ratios["same party"].append(await _run_pair(slicer, limiter, ("g", "g")) / bare)
            bare = await _bare(limiter)
            ratios["two parties"].append(await _run_pair(slicer, limiter, ("a", "b")) / bare)
        nursery.cancel_scope.cancel()
    print(f"device lease cost per engine call, {CALLS} no-op calls per block, median of {BLOCKS} blocks")
    bare = statistics.median(bare_us)
    print(f"  bare limiter: {bare:.1f} us per call (engine calls take milliseconds)")
    for kind, values in ratios.items():
        ratio = statistics.median(values)
        print(f"  {kind:12s} time / bare limiter time = {ratio:.2f}x (about {ratio * bare:.0f} us per call)")


if __name__ == "__main__":
    trio.run(main)
