"""Automodel jobs through the real SDK: a trainer spread over two CPU devices as a torchrun group.

The node has three CPU devices and the Automodel environment (`make automodel-env`, which
`make test` builds); a job with openrl.trainer_backend=automodel and openrl.trainer_gpus=2 trains
on two gloo ranks (gpu/automodel_trainer.py), and its sampler takes the third device. The
engine's parity with the single-device trainers is tests/gpu/test_automodel_trainer.py's; here
it is the daemon's part: placement, status, sampling after training, refusal, and a rank killed.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_config
from tests.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
AUTOMODEL_PYTHON = REPO / ".venv-automodel" / "bin" / "python"
TWO_RANKS = {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "2"}

pytestmark = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(), reason="no Automodel environment: `make automodel-env` builds .venv-automodel"
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_qwen3: Path):
    root = tmp_path_factory.mktemp("automodel")
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3},
        f'longpoll_s = 3.0\ndevices = ["cpu:0", "cpu:1", "cpu:2"]\n\n[workers]\nautomodel_python = "{AUTOMODEL_PYTHON}"',
    )
    daemon = Daemon(root / "data", config, root / "daemon.log").start()
    yield daemon
    daemon.stop()


def _status(node: Daemon, model_id: str) -> dict:
    response = httpx.get(f"{node.url}/openrl/v1/models/{model_id}/status", headers={"X-API-Key": "tml-test"}, timeout=30)
    return response.json()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each child of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append((int(entry.name), command))
    return found


def _ranks(daemon: int) -> list[int]:
    """The torchrun ranks under `daemon`: the children of its torchrun child."""
    torchruns = [pid for pid, command in _children(daemon) if b"torch.distributed.run" in command]
    return sorted(rank for torchrun in torchruns for rank, _ in _children(torchrun))


def _two_rank_job(service: tinker.ServiceClient, *, exclusive: bool = True, seed: int | None = None):
    """A new two-rank job; exclusive (the default here, so that each test has its devices to
    itself), once two devices are free: a group ended before (its session closed, or its rank
    died) frees them when its actors have stopped, a moment after."""
    made = []
    metadata = {**TWO_RANKS, "openrl.exclusive": "true"} if exclusive else TWO_RANKS

    def created() -> bool:
        try:
            made.append(service.create_lora_training_client(
                base_model="tiny-llama", rank=4, seed=seed, user_metadata=metadata
            ).result())
        except tinker.BadRequestError as refused:
            assert "openrl.trainer_gpus" in str(refused), refused
            return False
        return True

    wait_for(created, 60, poll_s=0.5)
    return made[0]


def test_a_two_rank_lora_job_trains_samples_and_lists_both_ranks(node: Daemon):
    service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
    training = _two_rank_job(service)
    tokens = list(range(5, 21))
    losses = []
    for _ in range(3):
        losses.append(training.forward_backward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    trained = training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    status = _status(node, training.model_id)
    service.close("success").result()
    assert losses[2] < losses[0]
    assert sampled[0] is None and sampled[1:] == pytest.approx(trained, abs=1e-5, rel=0)
    assert [(w["role"], w["rank"], w["device"]) for w in status["workers"]] == [
        ("trainer", 0, "cpu:0"), ("trainer", 1, "cpu:1"), ("sampler", 0, "cpu:2"),
    ]


def test_two_shared_two_rank_jobs_take_turns_on_the_same_devices_and_train_as_if_alone(node: Daemon):
    service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
    first = _two_rank_job(service, exclusive=False, seed=7)  # cpu:0 and cpu:1, its sampler cpu:2
    second = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=7, user_metadata=TWO_RANKS).result()
    tokens = list(range(5, 21))
    losses: dict[str, list[float]] = {"first": [], "second": []}
    for _ in range(3):  # each call of one job parks the other's two ranks, and resumes its own
        for name, training in (("first", first), ("second", second)):
            losses[name].append(training.forward_backward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"])
        for training in (first, second):
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    logprobs = [t.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
                for t in (first, second)]
    statuses = [_status(node, t.model_id) for t in (first, second)]
    service.close("success").result()
    assert losses["first"] == losses["second"] and losses["first"][2] < losses["first"][0]
    assert logprobs[0] == logprobs[1]
    assert [[(w["role"], w["device"]) for w in s["workers"]] for s in statuses] == [
        [("trainer", "cpu:0"), ("trainer", "cpu:1"), ("sampler", "cpu:2")],
        [("trainer", "cpu:0"), ("trainer", "cpu:1"), ("sampler", "cpu:0")],
    ]
    assert all(w["parks"] >= 3 for s in statuses for w in s["workers"] if w["role"] == "trainer")


def test_a_trainer_wider_than_the_node_is_refused_naming_the_setting(node: Daemon):
    service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
    wide = {**TWO_RANKS, "openrl.trainer_gpus": "4"}
    with pytest.raises(tinker.BadRequestError) as refused:
        service.create_lora_training_client(base_model="tiny-llama", rank=4, user_metadata=wide).result()
    service.close("success").result()
    assert re.search(r"openrl\.trainer_gpus=4: job \S+ needs 4 devices on one node, and this node has 3, [0-3] held by no "
                     r"exclusive job", str(refused.value))


def test_a_rank_killed_fails_the_job_reaps_its_group_and_frees_its_devices(node: Daemon):
    service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
    training = _two_rank_job(service)
    training.forward_backward([_datum(list(range(5, 15)))], "cross_entropy").result()
    ranks = _ranks(node.proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    # A call made before the daemon has seen the loss fails as a request; one made after, at once (410).
    with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as failed:
        training.forward_backward([_datum(list(range(5, 15)))], "cross_entropy").result()
    wait_for(lambda: _ranks(node.proc.pid) == [] and not any(Path(f"/proc/{pid}").exists() for pid in ranks), 60)
    with pytest.raises(tinker.APIStatusError) as later:
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # Its two devices (and the sampler's) are free again: the next two-rank job is placed.
    again = _two_rank_job(service)
    again.forward_backward([_datum(list(range(5, 15)))], "cross_entropy").result()
    service.close("success").result()
    assert "died" in str(failed.value) and "resume from a saved state" in str(failed.value)
    assert later.value.status_code == 410 and "resume from a saved state" in str(later.value)


def test_a_two_rank_job_with_context_parallelism_trains_and_lists_both_ranks(node: Daemon):
    # openrl.trainer_cp=2: one cp group of two ranks scores each micro-batch together, its datums
    # packed into one sequence cut in two (gpu/automodel_cp.py); parity is tests/gpu/test_automodel_cp.py's.
    service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
    metadata = {**TWO_RANKS, "openrl.trainer_cp": "2", "openrl.exclusive": "true"}
    made = []

    def created() -> bool:
        try:
            made.append(service.create_lora_training_client(base_model="tiny-llama", rank=4, user_metadata=metadata).result())
        except tinker.BadRequestError as refused:
            assert "openrl.trainer_gpus" in str(refused), refused  # devices still held by an earlier test's group
            return False
        return True

    wait_for(created, 60, poll_s=0.5)
    training = made[0]
    tokens = list(range(5, 21))
    losses = []
    for _ in range(2):
        passed = training.forward_backward([_datum(tokens), _datum(tokens[:9])], "cross_entropy").result()
        losses.append(passed.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    status = _status(node, training.model_id)
    service.close("success").result()
    assert losses[1] < losses[0]
    # The status lists the group's ranks and devices; it has no field for cp (actors/model_status.py).
    assert [(w["role"], w["rank"], w["device"]) for w in status["workers"]] == [
        ("trainer", 0, "cpu:0"), ("trainer", 1, "cpu:1"), ("sampler", 0, "cpu:2"),
    ]
