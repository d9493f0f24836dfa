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
Then the issue's chaos run: tinker-cookbook's RL loop on math_rl's arithmetic
environment and the quickstart, each in a process of its own through A, their
jobs on one node, killed at a seeded random time; and two jobs held on their
home by the workers' test hooks (chaos_serve.py), one mid-optim_step and one
mid-save with its auto-save half copied, killed at once.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest
import tinker
from conftest import Daemon, ready_all, write_config
from tinker import types
from waits import wait_for

from openrld.autosave import job_dir, job_ids, latest_autosave, step_dir_name
from openrld.cluster.relay import RELAYED_HEADER
from openrld.store.job_claims import claims_dir, latest_claim

SECRET = "test-adoption-secret"
KEY = "tml-test"
HEADERS = {"X-API-Key": KEY}
HERE_ONLY = {**HEADERS, RELAYED_HEADER: "test"}  # a node answers about itself only: 200 on the job's home
ADAM = types.AdamParams(learning_rate=1e-2)
STEPS = 6
KILL_AT = 3  # the step in flight when the home is killed (its auto-save of step KILL_AT has landed)
# The nodes that take jobs; each test kills one, and the chaos run leaves two survivors to notice it.
WORKERS = ["node-b", "node-c", "node-d", "node-e", "node-f"]
HERE = Path(__file__).parent
REPO = HERE.parents[1]
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
    chaos_dir(shared).mkdir()
    # Copies of the tiny Llama under names of their own: no node has their group yet, so a test's
    # jobs of one of them all go where its first job went (a job joins its base model's group).
    models = {"tiny-llama": tiny_llama}
    for alias in ("tiny-chaos", "tiny-held"):
        models[alias] = Path(shutil.copytree(tiny_llama, root / alias))
    extra = f'checkpoint_root = "{shared}"\n'
    daemons: dict[str, Daemon] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENRLD_CHAOS_DIR", str(chaos_dir(shared)))  # the workers' hooks (chaos_serve.py)
        for name in ["node-a", *WORKERS]:
            seeds = [daemons["node-a"].url.removeprefix("http://")] if daemons else []
            more = "accept_jobs = false\n" if name == "node-a" else ""
            config = write_config(root / f"{name}.toml", root / name, models, node_config(name, seeds, extra + more))
            entry = ("-m", "openrld.cli") if name == "node-a" else (str(HERE / "chaos_serve.py"),)
            daemons[name] = Daemon(root / name, config, root / f"{name}.log", entry=entry).launch()
            if not seeds:
                daemons[name].ready()
    ready_all(daemons.values())
    try:
        wait_for(lambda: seen_alive(daemons["node-a"].url, WORKERS), timeout_s=15.0)
        yield daemons, shared
    finally:
        for daemon in daemons.values():
            daemon.stop()


def chaos_dir(shared: Path) -> Path:
    """Where the workers' hooks look (chaos_serve.py)."""
    return shared.parent / "chaos"


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


def kill_once_reached(victim: Daemon, rest_of_the_loop: Callable[[threading.Event], None], *, max_delay_s: float) -> float:
    """Run `rest_of_the_loop` in a thread; once it sets its event, kill `victim` with SIGKILL up to
    `max_delay_s` later (at random). The loop must then end, never restarted, without an error.
    Returns the delay, for a failure's message."""
    reached = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            rest_of_the_loop(reached)
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    loop = threading.Thread(target=run)
    loop.start()
    assert reached.wait(30.0)
    delay_s = random.uniform(0.0, max_delay_s)
    time.sleep(delay_s)
    victim.kill()
    loop.join(120.0)
    assert not loop.is_alive() and failures == [], (delay_s, failures)
    return delay_s


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

    def rest_of_the_loop(sent: threading.Event) -> None:
        losses.append(step(training, KILL_AT, sent))
        losses.extend(step(training, i) for i in range(KILL_AT + 1, STEPS))

    # The step's forward_backward and optim_step are on their way, or running at the home, when it dies.
    delay_s = kill_once_reached(daemons[victim], rest_of_the_loop, max_delay_s=0.01)

    assert losses == pytest.approx(reference, rel=LOSS_TOLERANCE), delay_s
    [adopter] = home_of(daemons, model_id)
    assert adopter != victim
    claim = latest_claim(shared, model_id)
    # The adopter resumed from the auto-save of the step before the one in flight (one step recomputed),
    # or of that step itself when the step and its auto-save were done before the kill landed (none).
    assert claim is not None and (claim.adopter, claim.previous_home) == (adopter, victim)
    assert claim.step in (KILL_AT, KILL_AT + 1), (delay_s, claim.step)
    status = httpx.get(f"{a}/openrl/v1/models/{model_id}/status", headers=HEADERS, timeout=10).json()
    assert status["adopted_from"]["detail"] == f"adopted from node {victim} at step {claim.step}"
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

    def rest_of_the_loop(sampling: threading.Event) -> None:
        steps.append(rl_step(training, KILL_AT, sampling))
        steps.extend(rl_step(training, i) for i in range(KILL_AT + 1, STEPS))

    # The samples are being drawn at the home when it dies.
    delay_s = kill_once_reached(daemons[victim], rest_of_the_loop, max_delay_s=0.02)

    assert [seqs for seqs, _ in steps] == [seqs for seqs, _ in reference], delay_s  # the same draws, redrawn
    assert [loss for _, loss in steps] == pytest.approx([loss for _, loss in reference], rel=LOSS_TOLERANCE), delay_s
    [adopter] = home_of(daemons, model_id)
    claim = latest_claim(shared, model_id)
    # From the auto-save of the step before the one sampling, or, when that step was done and saved
    # before the kill landed, of that step.
    assert claim is not None and (claim.adopter, claim.previous_home) == (adopter, victim)
    assert claim.step in (KILL_AT, KILL_AT + 1), (delay_s, claim.step)
    assert metric(a, 'openrld_replayed_requests_total{outcome="replayed"}') >= 2


