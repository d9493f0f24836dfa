"""Runs that outlive their node (issue 41): a job's home is killed mid-run and its training loop goes on.

Three real daemons on loopback share one checkpoint root: A is a front node
(`accept_jobs = false`), so the job a real-SDK loop creates through A lives on B
or C; the tiny Llama auto-saves every step. The job's home is killed with SIGKILL
mid-run; the other node adopts the job from its newest auto-save, and the loop,
never restarted, finishes every step through A. Its losses are those of an
uninterrupted run of the same job (same seed, same data), step for step.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, ready_all, write_config
from tinker import types
from waits import wait_for

from openrld.autosave import latest_autosave
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.relay import RELAYED_HEADER
from openrld.store.job_claims import latest_claim

SECRET = "test-adoption-secret"
KEY = "tml-test"
HEADERS = {"X-API-Key": KEY}
HERE_ONLY = {**HEADERS, RELAYED_HEADER: "test"}  # a node answers about itself only: 200 on the job's home
ADAM = types.AdamParams(learning_rate=1e-2)
STEPS = 6
AUTOSAVE_EVERY_STEP = {"openrl.autosave_steps": "1"}
# Both daemons run the same code on the same CPU with the same thread count: a step recomputed on
# the adopter is the same step; the tolerance only allows for a reordered reduction.
LOSS_TOLERANCE = 1e-5


def datum(step: int) -> types.Datum:
    tokens = [(7 * step + 3 * i) % 90 + 5 for i in range(17)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


def node_config(name: str, join: list[str], extra: str) -> str:
    seeds = ", ".join(f'"{seed}"' for seed in join)
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\n'
        f'gossip_timing = "local"\njoin = [{seeds}]\nlongpoll_s = 3.0\n{extra}'
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("adoption")
    shared = root / "checkpoints"
    shared.mkdir()
    extra = f'checkpoint_root = "{shared}"\n'
    daemons: dict[str, Daemon] = {}
    for name, more in (("node-a", "accept_jobs = false\n"), ("node-b", ""), ("node-c", "")):
        seeds = [daemons["node-a"].url.removeprefix("http://")] if daemons else []
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, node_config(name, seeds, extra + more))
        daemons[name] = Daemon(root / name, config, root / f"{name}.log").launch()
        if not seeds:
            daemons[name].ready()
    ready_all(daemons.values())
    try:
        wait_for(lambda: seen_alive(daemons["node-a"].url, ["node-b", "node-c"]), timeout_s=15.0)
        yield daemons, shared
    finally:
        for daemon in daemons.values():
            daemon.stop()


def seen_alive(url: str, names: list[str]) -> bool:
    members = {m["name"]: m for m in httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["members"]}
    return all(n in members and members[n]["state"] == "alive" and members[n]["devices"] for n in names)


def home_of(daemons: dict[str, Daemon], model_id: str) -> list[str]:
    return [
        name for name, d in daemons.items()
        if d.proc is not None
        and httpx.get(f"{d.url}/openrl/v1/models/{model_id}/status", headers=HERE_ONLY, timeout=10).status_code == 200
    ]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def step(training: tinker.TrainingClient, i: int) -> float:
    result = training.forward_backward([datum(i)], "cross_entropy").result()
    training.optim_step(ADAM).result()
    return result.metrics["loss:sum"]


@pytest.fixture(scope="module")
def reference(cluster) -> list[float]:
    """The losses of the job run through without a kill (it does not auto-save: nothing adopts it)."""
    daemons, _ = cluster
    service = tinker.ServiceClient(base_url=daemons["node-a"].url, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    return [step(training, i) for i in range(STEPS)]


def test_a_loop_goes_on_when_its_jobs_home_is_killed_between_steps(cluster, reference) -> None:
    daemons, shared = cluster
    a = daemons["node-a"].url
    service = tinker.ServiceClient(base_url=a, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0, user_metadata=AUTOSAVE_EVERY_STEP).result()
    model_id = training.model_id
    [victim] = home_of(daemons, model_id)
    [adopter] = [n for n in ("node-b", "node-c") if n != victim]
    losses = [step(training, i) for i in range(3)]
    # The third step's auto-save has landed, and A holds the job's note (it auto-saves) from the victim's gossip.
    wait_for(lambda: (s := latest_autosave(shared, model_id)) is not None and s.manifest.step == 3, timeout_s=20.0)
    wait_for(lambda: adoptable_in_gossip(a, victim, model_id), timeout_s=10.0)
    daemons[victim].kill()
    killed = time.monotonic()
    losses.append(step(training, 3))
    first_answer_s = time.monotonic() - killed
    losses += [step(training, i) for i in range(4, STEPS)]

    assert losses == pytest.approx(reference, rel=LOSS_TOLERANCE)
    assert home_of(daemons, model_id) == [adopter]
    claim = latest_claim(shared, model_id)
    assert claim is not None and (claim.adopter, claim.previous_home, claim.step) == (adopter, victim, 3)
    status = httpx.get(f"{a}/openrl/v1/models/{model_id}/status", headers=HEADERS, timeout=10).json()
    assert status["adopted_from"]["detail"] == f"adopted from node {victim} at step 3"
    assert status["step"] == STEPS  # the step count goes on from the auto-save's
    assert metric(daemons[adopter].url, "openrld_adoptions_total") == 1
    # The auto-saves go on, named for the job's own steps, on the adopter.
    wait_for(lambda: (s := latest_autosave(shared, model_id)) is not None and s.manifest.step == STEPS, timeout_s=20.0)
    bound = detection_bound(MembershipConfig.local(), 3).total_s
    print(f"kill -> first answer on the adopter: {first_answer_s:.2f} s (detection bound {bound:.2f} s)")


def adoptable_in_gossip(url: str, node: str, model_id: str) -> bool:
    members = {m["name"]: m for m in httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["members"]}
    return model_id in members[node]["jobs"]
