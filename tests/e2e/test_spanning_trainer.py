"""A trainer wider than any node: one torchrun group over two daemons on loopback (issue 40).

Three nodes, each with the Automodel environment and one shared checkpoint root: A and B
have two CPU devices, C one. An Automodel job with openrl.trainer_gpus=4, asked of A,
spans A and B (whole nodes first, `cluster/placement/spanning.py`): A is its home (rank 0,
the c10d rendezvous), B holds its two devices for it and runs ranks 2 and 3 (gloo). Its
losses and log-probabilities equal a one-process run's (an Automodel job of one rank, same
seed, on C: through the SDK a pytorch-backend job of the same seed had the same first loss
and then drifted, 84.18 against 82.89 at the second step, which is not this test's subject).

A full fine-tuning job does so too, and what a span adds to one node is shown across the
two: its save, gathered from every rank and written by rank 0 on A, lands on the shared
root, and a load reads every rank's rows back (B's from the same path); its weight sync,
gathered to rank 0, reaches the sampler on A, whose samples score as the trained weights.
Then one of B's ranks is killed with SIGKILL, its node alive: the job ends on A, every
device of A and B is free, no rank of it is left, and the client gets the 410 of a lost job.

A LoRA job spans A and B the same way and its status lists every rank with its node; then
B itself is killed with SIGKILL: the job ends on A within the gossip detection bound, A's
devices are free, B's ranks are gone, and the client gets the 410. A job wider than the
cluster's free devices is refused, naming the setting.
"""

from __future__ import annotations

import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import tinker
from conftest import Daemon, ready_all, write_config
from tinker import types

from openrld.actors.span_members import SpanEnded
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.peer_client import relay_key, sign
from openrld.cluster.placement.span_peers import SPAN_ENDED_PATH, SPAN_START_PATH, SPAN_TAG_HEADER
from tests.processes import children, running, torchruns
from tests.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
AUTOMODEL_PYTHON = REPO / ".venv-automodel" / "bin" / "python"
SECRET = "test-cluster-secret"
HEADERS = {"X-API-Key": "tml-test"}
SPAN = {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "4", "openrl.exclusive": "true"}
FULL = {"openrl.fine_tuning_type": "full"}
TOKENS = list(range(5, 21))

pytestmark = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(), reason="no Automodel environment: `make automodel-env` builds .venv-automodel"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(name: str, join: str, devices: list[str], shared: Path) -> str:
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"\n'
        f'checkpoint_root = "{shared}"\n'
        f'join = [{join}]\nlongpoll_s = 3.0\ndevices = {devices!r}\n\n'
        f'[workers]\nautomodel_python = "{AUTOMODEL_PYTHON}"\nrendezvous_port = {_free_port()}'
    ).replace("'", '"')


def _view(url: str) -> dict[str, dict]:
    body = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    return {m["name"]: m for m in body["members"]}


