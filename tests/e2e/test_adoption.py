"""Runs that outlive their node (issue 41): a job's home is killed mid-run and its training loop goes on.

Real daemons on loopback share one checkpoint root: A is a front node
(`accept_jobs = false`), so the jobs real-SDK loops create through A live on the
others; the tiny Llama auto-saves every step. A job's home is killed with SIGKILL
mid-run; a survivor adopts the job from its newest auto-save, A replays the
requests it kept since that auto-save, and the loop, never restarted, finishes
every step through A. Its losses are those of an uninterrupted run of the same
job (same seed, same data), step for step, and only the step in flight is
recomputed. First with a step's forward_backward and optim_step in flight; then
an RL-shaped loop (save weights for sampling, sample, train on the samples) with
the kill landing while its samples are drawn: the sampling session is made again
on the adopter from the replayed save, and the samples are drawn again there.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, ready_all, write_config
from tinker import types
from waits import wait_for

from openrld.autosave import latest_autosave
from openrld.cluster.relay import RELAYED_HEADER
from openrld.store.job_claims import latest_claim

SECRET = "test-adoption-secret"
KEY = "tml-test"
HEADERS = {"X-API-Key": KEY}
HERE_ONLY = {**HEADERS, RELAYED_HEADER: "test"}  # a node answers about itself only: 200 on the job's home
ADAM = types.AdamParams(learning_rate=1e-2)
STEPS = 6
KILL_AT = 3  # the step in flight when the home is killed (its auto-save of step KILL_AT has landed)
WORKERS = ["node-b", "node-c", "node-d"]  # the nodes that take jobs; each test kills one
NO_AUTOSAVE = {"openrl.autosave_steps": "0"}  # a reference run: nothing adopts it
AUTOSAVE_EVERY_STEP = {"openrl.autosave_steps": "1"}
# Both daemons run the same code on the same CPU with the same thread count: a step recomputed on
# the adopter is the same step; the tolerance only allows for a reordered reduction.
LOSS_TOLERANCE = 1e-5


def data(step: int) -> list[types.Datum]:
    """A step's batch: large enough that its forward_backward is still running a few milliseconds after it is sent."""
    batch = []
    for row in range(8):
        tokens = [(7 * step + 3 * i + 11 * row) % 90 + 5 for i in range(97)]
        batch.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}))
    return batch


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
    for name, more in (("node-a", "accept_jobs = false\n"), ("node-b", ""), ("node-c", ""), ("node-d", "")):
        seeds = [daemons["node-a"].url.removeprefix("http://")] if daemons else []
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, node_config(name, seeds, extra + more))
        daemons[name] = Daemon(root / name, config, root / f"{name}.log").launch()
        if not seeds:
            daemons[name].ready()
    ready_all(daemons.values())
    try:
        wait_for(lambda: seen_alive(daemons["node-a"].url, WORKERS), timeout_s=15.0)
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


def step(training: tinker.TrainingClient, i: int, sent: threading.Event | None = None) -> float:
    """One step as an RL loop pipelines it: the optim_step is sent before the forward_backward's result is read."""
    forward_backward = training.forward_backward(data(i), "cross_entropy")
    optim = training.optim_step(ADAM)
    if sent is not None:
        sent.set()
    loss = forward_backward.result().metrics["loss:sum"]
    optim.result()
    return loss


@pytest.fixture(scope="module")
def reference(cluster) -> list[float]:
    """The losses of the job run through without a kill (it does not auto-save: nothing adopts it)."""
    daemons, _ = cluster
    service = tinker.ServiceClient(base_url=daemons["node-a"].url, api_key=KEY)
    training = service.create_lora_training_client(
        base_model="tiny-llama", rank=4, seed=0, user_metadata=NO_AUTOSAVE
    ).result()
    return [step(training, i) for i in range(STEPS)]


