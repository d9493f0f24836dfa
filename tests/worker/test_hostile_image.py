"""A hostile worker image: the hostile worker of test_worker_faults.py, run from a container
image, breaks the protocol from inside the container; its engine is lost, its container
removed, and nothing it sent runs in this process."""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import podman_support
import pytest
from podman_support import GLOBAL_ARGS, containers_of

from openrld.batches import ForwardBackwardBatch, TrainDatum
from openrld.errors import EngineLost
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.launchers import Mount, WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.container import ContainerLauncher
from openrld.worker.protocol import Start

HOSTILE = Path(__file__).with_name("hostile_worker.py")
TIMEOUTS = WorkerTimeouts(hello_s=60.0, heartbeat_s=0.2, deadline_s=3.0, stop_s=2.0)
BATCH = ForwardBackwardBatch(
    data=[TrainDatum(tokens=np.arange(4), inputs={"target_tokens": np.arange(1, 5)})],
    loss_fn="cross_entropy", loss_config={}, forward_only=False,
)


@pytest.fixture(scope="module")
def hostile_image(tmp_path_factory):
    podman_support.require_podman()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", podman_support.write_containers_conf(tmp_path_factory.mktemp("podman")))
        yield podman_support.skeleton_image(["python", str(HOSTILE)])


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("pickle_result", "broke the worker protocol .a value that does not fit its type"),
        ("oversized_header", "broke the worker protocol .frame header of 2147483648 bytes is over the limit"),
        ("unsealed_memfd", "broke the worker protocol .the shared memory is not sealed against shrinking and growing"),
        ("wrong_shape", r"broke the worker protocol .a float32 tensor of shape \[5\] over a buffer of 16 bytes"),
    ],
)
def test_a_hostile_image_loses_its_engine_and_its_container(hostile_image, tmp_path, socket_root, mode, why):
    node = f"test-{secrets.token_hex(4)}"
    pwned = tmp_path / "pwned"
    run_args = (*podman_support.host_python_args(), "--env", f"OPENRLD_TEST_HOSTILE={mode}",
                "--env", f"OPENRLD_TEST_PWNED={pwned}")
    launcher = ContainerLauncher("podman", node, run_args, global_args=GLOBAL_ARGS)
    spec = WorkerSpec(name=f"hostile {mode}", role="trainer", start=Start("lora_trainer", str(tmp_path), "cpu"),
                      image=hostile_image, mounts=(Mount(str(tmp_path), str(tmp_path), read_only=False),))
    connection, _ = start_worker(launcher, spec, socket_directory(socket_root), timeouts=TIMEOUTS)
    with pytest.raises(EngineLost, match=f"hostile {mode} {why}"):
        RemoteTrainer(connection).forward_backward("a", BATCH)
    assert containers_of(node) == []
    assert not pwned.exists()