def _free(url: str, node: str) -> int:
    return sum(1 for d in _view(url)[node]["devices"] if d["groups"] == 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The nodes' data dirs, and under "shared" the checkpoint root they share."""
    root = tmp_path_factory.mktemp("spanning")
    (root / "shared").mkdir()
    return root


@pytest.fixture(scope="module")
def cluster(root: Path, tiny_llama: Path):
    devices = {"node-a": ["cpu:0", "cpu:1"], "node-b": ["cpu:0", "cpu:1"], "node-c": ["cpu:0"]}
    daemons: dict[str, Daemon] = {}
    for name, own in devices.items():
        join = f'"{daemons["node-a"].url.removeprefix("http://")}"' if daemons else ""
        extra = _config(name, join, own, root / "shared")
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, extra)
        daemons[name] = Daemon(root / name, config, root / f"{name}.log").launch()
        if not join:
            daemons[name].ready()
    ready_all(daemons.values())
    try:
        wait_for(lambda: all(_view(daemons["node-a"].url).get(n, {}).get("devices") for n in devices), timeout_s=15.0)
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _train(training: tinker.TrainingClient) -> tuple[list[float], list[float]]:
    """Three steps; (their losses, the trained log-probabilities)."""
    losses = []
    for _ in range(3):
        losses.append(training.forward_backward([_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    logprobs = training.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return losses, logprobs


def test_a_job_wider_than_the_clusters_free_devices_is_refused_naming_the_setting(cluster):
    service = tinker.ServiceClient(base_url=cluster["node-a"].url, api_key="tml-test")
    with pytest.raises(tinker.BadRequestError) as refused:
        service.create_lora_training_client(
            base_model="tiny-llama", rank=4, user_metadata={**SPAN, "openrl.trainer_gpus": "6"}
        ).result()
    service.close("success").result()
    assert str(refused.value).count(
        "openrl.trainer_gpus=6: no node has 6 devices, and a trainer that spans nodes takes free ones only; "
        "the cluster has 5 free (node-a: 2, node-b: 2, node-c: 1)"
    ) == 1


def test_span_calls_need_the_cluster_secrets_tag_and_name_a_span_that_runs(cluster):
    url = cluster["node-a"].url
    body = msgspec.json.encode(SpanEnded("s-0:train:0", "node-b", "its ranks exited"))
    unsigned = httpx.post(f"{url}{SPAN_START_PATH}", content=body, timeout=10)
    forged = httpx.post(f"{url}{SPAN_ENDED_PATH}", content=body, headers={SPAN_TAG_HEADER: "0" * 64}, timeout=10)
    signed = httpx.post(
        f"{url}{SPAN_ENDED_PATH}", content=body, headers={SPAN_TAG_HEADER: sign(relay_key(SECRET), body)}, timeout=10
    )
    assert [unsigned.status_code, forged.status_code, signed.status_code] == [403, 403, 404]
    assert signed.json()["detail"] == "no job s-0:train:0 spans node node-b from here"


def _span_and_alone(
    url: str, service: tinker.ServiceClient, reference: tinker.ServiceClient, metadata: dict[str, str]
) -> tuple[tinker.TrainingClient, tinker.TrainingClient]:
    """A job that spans A and B, and the same job of one rank, which can only go to C once A and B are
    held whole; the two start at once (a torchrun's start is most of either's time here)."""
    with ThreadPoolExecutor(1) as pool:
        spanning = pool.submit(lambda: service.create_lora_training_client(
            base_model="tiny-llama", rank=4, seed=3, user_metadata={**SPAN, **metadata}
        ).result())
        wait_for(lambda: spanning.done() or _free(url, "node-a") == _free(url, "node-b") == 0, timeout_s=30.0)
        alone = reference.create_lora_training_client(
            base_model="tiny-llama", rank=4, seed=3, user_metadata={"openrl.trainer_backend": "automodel", **metadata}
        ).result()
        return spanning.result(), alone


class Trained(msgspec.Struct):
    """A full fine-tuning job that spans A and B, and what three steps gave it and a one-process run."""

    spanning: tinker.TrainingClient
    spanned: tuple[list[float], list[float]]  # its losses and trained log-probabilities (`_train`)
    alone: tuple[list[float], list[float]]  # the same job's, one rank on C


@pytest.fixture(scope="module")
def full_span(cluster):
    """The full fine-tuning span, trained; the one-rank run is closed once trained (C is free again).
    The tests that take it run in file order, and the last of them ends the job."""
    a = cluster["node-a"]
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-test")
    reference = tinker.ServiceClient(base_url=a.url, api_key="tml-test")
    spanning, alone = _span_and_alone(a.url, service, reference, FULL)
    trained = Trained(spanning, _train(spanning), _train(alone))
    reference.close("success").result()
    wait_for(lambda: _free(a.url, "node-c") == 1, timeout_s=30.0)
    yield trained
    service.close("success").result()


def _logprobs(training: tinker.TrainingClient, tokens: list[int]) -> list[float]:
    return training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def _step(training: tinker.TrainingClient) -> None:
    training.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_a_full_fine_tuning_job_spans_two_nodes_and_trains_as_one_process(cluster, full_span: Trained):
    url = cluster["node-a"].url
    status = httpx.get(f"{url}/openrl/v1/models/{full_span.spanning.model_id}/status", headers=HEADERS, timeout=30)
    (spanned_losses, spanned_logprobs), (alone_losses, alone_logprobs) = full_span.spanned, full_span.alone
    assert spanned_losses == pytest.approx(alone_losses, abs=1e-5, rel=0)
    assert spanned_logprobs == pytest.approx(alone_logprobs, abs=1e-5, rel=0)
    assert spanned_losses[2] < spanned_losses[0]
    assert [w["device"] for w in status.json()["workers"] if w["role"] == "trainer"] == [
        "cpu:0", "cpu:1", "node-b/cpu:0", "node-b/cpu:1",
    ]


# load_state into the same job: a new client from the state would be a second span, which A and B cannot
# hold beside this one.
@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_a_spanning_jobs_save_lands_on_the_shared_root_and_every_rank_loads_it_back(root: Path, full_span: Trained):
    training = full_span.spanning
    path = training.save_state("span-3").result().path
    _step(training)
    stepped = _logprobs(training, TOKENS)  # one step past the save
    training.load_state_with_optimizer(path).result()
    loaded = _logprobs(training, TOKENS)
    _step(training)  # the same step again, from the loaded weights and AdamW state
    restepped = _logprobs(training, TOKENS)

    run_id, _, name = path.removeprefix("tinker://").partition("/weights/")
    saved = root / "shared" / run_id / "weights" / name
    assert sorted(p.name for p in saved.iterdir()) == [
        "checkpoint.json", "full_model.json", "model.safetensors", "optimizer.safetensors", "state.json",
    ]
    assert [p for node in ("node-a", "node-b") for p in (root / node).rglob(name)] == []  # no node's own dir
    assert loaded == full_span.spanned[1] and loaded != stepped
    assert restepped == stepped


def test_a_spanning_jobs_weights_reach_its_sampler_on_the_home_node(full_span: Trained):
    training = full_span.spanning
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:8]
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)  # logprobs at temperature 1: the model's
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    sequence = sampled.sequences[0]
    scored = _logprobs(training, prompt + sequence.tokens)
    assert len(sequence.tokens) == 4
    assert sequence.logprobs == pytest.approx(scored[-4:], abs=1e-5, rel=0)
    assert sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:] == pytest.approx(
        _logprobs(training, TOKENS), abs=1e-5, rel=0
    )


