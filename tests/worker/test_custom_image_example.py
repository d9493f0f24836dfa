"""The example custom trainer image (examples/custom-trainer) builds from its Containerfile and
trains a LoRA step through the container launcher, bit-identically to openrld's own trainer
in this process, with its own code running (its log line).

The image is built here on a base that lends the host's Python (podman_support.py);
the Containerfile is the one docs/custom-images.md shows, with only BASE set.
"""

from __future__ import annotations

import secrets

import numpy as np
import podman_support
import pytest
import torch
from podman_support import GLOBAL_ARGS, REPO, container_log, containers_of

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.engines import build_lora_trainer
from openrld.worker.launchers import Mount, WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.container import ContainerLauncher
from openrld.worker.protocol import Start

MODEL_INSIDE = "/opt/openrld-model"


def batch(seed: int, rows: int = 3, length: int = 9) -> ForwardBackwardBatch:
    tokens = np.random.default_rng(seed).integers(3, 300, size=(rows, length + 1))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in tokens]
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


@pytest.fixture(scope="module")
def example_image(tmp_path_factory):
    podman_support.require_podman()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", podman_support.write_containers_conf(tmp_path_factory.mktemp("podman")))
        base = podman_support.skeleton_image(["python"])
        yield podman_support.built_image(REPO / "examples" / "custom-trainer", {"BASE": base})


def test_the_example_image_trains_a_lora_step_as_openrlds_trainer_does(example_image, tiny_llama, socket_root):
    node = f"test-{secrets.token_hex(4)}"
    launcher = ContainerLauncher("podman", node, podman_support.host_python_args(), global_args=GLOBAL_ARGS)
    start = Start("lora_trainer", MODEL_INSIDE, "cpu", threads=torch.get_num_threads(), options={"max_batch_tokens": 4096})
    spec = WorkerSpec(name="example trainer", role="trainer", start=start, image=example_image,
                      mounts=(Mount(str(tiny_llama), MODEL_INSIDE),), job="job-example")
    connection, _ = start_worker(launcher, spec, socket_directory(socket_root), timeouts=WorkerTimeouts(hello_s=60.0))
    remote = RemoteTrainer(connection)
    try:
        local = build_lora_trainer(tiny_llama, torch.device("cpu"), 4096)
        for engine in (remote, local):
            engine.add_adapter("a", LoraSpec(rank=4, seed=3), "adamw")
        results = [engine.forward_backward_many("a", [batch(1)]) for engine in (remote, local)]
        steps = [engine.optim_step("a", AdamParams(learning_rate=1e-2)) for engine in (remote, local)]
        log = container_log(connection.worker.name)
    finally:
        remote.close()
    assert [r.metrics for r in results[0]] == [r.metrics for r in results[1]]
    assert all(np.array_equal(a, b) for a, b in zip(results[0][0].logprobs, results[1][0].logprobs, strict=True))
    assert steps[0].metrics == steps[1].metrics
    assert containers_of(node) == []
    assert "custom-trainer: forward_backward adapter=a batches=1 tokens=27" in log
