"""A sampler under the node's host-memory budget: its prefix caches keep within their share.

The actor runs real `TorchSampler` engines on the tiny Llama (CPU: their weights are host
memory and count); the ledger is the daemon's `HostMemory`. A park's report is a stub's,
because on the CPU a park moves nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import trio

from openrld.actors.futures import Completed, FutureTable
from openrld.actors.host_memory import HostMemory
from openrld.actors.sampler import Sample, SamplerActor, SamplerHandle
from openrld.batches import SampleJob, SamplingSpec
from openrld.engine_types import ParkReport, ResumeReport
from openrld.gpu.torch_sampler import TorchSampler
from tests.actors.test_sampler_replicas import MemoryLog

OWNER = "u"
PROMPT_TOKENS = 96  # six 16-token blocks


def long_job(seed: int) -> SampleJob:
    params = SamplingSpec(max_tokens=4, temperature=1.0, seed=seed, stop_at_eos=False)
    prompt = np.arange(10, 10 + PROMPT_TOKENS, dtype=np.int64) % 300 + seed
    return SampleJob(prompt=prompt, num_samples=1, params=params)


async def sample(handle: SamplerHandle, futures: FutureTable, request_id: str, seed: int) -> None:
    futures.create(request_id, model_id="s:sample:0", kind="sample", owner=OWNER)
    handle.submit_nowait(Sample(request_id=request_id, version=None, job=long_job(seed), sampler_id="s:sample:0"))
    assert isinstance(await futures.wait(request_id, owner=OWNER, hold_s=120), Completed)


async def until(condition, what: str) -> None:
    with trio.fail_after(30):  # `what` names the wait in the traceback
        while not condition():
            await trio.sleep(0.01)


def held(engines: list[TorchSampler]) -> list[int]:
    return [e.statistics().prefix_cache.bytes_held for e in engines]


async def start(
    nursery: trio.Nursery, model_dir: Path, cap: int, memory: HostMemory, futures: FutureTable
) -> tuple[SamplerHandle, list[TorchSampler]]:
    """A sampler of real engines (each with prefix cache bound `cap`) under `memory`; the engines it built."""
    engines: list[TorchSampler] = []

    def build() -> TorchSampler:
        engines.append(TorchSampler(model_dir, torch.device("cpu"), prefix_cache_bytes=cap))
        return engines[-1]

    actor = SamplerActor(
        name="tiny-llama", build_engine=build, limiter=trio.CapacityLimiter(1), futures=futures, queue_limit=8,
        host_memory=memory,
    )
    return await nursery.start(actor.run), engines


def test_a_second_replica_halves_the_share_and_the_first_evicts_down_to_it_at_once(tiny_llama: Path) -> None:
    state = TorchSampler(tiny_llama, torch.device("cpu")).host_state_bytes()
    cap = 64 * 2**20
    small = 16384  # what each replica's share is once there are two: two blocks of the tiny Llama
    memory = HostMemory(2 * state + 2 * small, prefix_cache_cap=cap)

    async def main() -> None:
        futures = FutureTable(MemoryLog())
        async with trio.open_nursery() as nursery:
            handle, engines = await start(nursery, tiny_llama, cap, memory, futures)
            assert handle.statistics().memory.state_bytes == state
            assert memory.prefix_cache_share() == min(cap, state + 2 * small)
            await sample(handle, futures, "r0", seed=1)
            before = held(engines)[0]
            assert before > small  # six blocks of the prompt, more than the two-replica share
            # Reported at the end of the engine call that resolved the request, a moment after it.
            await until(lambda: handle.statistics().memory.prefix_cache_bytes == before, "the ledger's report")
            await handle.ensure_replicas(2)
            assert memory.prefix_cache_share() == small
            await until(lambda: held(engines)[0] == small, "the first replica's eviction, down to two blocks")
            await until(lambda: memory.statistics().prefix_cache_bytes == small, "the ledger's report")
            assert handle.statistics().memory.prefix_cache_bytes == small
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_state_parked_elsewhere_shrinks_an_idle_samplers_cache_without_a_request(tiny_llama: Path) -> None:
    state = TorchSampler(tiny_llama, torch.device("cpu")).host_state_bytes()
    memory = HostMemory(state + 2**20, prefix_cache_cap=2**20)

    async def main() -> None:
        futures = FutureTable(MemoryLog())
        async with trio.open_nursery() as nursery:
            handle, engines = await start(nursery, tiny_llama, 2**20, memory, futures)
            await sample(handle, futures, "r0", seed=2)
            assert held(engines)[0] > 0
            memory.parked(("trainer", "other"), 2**20)  # another group's trainer parks off its GPU
            assert memory.prefix_cache_share() == 0
            await until(lambda: held(engines)[0] == 0, "the idle sampler's eviction")
            await until(lambda: memory.statistics().prefix_cache_bytes == 0, "the ledger's report")
            memory.parked(("trainer", "other"), 0)  # it resumed: the room comes back
            await sample(handle, futures, "r1", seed=3)
            assert 0 < held(engines)[0] <= 2**20
            nursery.cancel_scope.cancel()

    trio.run(main)


class ParksToTheHost:
    """A sampler engine whose park copies `nbytes` into host memory, as a CUDA one does, and whose
    `spill_parked` moves them all to disk."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.spilled_to: str | None = None

    def park(self) -> ParkReport:
        return ParkReport(device="cuda:0", tensors=1, bytes_held=self.nbytes, bytes_moved=self.nbytes,
                          cache_bytes_dropped=0, device_bytes_freed=self.nbytes, device_bytes_reserved_after=0,
                          seconds=0.0)

    def resume(self) -> ResumeReport:
        return ResumeReport(device="cuda:0", tensors=1, bytes_moved=self.nbytes, seconds=0.0)

    def spill_parked(self, directory: str) -> int:
        self.spilled_to = directory
        return self.nbytes

    def has_work(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_parked_sampler_on_a_node_without_a_spill_directory_counts_what_its_park_copied() -> None:
    memory = HostMemory(1000, prefix_cache_cap=1000)

    async def main() -> None:
        actor = SamplerActor(
            name="m", build_engine=lambda: ParksToTheHost(600), limiter=trio.CapacityLimiter(1),
            futures=FutureTable(MemoryLog()), queue_limit=8, replicas=2, host_memory=memory,
        )
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(actor.run)
            assert memory.prefix_cache_share() == 500
            assert await actor.park()  # the time-slicer's call
            assert handle.statistics().memory.parked_bytes == 1200
            stats = memory.statistics()
            assert (stats.parked_bytes, stats.prefix_cache_share_bytes, stats.over_budget_parks) == (1200, 0, 1)
            await actor.resume()
            assert (memory.statistics().parked_bytes, memory.prefix_cache_share()) == (0, 500)
            nursery.cancel_scope.cancel()
        assert memory.statistics().prefix_caches == 0  # a stopped sampler is forgotten

    trio.run(main)


def test_a_sampler_park_past_the_budget_spills_every_parked_engine_to_the_nodes_directory(tmp_path: Path) -> None:
    memory = HostMemory(1000, prefix_cache_cap=1000, spill_dir=tmp_path)
    engines: list[ParksToTheHost] = []

    def build() -> ParksToTheHost:
        engines.append(ParksToTheHost(600))
        return engines[-1]

    async def main() -> None:
        actor = SamplerActor(
            name="m", build_engine=build, limiter=trio.CapacityLimiter(1), futures=FutureTable(MemoryLog()),
            queue_limit=8, replicas=2, host_memory=memory,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            assert await actor.park()
            stats = memory.statistics()
            assert (stats.parked_bytes, stats.spilled_bytes, stats.over_budget_parks) == (0, 1200, 0)
            assert [e.spilled_to for e in engines] == [str(tmp_path)] * 2
            assert memory.prefix_cache_share() == 500  # spilled state leaves the caches their room
            await actor.resume()
            assert memory.statistics().spilled_bytes == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