def test_a_rank_that_exits_on_a_member_node_ends_the_job_on_every_node_and_frees_every_device(
    cluster, full_span: Trained
):
    a, b = cluster["node-a"], cluster["node-b"]
    saved = full_span.spanning.save_state("before-the-kill").result().path
    groups = {"node-a": torchruns(a.proc.pid), "node-b": torchruns(b.proc.pid)}
    ranks = [rank for pids in groups.values() for torchrun in pids for rank, _ in children(torchrun)]
    member_ranks = [rank for torchrun in groups["node-b"] for rank, _ in children(torchrun)]

    os.kill(member_ranks[0], signal.SIGKILL)
    bound = detection_bound(MembershipConfig.local(), 3)
    took = wait_for(lambda: _free(a.url, "node-a") == 2 and _free(a.url, "node-b") == 2, timeout_s=bound.total_s + 30.0)
    with pytest.raises(tinker.APIStatusError) as lost:
        full_span.spanning.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    wait_for(lambda: not running(ranks + groups["node-a"] + groups["node-b"]), timeout_s=30.0)

    assert [len(pids) for pids in groups.values()] == [1, 1] and len(ranks) == 4
    assert took <= bound.total_s + 10.0, (took, bound)
    assert lost.value.status_code == 410
    assert "its ranks on node node-b exited" in str(lost.value)
    assert f"resume from a saved state; its last checkpoint is {saved}" in str(lost.value)


def test_a_four_rank_job_spans_two_nodes_trains_as_one_process_and_ends_when_a_member_dies(cluster):
    a, b = cluster["node-a"], cluster["node-b"]
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-test")
    spanning, alone = _span_and_alone(a.url, service, service, {})
    spanned_losses, spanned_logprobs = _train(spanning)
    alone_losses, alone_logprobs = _train(alone)
    status = httpx.get(f"{a.url}/openrl/v1/models/{spanning.model_id}/status", headers=HEADERS, timeout=30).json()
    member_ranks = torchruns(b.proc.pid)

    b.kill()
    bound = detection_bound(MembershipConfig.local(), 3)
    took = wait_for(lambda: _free(a.url, "node-a") == 2, timeout_s=bound.total_s + 15.0)
    with pytest.raises(tinker.APIStatusError) as lost:
        spanning.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    wait_for(lambda: not running(member_ranks), timeout_s=30.0)
    service.close("success").result()

    assert spanned_losses == pytest.approx(alone_losses, abs=1e-5, rel=0)
    assert spanned_logprobs == pytest.approx(alone_logprobs, abs=1e-5, rel=0)
    assert [(w["role"], w["rank"], w["device"]) for w in status["workers"]] == [
        ("trainer", 0, "cpu:0"), ("trainer", 1, "cpu:1"),
        ("trainer", 2, "node-b/cpu:0"), ("trainer", 3, "node-b/cpu:1"), ("sampler", 0, "cpu:0"),
    ]
    assert len(member_ranks) == 1
    assert took <= bound.total_s + 10.0, (took, bound)
    assert lost.value.status_code == 410
    assert "node node-b" in str(lost.value) and "resume from a saved state" in str(lost.value)