def test_a_loop_goes_on_when_its_jobs_home_is_killed_mid_step(cluster, reference) -> None:
    daemons, shared = cluster
    a = daemons["node-a"].url
    service = tinker.ServiceClient(base_url=a, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0, user_metadata=AUTOSAVE_EVERY_STEP).result()
    model_id = training.model_id
    [victim] = home_of(daemons, model_id)
    losses = [step(training, i) for i in range(KILL_AT)]
    # Step KILL_AT's auto-save has landed, and A holds the job's note (it auto-saves) from the victim's gossip.
    wait_for(lambda: (s := latest_autosave(shared, model_id)) is not None and s.manifest.step == KILL_AT, timeout_s=20.0)
    wait_for(lambda: adoptable_in_gossip(a, victim, model_id), timeout_s=10.0)

    sent = threading.Event()
    failures: list[BaseException] = []

    def rest_of_the_loop() -> None:
        try:
            losses.append(step(training, KILL_AT, sent))
            losses.extend(step(training, i) for i in range(KILL_AT + 1, STEPS))
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    loop = threading.Thread(target=rest_of_the_loop)
    loop.start()
    assert sent.wait(30.0)
    delay_s = random.uniform(0.0, 0.05)
    time.sleep(delay_s)  # the step's forward_backward and optim_step are on their way, or running at the home
    daemons[victim].kill()
    loop.join(120.0)
    assert not loop.is_alive() and failures == [], (delay_s, failures)

    assert losses == pytest.approx(reference, rel=LOSS_TOLERANCE), delay_s
    [adopter] = home_of(daemons, model_id)
    assert adopter != victim
    claim = latest_claim(shared, model_id)
    # The adopter resumed from the auto-save of the step before the one in flight: one step was recomputed.
    assert claim is not None and (claim.adopter, claim.previous_home, claim.step) == (adopter, victim, KILL_AT)
    status = httpx.get(f"{a}/openrl/v1/models/{model_id}/status", headers=HEADERS, timeout=10).json()
    assert status["adopted_from"]["detail"] == f"adopted from node {victim} at step {KILL_AT}"
    assert status["step"] == STEPS  # the step count goes on from the auto-save's
    assert metric(daemons[adopter].url, "openrld_adoptions_total") == 1
    assert metric(a, 'openrld_replayed_requests_total{outcome="replayed"}') >= 1
    # The auto-saves go on, named for the job's own steps, on the adopter.
    wait_for(lambda: (s := latest_autosave(shared, model_id)) is not None and s.manifest.step == STEPS, timeout_s=20.0)


def adoptable_in_gossip(url: str, node: str, model_id: str) -> bool:
    members = {m["name"]: m for m in httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["members"]}
    return model_id in members[node]["jobs"]


# ---------------------------------------------------------------- an RL-shaped loop, killed mid-sample


PROMPT = [5, 17, 29, 41, 53, 65, 77]


def rl_step(training: tinker.TrainingClient, i: int, sampling: threading.Event | None = None) -> tuple[list[list[int]], float]:
    """Save weights for sampling, sample with a fixed seed, train on what was sampled: (the samples, the loss)."""
    sampler = training.save_weights_and_get_sampling_client().result()
    drawn = sampler.sample(
        types.ModelInput.from_ints(PROMPT), num_samples=4,
        sampling_params=types.SamplingParams(max_tokens=48, temperature=1.0, seed=100 + i),
    )
    if sampling is not None:
        sampling.set()
    sequences = [list(s.tokens) for s in drawn.result().sequences]
    batch = [
        types.Datum(model_input=types.ModelInput.from_ints((PROMPT + seq)[:-1]), loss_fn_inputs={"target_tokens": (PROMPT + seq)[1:]})
        for seq in sequences
    ]
    forward_backward = training.forward_backward(batch, "cross_entropy")
    optim = training.optim_step(ADAM)
    loss = forward_backward.result().metrics["loss:sum"]
    optim.result()
    return sequences, loss


def test_an_rl_loop_goes_on_when_its_jobs_home_is_killed_while_it_samples(cluster) -> None:
    daemons, shared = cluster
    a = daemons["node-a"].url
    service = tinker.ServiceClient(base_url=a, api_key=KEY)
    reference_job = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1, user_metadata=NO_AUTOSAVE).result()
    reference = [rl_step(reference_job, i) for i in range(STEPS)]
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1, user_metadata=AUTOSAVE_EVERY_STEP).result()
    model_id = training.model_id
    [victim] = home_of(daemons, model_id)
    steps = [rl_step(training, i) for i in range(KILL_AT)]
    wait_for(lambda: (s := latest_autosave(shared, model_id)) is not None and s.manifest.step == KILL_AT, timeout_s=20.0)
    wait_for(lambda: adoptable_in_gossip(a, victim, model_id), timeout_s=10.0)

    sampling = threading.Event()
    failures: list[BaseException] = []

    def rest_of_the_loop() -> None:
        try:
            steps.append(rl_step(training, KILL_AT, sampling))
            steps.extend(rl_step(training, i) for i in range(KILL_AT + 1, STEPS))
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    loop = threading.Thread(target=rest_of_the_loop)
    loop.start()
    assert sampling.wait(30.0)
    delay_s = random.uniform(0.0, 0.02)
    time.sleep(delay_s)  # the samples are being drawn at the home
    daemons[victim].kill()
    loop.join(120.0)
    assert not loop.is_alive() and failures == [], (delay_s, failures)

    assert [seqs for seqs, _ in steps] == [seqs for seqs, _ in reference], delay_s  # the same draws, redrawn
    assert [loss for _, loss in steps] == pytest.approx([loss for _, loss in reference], rel=LOSS_TOLERANCE), delay_s
    [adopter] = home_of(daemons, model_id)
    claim = latest_claim(shared, model_id)
    assert claim is not None and (claim.adopter, claim.previous_home, claim.step) == (adopter, victim, KILL_AT)
    assert metric(a, 'openrld_replayed_requests_total{outcome="replayed"}') >= 2
