"""A trainer wider than any node: one torchrun group over two daemons on loopback (issue 40).

Three nodes, each with the Automodel environment: A and B have two CPU devices, C one.
An Automodel LoRA job with openrl.trainer_gpus=4, asked of A, spans A and B (whole
nodes first, `cluster/placement/spanning.py`): A is its home (rank 0, the c10d
rendezvous), B holds its two devices for it and runs ranks 2 and 3 (gloo). Its losses
and log-probabilities equal a one-process run's (an Automodel job of one rank, same seed,
on C: through the SDK a pytorch-backend job of the same seed had the same first loss and
then drifted, 84.18 against 82.89 at the second step, which is not this test's subject);
the status lists every rank with its node. Then B is killed with SIGKILL: the job ends
on A within the gossip detection bound, A's devices are free, B's ranks are gone, and
the client gets the 410 of a lost job. A job wider than the cluster's free devices is
refused, naming the setting.

Full fine-tuning, saving and loading run the same code path as on one node: the group
is one engine behind rank 0 whichever node its other ranks are on, so the one-node
tests (tests/gpu/test_automodel_trainer.py, tests/e2e/test_automodel_jobs.py) cover them.
"""

from __future__ import annotations

import socket
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
from tests.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
AUTOMODEL_PYTHON = REPO / ".venv-automodel" / "bin" / "python"
SECRET = "test-cluster-secret"
HEADERS = {"X-API-Key": "tml-test"}
SPAN = {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "4", "openrl.exclusive": "true"}
TOKENS = list(range(5, 21))

pytestmark = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(), reason="no Automodel environment: `make automodel-env` builds .venv-automodel"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(name: str, join: str, devices: list[str]) -> str:
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"\n'
        f'join = [{join}]\nlongpoll_s = 3.0\ndevices = {devices!r}\n\n'
        f'[workers]\nautomodel_python = "{AUTOMODEL_PYTHON}"\nrendezvous_port = {_free_port()}'
    ).replace("'", '"')


def _view(url: str) -> dict[str, dict]:
    body = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    return {m["name"]: m for m in body["members"]}


def _free(url: str, node: str) -> int:
    return sum(1 for d in _view(url)[node]["devices"] if d["groups"] == 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("spanning")
    devices = {"node-a": ["cpu:0", "cpu:1"], "node-b": ["cpu:0", "cpu:1"], "node-c": ["cpu:0"]}
    daemons: dict[str, Daemon] = {}
    for name, own in devices.items():
        join = f'"{daemons["node-a"].url.removeprefix("http://")}"' if daemons else ""
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, _config(name, join, own))
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


def _torchruns(daemon: Daemon) -> list[int]:
    """The torchrun children of a daemon, and theirs: what holds its devices for a trainer."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == daemon.proc.pid and b"torch.distributed.run" in command:
            found.append(int(entry.name))
    return found


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


def test_a_four_rank_job_spans_two_nodes_trains_as_one_process_and_ends_when_a_member_dies(cluster):
    a, b = cluster["node-a"], cluster["node-b"]
    service = tinker.ServiceClient(base_url=a.url, api_key="tml-test")
    spanning = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3, user_metadata=SPAN).result()
    # A and B are held whole: the one-process reference (one rank) can only go to C.
    wait_for(lambda: _free(a.url, "node-a") == 0 and _free(a.url, "node-b") == 0, timeout_s=10.0)
    alone = service.create_lora_training_client(
        base_model="tiny-llama", rank=4, seed=3, user_metadata={"openrl.trainer_backend": "automodel"}
    ).result()
    spanned_losses, spanned_logprobs = _train(spanning)
    alone_losses, alone_logprobs = _train(alone)
    status = httpx.get(f"{a.url}/openrl/v1/models/{spanning.model_id}/status", headers=HEADERS, timeout=30).json()
    member_ranks = _torchruns(b)

    b.kill()
    bound = detection_bound(MembershipConfig.local(), 3)
    took = wait_for(lambda: _free(a.url, "node-a") == 2, timeout_s=bound.total_s + 15.0)
    with pytest.raises(tinker.APIStatusError) as lost:
        spanning.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in member_ranks), timeout_s=30.0)
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
