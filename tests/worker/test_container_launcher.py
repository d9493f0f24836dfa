"""The container launcher: a worker in an image run by podman trains as the engine in this
process does, fails its calls with EngineLost when its container dies or never connects,
and leaves no container behind; `reap` clears what an earlier daemon left.

The podman tests run real containers (images built here: podman_support.py). The
argument tests put a fake runtime on PATH, at the edge this machine cannot reach
(docker, GPUs), and read the command line it was given.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import sys
from pathlib import Path

import numpy as np
import podman_support
import pytest
import torch
from in_call import InCall, entered
from podman_support import GLOBAL_ARGS, REPO, containers_of, podman

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import EngineLost
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.engines import build_lora_trainer
from openrld.worker.launchers import WORKER_SOCKET_DIR, Mount, WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.container import ContainerLauncher, ContainerRuntimeError
from openrld.worker.protocol import Start
from openrld.worker.values import local_payload

QUICK = WorkerTimeouts(hello_s=60.0, heartbeat_s=0.5, deadline_s=30.0, stop_s=5.0)
MODEL_INSIDE = "/opt/openrld-model"  # not the host's path: the worker reads what the spec mounts
LORA = LoraSpec(rank=192, seed=3)  # lm_head's lora_B is 384 x 192 float32, 288 KiB: over SHARED_MIN_BYTES


def batch(seed: int, rows: int = 3, length: int = 9) -> ForwardBackwardBatch:
    tokens = np.random.default_rng(seed).integers(3, 300, size=(rows, length + 1))
    data = [TrainDatum(tokens=row[:-1], inputs={"target_tokens": row[1:]}) for row in tokens]
    return ForwardBackwardBatch(data=data, loss_fn="cross_entropy", loss_config={}, forward_only=False)


# --- podman: real containers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory):
    podman_support.require_podman()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", podman_support.write_containers_conf(tmp_path_factory.mktemp("podman")))
        yield


@pytest.fixture(scope="module")
def builtin_image(podman_env) -> str:
    return podman_support.skeleton_image(["python", "-m", "openrld.worker"])


@pytest.fixture(scope="module")
def blocking_image(podman_env) -> str:
    return podman_support.skeleton_image(["python", str(REPO / "tests" / "worker" / "blocking_trainer.py")])


@pytest.fixture(scope="module")
def silent_image(podman_env) -> str:
    """An image that runs and never connects."""
    return podman_support.skeleton_image(["sleep", "infinity"])


@pytest.fixture
def node(podman_env):
    """A node name of this test's own; whatever the test leaves under it is removed."""
    name = f"test-{secrets.token_hex(4)}"
    yield name
    leftover = containers_of(name)
    if leftover:
        podman("rm", "--force", "--time", "0", *leftover)


@pytest.fixture
def launcher(node) -> ContainerLauncher:
    return ContainerLauncher("podman", node, podman_support.host_python_args(), global_args=GLOBAL_ARGS)


@pytest.fixture
def directory(socket_root) -> Path:
    return socket_directory(socket_root)


@pytest.fixture(scope="module")
def trainer_worker(podman_env, builtin_image, tiny_llama, tmp_path_factory):
    """The built-in LoRA trainer in a container, with this module's node and a socket of its own."""
    node = f"test-{secrets.token_hex(4)}"
    launcher = ContainerLauncher("podman", node, podman_support.host_python_args(), global_args=GLOBAL_ARGS)
    start = Start("lora_trainer", MODEL_INSIDE, "cpu", threads=torch.get_num_threads(), options={"max_batch_tokens": 4096})
    spec = WorkerSpec(name="container trainer", role="trainer", start=start, image=builtin_image,
                      mounts=(Mount(str(tiny_llama), MODEL_INSIDE),), job="job-a")
    connection, _ = start_worker(launcher, spec, socket_directory(tmp_path_factory.mktemp("sockets")), timeouts=QUICK)
    remote = RemoteTrainer(connection)
    yield remote, node
    remote.close()


def test_a_lora_step_in_a_container_is_bit_identical_to_the_engine_in_this_process(trainer_worker, tiny_llama):
    remote, _ = trainer_worker
    local = build_lora_trainer(tiny_llama, torch.device("cpu"), 4096)
    for engine in (remote, local):
        engine.add_adapter("a", LORA, "adamw")
    results = [engine.forward_backward_many("a", [batch(1), batch(2)]) for engine in (remote, local)]
    steps = [engine.optim_step("a", AdamParams(learning_rate=1e-2)) for engine in (remote, local)]
    assert [r.metrics for r in results[0]] == [r.metrics for r in results[1]]
    for remote_result, local_result in zip(*results):
        assert all(np.array_equal(a, b) for a, b in zip(remote_result.logprobs, local_result.logprobs, strict=True))
    assert steps[0].metrics == steps[1].metrics
    sent, expected = local_payload(remote.sampler_payload("a", "v1")), local.sampler_payload("a", "v1")
    assert sorted(sent) == sorted(expected)
    assert all(torch.equal(sent[name], expected[name]) for name in expected)