# ---------------------------------------------------------------- the chaos run: the cookbook's loop and the quickstart

CHAOS_MODEL = "tiny-chaos"
# Steps enough that the kill lands steps before the cookbook's last one and the named checkpoint it
# saves after it: a named save its dead home wrote but had not answered is refused on the adopter
# ('already exists', the home's copy adopted with the run), which the loop does not survive.
COOKBOOK_STEPS = 6
QUICKSTART_STEPS = 12
# The quickstart's own arguments, small. On the tiny Llama a group's rewards mostly all match, and a
# step that finds no group whose rewards differ trains nothing; with this seed its first step
# trains, so its job has an auto-save early (a job is adopted from its auto-save, none before).
QUICKSTART_ARGS = ["--problems-per-step", "2", "--group-size", "8", "--max-tokens", "8", "--seed", "4"]
KILL_WINDOW_S = 0.5  # the kill lands this long at most after both loops go on from their first auto-saves


def launch(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A researcher's script, in a process of its own, from the repository root."""
    return subprocess.Popen(argv, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def new_job(shared: Path, known: set[str]) -> str:
    """The model id of a job not in `known` that has a complete auto-save (waits for it)."""
    found: list[str] = []

    def saved() -> bool:
        found[:] = [m for m in job_ids(shared) if m not in known and latest_autosave(shared, m) is not None]
        return bool(found)

    wait_for(saved, timeout_s=240.0, poll_s=0.02)  # the cookbook imports for tens of seconds on a busy machine
    return found[0]


def replayed_optim_steps(log: str, model_id: str) -> int:
    """The optim_steps of `model_id` that a node's log says it replayed on an adopter (replay.py)."""
    return sum(
        1 for line in log.splitlines()
        if f"replayed model_id={model_id} seq_id=" in line and "path=/api/v1/optim_step " in line
    )


def steps_logged(path: Path, rows_of_a_step: str) -> list[int]:
    """The `step` of each row of a JSONL log that has the key `rows_of_a_step`."""
    rows = [msgspec.json.decode(line) for line in path.read_text().splitlines()]
    return [row["step"] for row in rows if rows_of_a_step in row]


def test_the_cookbooks_loop_and_the_quickstart_finish_every_step_when_their_jobs_home_is_killed(
    cluster, tmp_path: Path
) -> None:
    daemons, shared = cluster
    a = daemons["node-a"].url
    # A failure names its seed; OPENRLD_CHAOS_SEED=<it> kills as long after both auto-saves again.
    seed = int(os.environ.get("OPENRLD_CHAOS_SEED", random.randrange(1 << 32)))
    print(f"chaos seed {seed}")
    delay_s = random.Random(seed).uniform(0.0, KILL_WINDOW_S)
    tokenizer = shared.parent / CHAOS_MODEL
    known = set(job_ids(shared))
    cookbook = launch(
        [sys.executable, str(HERE / "cookbook_arithmetic.py"), a, CHAOS_MODEL, str(tokenizer), str(tmp_path / "cookbook"),
         str(COOKBOOK_STEPS)],
        tmp_path / "cookbook.out",
    )
    quickstart = None
    try:
        cookbook_job = new_job(shared, known)
        # The cookbook's loop starts far slower than the quickstart (its imports): it waits, stopped
        # where it is, until the quickstart has an auto-save too, so that the kill finds both mid-run.
        cookbook.send_signal(signal.SIGSTOP)
        quickstart = launch(
            [sys.executable, "-m", "recipes.quickstart", "--url", a, "--api-key", KEY, "--base-model", CHAOS_MODEL,
             "--tokenizer", str(tokenizer), "--steps", str(QUICKSTART_STEPS), *QUICKSTART_ARGS,
             "--out", str(tmp_path / "quickstart")],
            tmp_path / "quickstart.out",
        )
        quickstart_job = new_job(shared, known | {cookbook_job})
        cookbook.send_signal(signal.SIGCONT)
        jobs = [cookbook_job, quickstart_job]
        [victim] = home_of(daemons, cookbook_job)
        assert home_of(daemons, quickstart_job) == [victim]
        survivors = [n for n in WORKERS if n != victim and daemons[n].proc is not None]
        assert len(survivors) == 2
        adoptions = sum(metric(daemons[n].url, "openrld_adoptions_total") for n in survivors)
        for model_id in jobs:
            wait_for(lambda m=model_id: adoptable_in_gossip(a, victim, m), timeout_s=10.0)
        time.sleep(delay_s)
        assert cookbook.poll() is None and quickstart.poll() is None, f"seed {seed}: a loop ended before the kill"
        daemons[victim].kill()
        # Both survivors notice the death; each job gets one claim, by one of them.
        for name in survivors:
            wait_for(lambda u=daemons[name].url: member_state(u, victim) == "dead", timeout_s=20.0)
        # Read while the loops run: once a loop's session finishes, its adopter removes the job's
        # auto-saves, and the claims with them.
        for model_id in jobs:
            wait_for(lambda m=model_id: latest_claim(shared, m) is not None, timeout_s=60.0)
        claims = {m: (sorted(p.name for p in claims_dir(shared, m).iterdir()), latest_claim(shared, m)) for m in jobs}
        assert cookbook.wait(180.0) == 0, f"seed {seed}: " + (tmp_path / "cookbook.out").read_text()[-3000:]
        assert quickstart.wait(180.0) == 0, f"seed {seed}: " + (tmp_path / "quickstart.out").read_text()[-3000:]
    finally:
        for loop in (cookbook, quickstart):
            if loop is not None and loop.poll() is None:
                loop.kill()

    # Every step once, in order: no gap, none twice.
    assert steps_logged(tmp_path / "cookbook" / "metrics.jsonl", "env/all/reward/total") == list(range(COOKBOOK_STEPS))
    quickstart_steps = steps_logged(tmp_path / "quickstart" / "rewards.jsonl", "mean_reward")
    assert quickstart_steps == list(range(QUICKSTART_STEPS)), seed
    trained = [row for row in (tmp_path / "quickstart" / "rewards.jsonl").read_text().splitlines() if '"groups_used":0' not in row]
    for model_id, optim_steps in ((cookbook_job, COOKBOOK_STEPS), (quickstart_job, len(trained))):
        names, claim = claims[model_id]
        assert names == ["000000001.json"], seed  # one adopter
        assert claim is not None and claim.previous_home == victim and claim.adopter in survivors, seed
        status = httpx.get(f"{a}/openrl/v1/models/{model_id}/status", headers=HEADERS, timeout=10).json()
        assert status["adopted_from"]["detail"] == f"adopted from node {victim} at step {claim.step}", seed
        assert status["step"] == optim_steps, seed  # the job's steps, each applied once in its line
        # Every step the adopter computed again is one that A replayed to it: at most one.
        assert replayed_optim_steps(daemons["node-a"].log(), model_id) <= 1, seed
        # The console's curve goes on from the step the job was adopted at, each step once; the points
        # of the steps before lived in the dead node's store.
        curves = httpx.get(f"{a}/openrl/v1/runs/{model_id}/curves", headers=HEADERS, timeout=10).json()
        assert [p["step"] for p in curves["points"]] == list(range(claim.step + 1, optim_steps + 1)), seed
    assert sum(metric(daemons[n].url, "openrld_adoptions_total") for n in survivors) == adoptions + 2


def member_state(url: str, name: str) -> str | None:
    members = {m["name"]: m for m in httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["members"]}
    return members[name]["state"] if name in members else None


# ---------------------------------------------------------------- killed mid-optim_step and mid-save


def arm(shared: Path, hook: str, model_id: str) -> None:
    """The next `hook` of `model_id` on its home holds there (chaos_serve.py)."""
    (chaos_dir(shared) / f"{hook}-{model_id}").touch()


def group_in_view(url: str, node: str, base_model: str) -> bool:
    members = {m["name"]: m for m in httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["members"]}
    return any(g["base_model"] == base_model for g in members[node]["groups"])


def held(shared: Path, marker: str, model_id: str) -> bool:
    return (chaos_dir(shared) / f"{marker}-{model_id}").exists()


def test_jobs_killed_mid_optim_step_mid_save_and_mid_named_save_resume_from_their_newest_complete_auto_save(
    cluster, reference
) -> None:
    daemons, shared = cluster
    a = daemons["node-a"].url
    service = tinker.ServiceClient(base_url=a, api_key=KEY)
    def new_job() -> tinker.TrainingClient:
        return service.create_lora_training_client(
            base_model="tiny-held", rank=4, seed=0, user_metadata=AUTOSAVE_EVERY_STEP
        ).result()

    in_optim = new_job()
    [victim] = home_of(daemons, in_optim.model_id)
    # Once A's view holds the first job's group on its node, the second joins that group there.
    wait_for(lambda: group_in_view(a, victim, "tiny-held"), timeout_s=20.0)
    in_save = new_job()
    assert home_of(daemons, in_save.model_id) == [victim]
    jobs = [in_optim, in_save]
    losses = {job.model_id: [step(job, i) for i in range(KILL_AT)] for job in jobs}
    for job in jobs:
        wait_for(lambda m=job.model_id: (s := latest_autosave(shared, m)) is not None and s.manifest.step == KILL_AT, timeout_s=20.0)
        wait_for(lambda m=job.model_id: adoptable_in_gossip(a, victim, m), timeout_s=10.0)

    # One job's next step is answered, and its auto-save is then copied into place half-way and held there.
    arm(shared, "slow-save", in_save.model_id)
    losses[in_save.model_id].append(step(in_save, KILL_AT))
    wait_for(lambda: held(shared, "save-held", in_save.model_id), timeout_s=20.0)
    half_written = job_dir(shared, in_save.model_id) / step_dir_name(KILL_AT + 1)
    assert half_written.is_dir()
    # Its named save then lands on the root, recorded, and its home never answers it.
    arm(shared, "slow-named-save", in_save.model_id)
    named_save = in_save.save_state("after-the-held-step")
    wait_for(lambda: held(shared, "named-save-held", in_save.model_id), timeout_s=20.0)
    # The other's forward_backward is answered; its optim_step is applied on the home, which holds its answer.
    arm(shared, "slow-optim", in_optim.model_id)
    failures: list[BaseException] = []

    def rest_of_the_loop() -> None:
        try:
            forward_backward = in_optim.forward_backward(data(KILL_AT), "cross_entropy")
            losses[in_optim.model_id].append(forward_backward.result().metrics["loss:sum"])
            in_optim.optim_step(ADAM).result()
            losses[in_optim.model_id].extend(step(in_optim, i) for i in range(KILL_AT + 1, STEPS))
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    loop = threading.Thread(target=rest_of_the_loop)
    loop.start()
    wait_for(lambda: held(shared, "optim-held", in_optim.model_id), timeout_s=20.0)
    assert latest_autosave(shared, in_save.model_id).manifest.step == KILL_AT  # the half-written one is not taken
    daemons[victim].kill()
    losses[in_save.model_id].extend(step(in_save, i) for i in range(KILL_AT + 1, STEPS))
    loop.join(120.0)
    assert not loop.is_alive() and failures == [], failures
    # Replayed on the adopter after the recomputed step, the save writes its checkpoint again.
    assert named_save.result(timeout=120).path == f"tinker://{in_save.model_id}/weights/after-the-held-step"

    for job in jobs:
        assert losses[job.model_id] == pytest.approx(reference, rel=LOSS_TOLERANCE), job.model_id
        [adopter] = home_of(daemons, job.model_id)
        claim = latest_claim(shared, job.model_id)
        # Each resumed from its newest complete auto-save, the step before the one held: one step recomputed.
        assert claim is not None and (claim.adopter, claim.previous_home, claim.step) == (adopter, victim, KILL_AT)
        assert replayed_optim_steps(daemons["node-a"].log(), job.model_id) == 1
        status = httpx.get(f"{a}/openrl/v1/models/{job.model_id}/status", headers=HEADERS, timeout=10).json()
        assert status["step"] == STEPS
    # The adopter's auto-save of the recomputed step took the half-written one's place, and the later ones followed.
    wait_for(lambda: latest_autosave(shared, in_save.model_id).manifest.step == STEPS, timeout_s=20.0)
