"""A job names its own trainer image (openrl.trainer_backend=<image>) through the real SDK.

The image is examples/custom-trainer, built here from its Containerfile (podman_support.py
lends it this host's Python, since no registry can be reached). The daemon runs it with
podman for that job alone; the job trains, saves and samples as a job of openrld's own
trainer does, with the same losses, and an image off the node's allow-list is refused.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import numpy as np
import podman_support
import pytest
import tinker
from conftest import Daemon, write_config
from podman_support import GLOBAL_ARGS, REPO, containers_of, podman
from tinker import types

API_KEY = "tml-test"
ADAM = types.AdamParams(learning_rate=1e-2)


def toml_list(items) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[str, str]:
    """(the example trainer image, a sampler image: openrld's built-in worker as its entrypoint)."""
    podman_support.require_podman()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", podman_support.write_containers_conf(tmp_path_factory.mktemp("podman")))
        base = podman_support.skeleton_image(["python"])
        trainer = podman_support.built_image(REPO / "examples" / "custom-trainer", {"BASE": base})
        yield trainer, podman_support.skeleton_image(["python", "-m", "openrld.worker"])


@pytest.fixture(scope="module")
def image_daemon(tmp_path_factory, tiny_llama: Path, images: tuple[str, str]):
    root = tmp_path_factory.mktemp("image-daemon")
    node = f"test-{secrets.token_hex(4)}"
    extra = "\n".join([
        f'node_name = "{node}"',
        "[workers]",
        f"allowed_images = {toml_list([image.rsplit(':', 1)[0] + ':*' for image in images])}",
        f"container_global_args = {toml_list(GLOBAL_ARGS)}",
        f"container_run_args = {toml_list(podman_support.host_python_args())}",
    ])
    # [workers] is a table: it goes after the top-level keys, and [models] after it.
    config = write_config(root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama}, extra)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", podman_support.write_containers_conf(root))
        # What an earlier daemon of this node left: the one starting now removes it.
        podman("create", "--label", f"openrld.node={node}", "--name", f"openrld-worker-{node}", images[1])
        left = containers_of(node)
        daemon = Daemon(root / "data", config, root / "daemon.log").start()
    assert left == [f"openrld-worker-{node}"]
    yield daemon, node
    daemon.stop()
    assert containers_of(node) == [], "a worker container outlived its daemon"


def test_a_starting_daemon_removes_the_worker_containers_an_earlier_one_left(image_daemon):
    _, node = image_daemon
    assert containers_of(node) == []


def datum(tokens) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


def train(service: tinker.ServiceClient, metadata: dict[str, str]) -> tuple[tinker.TrainingClient, list[float]]:
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=5, user_metadata=metadata).result()
    rng = np.random.default_rng(5)
    data = [datum(list(rng.integers(3, 300, size=16))) for _ in range(2)]
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(ADAM).result()
    return training, losses


def train_and_sample(service: tinker.ServiceClient, metadata: dict[str, str]):
    """Two steps, then the trained weights' samples with their logprobs and the prompt's."""
    training, losses = train(service, metadata)
    sampler = training.save_weights_and_get_sampling_client().result()
    sampled = sampler.sample(
        types.ModelInput.from_ints([3, 4, 5, 6]), 2, types.SamplingParams(max_tokens=5, seed=2, temperature=0.8),
        include_prompt_logprobs=True,
    ).result()
    return losses, [(s.tokens, s.logprobs) for s in sampled.sequences], sampled.prompt_logprobs[1:]


@pytest.fixture(scope="module")
def reference(shared_daemon):
    """The same loop on the engines in a daemon's own process."""
    service = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    try:
        yield train_and_sample(service, {})
    finally:
        service.close("success").result()


@pytest.mark.parametrize("which", ["trainer", "sampler", "both"])
def test_a_job_trains_and_samples_from_its_images_as_from_openrlds_engines(image_daemon, images, reference, which):
    daemon, node = image_daemon
    metadata = {}
    if which in ("trainer", "both"):
        metadata["openrl.trainer_backend"] = images[0]
    if which in ("sampler", "both"):
        metadata["openrl.sampler_backend"] = images[1]
    service = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    try:
        assert train_and_sample(service, metadata) == reference
        assert len(containers_of(node)) == len(metadata)
    finally:
        service.close("success").result()
    # The session's end ends the job's own group, and its containers with it.
    deadline = time.monotonic() + 30
    while containers_of(node) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert containers_of(node) == []


@pytest.mark.parametrize("key", ["trainer_backend", "sampler_backend"])
def test_an_image_off_the_allow_list_is_refused_naming_its_setting(image_daemon, key):
    daemon, _ = image_daemon
    service = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    try:
        with pytest.raises(tinker.BadRequestError) as refused:
            service.create_lora_training_client(
                base_model="tiny-llama", rank=4, user_metadata={f"openrl.{key}": "evil.example/miner:1"}
            ).result()
    finally:
        service.close("success").result()
    assert f"openrl.{key}: image 'evil.example/miner:1' is not allowed" in str(refused.value)
    assert "workers.allowed_images" in str(refused.value)