def test_a_large_tensor_crosses_out_of_the_container_as_a_sealed_memfd(trainer_worker):
    remote, _ = trainer_worker
    if not remote.has_adapter("a"):
        remote.add_adapter("a", LORA, "adamw")
    payload = remote.sampler_payload("a", "v1")
    largest = max(payload.value.values(), key=lambda tensor: tensor.nbytes)
    assert (largest.shape, largest.nbytes) == ((384, 192), 384 * 192 * 4)
    # Mapped from the memfd the container sent (frames.py); an inline buffer is a bytearray.
    assert isinstance(largest.data.obj, mmap.mmap)


def test_the_container_has_no_network_the_labels_and_only_its_socket(trainer_worker):
    remote, node = trainer_worker
    name = remote.connection.worker.name
    config = json.loads(podman("inspect", name))[0]
    assert config["HostConfig"]["NetworkMode"] == "none"
    assert {k: v for k, v in config["Config"]["Labels"].items() if k.startswith("openrld.")} == {
        "openrld.node": node, "openrld.role": "trainer", "openrld.job": "job-a",
    }
    sockets = [m for m in config["Mounts"] if m["Destination"].startswith(WORKER_SOCKET_DIR)]
    assert [(Path(m["Destination"]).parent, m["RW"]) for m in sockets] == [(Path(WORKER_SOCKET_DIR), False)]


def test_close_says_bye_and_removes_the_container(podman_env, builtin_image, launcher, node, directory, tiny_llama):
    start = Start("lora_trainer", MODEL_INSIDE, "cpu", threads=1)
    spec = WorkerSpec(name="closing trainer", role="trainer", start=start, image=builtin_image,
                      mounts=(Mount(str(tiny_llama), MODEL_INSIDE),))
    connection, _ = start_worker(launcher, spec, directory, timeouts=QUICK)
    worker = connection.worker
    connection.close()
    assert (worker.poll(), containers_of(node)) == (0, [])


def test_a_container_killed_mid_call_raises_engine_lost_and_is_removed(
    blocking_image, launcher, node, directory, tmp_path,
):
    fifo = tmp_path / "entered"
    os.mkfifo(fifo)
    start = Start("blocking", "/nonexistent", "cpu", options={"fifo": str(fifo)})
    spec = WorkerSpec(name="blocking trainer", role="trainer", start=start, image=blocking_image,
                      mounts=(Mount(str(tmp_path), str(tmp_path), read_only=False),))
    connection, _ = start_worker(launcher, spec, directory, timeouts=QUICK)
    remote = RemoteTrainer(connection)
    remote.add_adapter("a", None, "adamw")
    call = InCall(lambda: remote.forward_backward("a", batch(0)))
    entered(fifo, "the worker")  # its byte: it is inside forward_backward
    podman("kill", connection.worker.name)
    [error] = call.join()
    assert isinstance(error, EngineLost)
    assert str(error) == (
        "blocking trainer died (exit status 137); the weights and optimizer state it held are gone: "
        "resume from a saved state (load_state, or load_state_with_optimizer)"
    )
    assert containers_of(node) == []


def test_a_worker_that_never_connects_is_lost_after_hello_s_and_removed(silent_image, launcher, node, directory):
    spec = WorkerSpec(name="silent trainer", role="trainer", start=Start("lora_trainer", "/m", "cpu"), image=silent_image)
    with pytest.raises(EngineLost) as lost:
        start_worker(launcher, spec, directory, timeouts=WorkerTimeouts(hello_s=3.0))
    assert str(lost.value) == "silent trainer did not connect within 3 s; it was stopped"
    assert containers_of(node) == []


def test_reap_removes_the_containers_an_earlier_daemon_of_this_node_left(silent_image, launcher, node, tmp_path):
    socket_file = tmp_path / "w.sock"
    socket_file.touch()
    spec = WorkerSpec(name="orphan", role="sampler", start=Start("torch_sampler", "/m", "cpu"), image=silent_image)
    launcher.launch(spec, str(socket_file), {})
    launcher.launch(spec, str(socket_file), {})
    restarted = ContainerLauncher("podman", node, global_args=GLOBAL_ARGS)
    assert (restarted.reap(), containers_of(node)) == (2, [])


def test_reap_leaves_another_nodes_containers(silent_image, launcher, node, tmp_path):
    socket_file = tmp_path / "w.sock"
    socket_file.touch()
    spec = WorkerSpec(name="other's", role="trainer", start=Start("lora_trainer", "/m", "cpu"), image=silent_image)
    other = launcher.launch(spec, str(socket_file), {})
    assert ContainerLauncher("podman", f"{node}-other", global_args=GLOBAL_ARGS).reap() == 0
    assert containers_of(node) == [other.name]


# --- the command line, through a fake runtime on PATH ----------------------------------------

