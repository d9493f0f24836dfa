"""Worker groups on one time-sliced device: engines load in their turn, and a job's own group ends.

The group table runs real actors, real time-slicers and real torch engines on the tiny
models, on a node whose only device is `cpu:0`. The engine factory is the daemon's own
(`TorchEngineFactory`), wrapped to note, as each engine is built, which worker holds the
device and which engines already built are on it (not parked). The stand-ins are the
store's parts: the future table's request log and the checkpoint sink (unused here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import trio

from openrld.actors.device_pool import NodeDevices
from openrld.actors.futures import Completed, Failed, FutureTable
from openrld.actors.groups import GroupTable
from openrld.actors.sampler import Sample
from openrld.actors.trainer import OptimStep
from openrld.batches import AdamParams, SampleJob, SamplingSpec
from openrld.errors import BadRequest, ServerError
from openrld.model_catalog import ModelEntry
from openrld.worker.engines import TorchEngineFactory
from tests.actors.test_sampler_replicas import MemoryLog

OWNER = "u"
DEVICE = "cpu:0"


class NoCheckpoints:
    """No test here saves a checkpoint."""

    autosaves = None  # no shared checkpoint root

    async def prepare(self, model_id: str, kind: str, name: str, overwrite: bool) -> tuple[Path, Path]:
        raise AssertionError("unexpected checkpoint")

    async def commit(self, staging: Path, final: Path, overwrite: bool, manifest: Any) -> None:
        raise AssertionError("unexpected checkpoint")

    def record(self, model_id: str, kind: str, name: str, **fields: Any) -> str:
        raise AssertionError("unexpected checkpoint")


class Build(msgspec.Struct, frozen=True):
    """What the device looked like as one engine was built."""

    engine: str  # "<model> <role>"
    holder: str | None  # the worker holding the device's lease
    on_device: list[str]  # engines built before it and not parked


class RecordingEngines:
    """The daemon's engine factory, noting each build (`builds`) and keeping each engine (`built`)."""

    def __init__(self, devices: NodeDevices) -> None:
        self._inner = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=4096)
        self._slicer = devices.slicers[DEVICE]
        self.built: list[tuple[str, Any]] = []
        self.builds: list[Build] = []

    def on(self, device: str) -> RecordingEngines:
        assert device == DEVICE, device
        return self

    def trainer(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return self._recorded(f"{model.name} trainer", self._inner.trainer(model, image, job))

    def sampler(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return self._recorded(f"{model.name} sampler", self._inner.sampler(model, image, job))

    def full_trainer(
        self, model: ModelEntry, weight_sync: str, image: str | None = None, job: str | None = None
    ) -> Callable[[], Any]:
        return self._recorded(f"{model.name} trainer", self._inner.full_trainer(model, weight_sync, image, job))

    def full_sampler(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], Any]:
        return self._recorded(f"{model.name} sampler", self._inner.full_sampler(model, image, job))

    def resident(self) -> list[str]:
        return [name for name, engine in self.built if not engine.is_parked]

    def _recorded(self, name: str, build: Callable[[], Any]) -> Callable[[], Any]:
        def recorded() -> Any:
            self.builds.append(Build(name, self._slicer.turns.holder, self.resident()))
            engine = build()
            self.built.append((name, engine))
            return engine

        return recorded


class Node(msgspec.Struct):
    table: GroupTable
    devices: NodeDevices
    engines: RecordingEngines
    futures: FutureTable


def entry(name: str, directory: Path) -> ModelEntry:
    return ModelEntry(name=name, directory=str(directory), arch="llama", max_context=64)


def run_on_node(body: Callable[[Node], Any]) -> Any:
    """Run `body(node)` on a fresh one-device node; the node stops when it returns."""

    async def main() -> Any:
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                devices = await nursery.start(NodeDevices([DEVICE], quantum_s=0.05).run)
                engines = RecordingEngines(devices)
                futures = FutureTable(MemoryLog())
                table = GroupTable(
                    nursery=nursery, engines=engines, limiter=trio.CapacityLimiter(1), futures=futures,
                    checkpoints=NoCheckpoints(), sample_queue_limit=16, devices=devices,
                )
                result = await body(Node(table, devices, engines, futures))
                nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


async def sample_once(node: Node, group: Any, request_id: str) -> None:
    node.futures.create(request_id, model_id="s:sample:0", kind="sample", owner=OWNER)
    params = SamplingSpec(max_tokens=2, temperature=0.0, seed=0, stop_at_eos=False)
    job = SampleJob(prompt=np.array([5, 6, 7], np.int64), num_samples=1, params=params)
    group.sampler.submit_nowait(Sample(request_id=request_id, version=None, job=job, sampler_id="s:sample:0"))
    outcome = await node.futures.wait(request_id, owner=OWNER, hold_s=120)
    assert isinstance(outcome, Completed), outcome


async def stopped(node: Node, key: str) -> None:
    """Wait until the group `key` no longer holds a device (its actors have stopped)."""
    while node.devices.pool.placement_of(key) is not None:
        await trio.sleep(0.01)


@pytest.fixture(scope="module")
def llama(tiny_llama: Path) -> ModelEntry:
    return entry("tiny-llama", tiny_llama)


@pytest.fixture(scope="module")
def qwen(tiny_qwen3: Path) -> ModelEntry:
    return entry("tiny-qwen3", tiny_qwen3)


# ---------------------------------------------------------------- loading under the lease


def test_a_second_group_loads_its_engines_in_its_turn_with_the_first_parked(llama, qwen):
    async def body(node: Node) -> list[Build]:
        await node.table.get(llama)
        await node.table.get(qwen)
        return node.engines.builds

    assert run_on_node(body) == [
        Build("tiny-llama sampler", "tiny-llama sampler", []),
        Build("tiny-llama trainer", "tiny-llama trainer", ["tiny-llama sampler"]),
        # The qwen group's first turn parked both llama workers before its weights were loaded.
        Build("tiny-qwen3 sampler", "tiny-qwen3 sampler", []),
        Build("tiny-qwen3 trainer", "tiny-qwen3 trainer", ["tiny-qwen3 sampler"]),
    ]


def test_a_full_jobs_trainer_loads_after_its_sampler_is_parked(llama):
    async def body(node: Node) -> tuple[list[Build], list[str]]:
        await node.table.get(llama, "s:train:0", "delta")
        return node.engines.builds, node.engines.resident()

    builds, resident = run_on_node(body)
    # Its trainer and sampler are two parties: they never hold the device together.
    assert builds == [
        Build("tiny-llama sampler", "tiny-llama/s:train:0 sampler", []),
        Build("tiny-llama trainer", "tiny-llama/s:train:0 trainer", []),
    ]
    assert resident == ["tiny-llama trainer"]


# ---------------------------------------------------------------- replicas added while parked


def test_a_replica_added_while_its_sampler_is_parked_loads_in_its_turn_and_parks_with_it(llama, qwen):
    async def body(node: Node) -> tuple[Build, list[str], list[str]]:
        llama_group = await node.table.get(llama)
        qwen_group = await node.table.get(qwen)  # the llama workers are parked now
        await llama_group.sampler.ensure_replicas(2)
        after_growing = node.engines.resident()
        await sample_once(node, qwen_group, "r0")  # the qwen group takes the device back
        return node.engines.builds[-1], after_growing, node.engines.resident()

    added, after_growing, after_qwen_turn = run_on_node(body)
    assert added == Build("tiny-llama sampler", "tiny-llama sampler", ["tiny-llama sampler"])
    assert after_growing == ["tiny-llama sampler", "tiny-llama sampler"]
    # The new replica left the device with the rest of its group; the qwen sampler alone is back on it.
    assert after_qwen_turn == ["tiny-qwen3 sampler"]


# ---------------------------------------------------------------- a job's own group ends


def test_an_ended_exclusive_group_frees_its_device_for_the_next_exclusive_job(llama, qwen):
    async def body(node: Node) -> tuple[list[str], str | None, list[str]]:
        node.table.reserve(llama, "a:train:0", full_sync=None, exclusive=True)
        await node.table.get(llama, "a:train:0")
        node.table.end(llama, "a:train:0", "model a:train:0 has stopped: its session a has finished")
        await stopped(node, "full:a:train:0")
        workers = [w.worker for w in node.devices.slicers[DEVICE].statistics().workers]
        node.table.reserve(qwen, "b:train:0", full_sync=None, exclusive=True)
        placement = node.devices.pool.placement_of("full:b:train:0")
        return workers, placement.trainer_device if placement else None, node.devices.pool.free_devices()

    assert run_on_node(body) == ([], DEVICE, [])


def test_ending_a_group_fails_the_ops_it_still_holds(llama):
    async def body(node: Node) -> Any:
        node.table.reserve(llama, "a:train:0", full_sync=None, exclusive=True)
        group = await node.table.get(llama, "a:train:0")
        group.trainer.open_job("a:train:0")
        node.futures.create("op1", model_id="a:train:0", kind="optim_step", owner=OWNER)
        # seq_id 1 waits behind seq_id 0, which never comes: it is still queued when the group ends.
        group.trainer.submit_nowait(OptimStep("a:train:0", 1, "op1", AdamParams(learning_rate=1e-3)))
        await trio.sleep(0.05)
        node.table.end(llama, "a:train:0", "model a:train:0 has stopped: its session a has finished")
        return await node.futures.wait("op1", owner=OWNER, hold_s=30)

    assert run_on_node(body) == Failed(
        detail="model a:train:0 has stopped: its session a has finished", category="user"
    )


def test_a_group_ended_before_it_started_only_drops_its_booking(llama):
    async def body(node: Node) -> list[str]:
        node.table.reserve(llama, "a:train:0", full_sync=None, exclusive=True)
        node.table.end(llama, "a:train:0", "model a:train:0 could not be created")
        return node.devices.pool.free_devices()

    assert run_on_node(body) == [DEVICE]


def test_a_failed_start_frees_the_device_its_exclusive_job_booked(llama, tmp_path):
    broken = entry("broken", tmp_path)  # no weights there: building its engines fails

    async def body(node: Node) -> tuple[str, list[str]]:
        node.table.reserve(broken, "a:train:0", full_sync=None, exclusive=True)
        with pytest.raises(ServerError) as excinfo:
            await node.table.get(broken, "a:train:0")
        free = node.devices.pool.free_devices()
        node.table.end(broken, "a:train:0", "model a:train:0 failed to start")
        node.table.reserve(llama, "b:train:0", full_sync=None, exclusive=True)  # would raise if still booked
        return excinfo.value.detail, free

    detail, free = run_on_node(body)
    assert detail.startswith("could not load base model 'broken': ")
    assert free == [DEVICE]


def test_while_an_exclusive_group_runs_the_next_exclusive_job_is_refused(llama, qwen):
    async def body(node: Node) -> None:
        node.table.reserve(llama, "a:train:0", full_sync=None, exclusive=True)
        await node.table.get(llama, "a:train:0")
        with pytest.raises(BadRequest, match=r"openrl\.exclusive=true: job b:train:0 needs a device of its own"):
            node.table.reserve(qwen, "b:train:0", full_sync=None, exclusive=True)

    run_on_node(body)