FAKE_RUNTIME = """#!{python}
import json, os, sys
with open(os.environ["FAKE_RUNTIME_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "token": os.environ.get("OPENRLD_WORKER_TOKEN")}}) + "\\n")
if sys.argv[1:2] == ["run"] and os.environ.get("FAKE_RUNTIME_FAIL"):
    print("Error: the image does not exist", file=sys.stderr)
    sys.exit(125)
"""


@pytest.fixture
def fake_runtime(tmp_path, monkeypatch):
    """fake_runtime(name) -> a function giving the calls it got: [{"argv": [...], "token": ...}]."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_RUNTIME_LOG", str(log))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def install(name: str):
        script = bin_dir / name
        script.write_text(FAKE_RUNTIME.format(python=sys.executable))
        script.chmod(0o755)
        return lambda: [json.loads(line) for line in log.read_text().splitlines()]

    return install


def _spec(device: str, **fields) -> WorkerSpec:
    start = Start("lora_trainer", "/models/m", device)
    return WorkerSpec(name="trainer", role="trainer", start=start, image="registry.example/team/trainer:1", **fields)


@pytest.mark.parametrize(
    ("runtime", "device", "expected"),
    [
        ("podman", "cuda:2", ["--device", "nvidia.com/gpu=2"]),
        ("docker", "cuda:2", ["--gpus", "device=2"]),
        ("podman", "cpu", []),
    ],
    ids=["podman-cdi", "docker-gpus", "cpu-nothing"],
)
def test_the_jobs_device_is_passed_in_and_seen_as_the_first(fake_runtime, runtime, device, expected):
    calls = fake_runtime(runtime)
    launched = ContainerLauncher(runtime, "n1").launch(_spec(device), "/run/d/w-1.sock", {})
    argv = calls()[0]["argv"]
    passed = [argv[i : i + 2] for i, arg in enumerate(argv) if arg in ("--device", "--gpus")]
    assert (passed, launched.device) == ([expected] if expected else [], "cpu" if device == "cpu" else "cuda:0")


def test_the_run_command_line_in_full(fake_runtime):
    calls = fake_runtime("podman")
    mounts = (Mount("/models/m", "/models/m"), Mount("/ckpt/job", "/ckpt/job", read_only=False))
    launcher = ContainerLauncher("podman", "n1", ("--shm-size", "1g"), global_args=("--runtime", "runc"))
    launched = launcher.launch(_spec("cpu", mounts=mounts, job="job-7"), "/run/d/w-1.sock", {"OPENRLD_WORKER_TOKEN": "t0k"})
    [call] = calls()
    assert call["argv"] == [
        "--runtime", "runc", "run", "--detach", "--name", launched.name,
        "--label", "openrld.node=n1", "--label", "openrld.role=trainer", "--label", "openrld.job=job-7",
        "--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
        "--cap-drop", "all", "--security-opt", "no-new-privileges",
        "--volume", f"/run/d/w-1.sock:{WORKER_SOCKET_DIR}/w-1.sock:ro",
        "--volume", "/models/m:/models/m:ro", "--volume", "/ckpt/job:/ckpt/job",
        "--env", "OPENRLD_WORKER_TOKEN", "--env", "OPENRLD_WORKER_SOCKET", "--env", "OPENRLD_WORKER_IGNORE_SIGNALS",
        "--shm-size", "1g", "registry.example/team/trainer:1",
    ]
    # The token reaches the runtime through its environment, never its command line.
    assert call["token"] == "t0k"


def test_stop_waits_its_timeout_then_removes(fake_runtime):
    calls = fake_runtime("docker")
    launched = ContainerLauncher("docker", "n1").launch(_spec("cpu"), "/run/d/w-1.sock", {})
    launched.stop(2.5)
    name = launched.name
    assert [c["argv"] for c in calls()[1:]] == [
        ["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name],
        ["stop", "--time", "3", name],
        ["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name],
        ["rm", "--force", name],
    ]


def test_a_missing_runtime_is_an_error_naming_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ContainerRuntimeError) as raised:
        ContainerLauncher("docker", "n1").launch(_spec("cpu"), "/run/d/w-1.sock", {})
    assert str(raised.value) == (
        "docker run: the container runtime 'docker' is not installed here (not on PATH); install it "
        "or configure the node's workers.container_runtime"
    )


def test_a_failed_run_is_an_error_with_the_runtimes_message_and_removes_what_it_made(fake_runtime, monkeypatch):
    calls = fake_runtime("podman")
    monkeypatch.setenv("FAKE_RUNTIME_FAIL", "1")
    with pytest.raises(ContainerRuntimeError) as raised:
        ContainerLauncher("podman", "n1").launch(_spec("cpu"), "/run/d/w-1.sock", {})
    assert str(raised.value) == "podman run failed (exit status 125): Error: the image does not exist"
    run, remove = calls()
    assert remove["argv"] == ["rm", "--force", "--time", "0", run["argv"][run["argv"].index("--name") + 1]]
