"""Any node answers: three real daemons, a client that talks only to node A, jobs placed on B and C.

A is a front node (`accept_jobs = false`), so every job it is asked for lands
on B or C, one device each. The module shares one cluster and its tests run in
file order: jobs are created, trained and sampled through A, listed from every
node, then C is killed with SIGKILL and its job reports `lost`. A second,
smaller cluster fires exclusive jobs at every node at once.
"""

from __future__ import annotations

import base64
import concurrent.futures
import gzip
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import tinker
from conftest import Daemon, ready_all, write_config
from sdk_venvs import run_loop
from tinker import types

from openrld.actors.sessions import SessionSnapshot
from openrld.cluster.membership.codec import decode_push_pull, encode_push_pull, secret_key
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.membership.messages import PushPull
from openrld.cluster.membership.peer_client import PUSH_PULL_PATH, TAG_HEADER
from openrld.cluster.relay import LOCATE_PATH, LOCATE_TAG_HEADER, RELAYED_HEADER, SESSION_HEADER, SESSION_TAG_HEADER
from openrld.sdk_support import OLDEST_SERVED
from tests.waits import wait_for

SECRET = "test-cluster-secret"
KEY = "tml-test"
HEADERS = {"X-API-Key": KEY}
LOCAL = MembershipConfig.local()
# Reading the status with this header asks a node about itself: 200 only on the job's home.
HERE_ONLY = {**HEADERS, RELAYED_HEADER: "test"}
NO_AUTOSAVE = {"openrl.autosave_steps": "0"}


def cluster_config(name: str, join: list[str], extra: str = "") -> str:
    seeds = ", ".join(f'"{seed}"' for seed in join)
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\n'
        f'gossip_timing = "local"\njoin = [{seeds}]\nlongpoll_s = 3.0\n{extra}'
    )


def start_cluster(root: Path, models: dict[str, Path], extras: dict[str, str]) -> dict[str, Daemon]:
    """The first node, then the others side by side, each joining through the first."""
    daemons: dict[str, Daemon] = {}
    for name, extra in extras.items():
        seeds = [next(iter(daemons.values())).url.removeprefix("http://")] if daemons else []
        config = write_config(root / f"{name}.toml", root / name, models, cluster_config(name, seeds, extra))
        daemons[name] = Daemon(root / name, config, root / f"{name}.log").launch()
        if not seeds:
            daemons[name].ready()  # the others need its address
    ready_all(daemons.values())
    return daemons


def view(url: str) -> dict[str, dict]:
    body = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    return {m["name"]: m for m in body["members"]}


def devices_seen(url: str, names: list[str]) -> bool:
    members = view(url)
    return all(n in members and members[n]["state"] == "alive" and members[n]["devices"] for n in names)


def groups_on(url: str) -> set[str]:
    """The base models of the groups a node runs, from its own /metrics (its statistics now)."""
    lines = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=10).text.splitlines()
    return {
        line.split('base_model="', 1)[1].split('"', 1)[0]
        for line in lines
        if line.startswith(("openrld_trainer_jobs{", "openrld_sampler_queue_depth{"))
    }


def gossiped_checkpoint(url: str, node: str, model_id: str) -> str:
    """The last checkpoint of `model_id` in `node`'s gossip payload as the node at `url` holds it ("" if none).

    Read with a push-pull that carries no members (so it changes nothing): the answer is the
    node's whole membership table, which only the cluster secret opens.
    """
    key = secret_key(SECRET)
    body, tag = encode_push_pull(key, PushPull("test-reader", False, ()))
    answer = httpx.post(f"{url}{PUSH_PULL_PATH}", content=body, headers={TAG_HEADER: tag}, timeout=10)
    table = decode_push_pull(key, answer.content, answer.headers[TAG_HEADER])
    notes = next(m.payload.job_notes for m in table.members if m.name == node)
    return notes[model_id].last_checkpoint if model_id in notes else ""


def home_of(cluster: dict[str, Daemon], model_id: str) -> list[str]:
    return [
        name for name, d in cluster.items()
        if d.proc is not None
        and httpx.get(f"{d.url}/openrl/v1/models/{model_id}/status", headers=HERE_ONLY, timeout=10).status_code == 200
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_qwen3: Path):
    root = tmp_path_factory.mktemp("cluster-jobs")
    shared = root / "checkpoints"
    shared.mkdir()  # the shared filesystem, mounted before the nodes start
    extra = f'checkpoint_root = "{shared}"\n'
    daemons = start_cluster(
        root, {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3},
        {"node-a": "accept_jobs = false\n" + extra, "node-b": extra, "node-c": extra},
    )
    try:
        wait_for(lambda: devices_seen(daemons["node-a"].url, ["node-b", "node-c"]), timeout_s=15.0)
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


@pytest.fixture(scope="module")
def service(cluster: dict[str, Daemon]):
    client = tinker.ServiceClient(base_url=cluster["node-a"].url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def jobs(service) -> dict[str, tinker.TrainingClient]:
    # Created at the same time: the placer must spread them although neither node's gossip shows the other yet.
    # Without auto-saves: a killed node's job is lost, not adopted (tests/e2e/test_adoption.py adopts them).
    creating = {
        name: service.create_lora_training_client(base_model=name, rank=4, seed=0, user_metadata=NO_AUTOSAVE)
        for name in ("tiny-llama", "tiny-qwen3")
    }
    return {name: future.result() for name, future in creating.items()}


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_jobs_created_through_a_front_node_land_one_on_b_and_one_on_c(cluster, jobs) -> None:
    homes = sorted(home for job in jobs.values() for home in home_of(cluster, job.model_id))
    assert homes == ["node-b", "node-c"]


def test_training_through_a_runs_at_the_home_node(jobs) -> None:
    for job in jobs.values():
        result = job.forward_backward([datum([1, 5, 9, 13, 17])], "cross_entropy").result()
        job.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert len(result.loss_fn_outputs) == 1


def test_sampling_through_a_runs_at_the_home_node(jobs) -> None:
    sampler = jobs["tiny-llama"].save_weights_and_get_sampling_client("relayed")
    result = sampler.sample(
        types.ModelInput.from_ints([1, 5, 9]), num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3),
    ).result()
    assert [len(s.tokens) for s in result.sequences] == [4, 4]


def test_a_compressed_json_body_is_relayed_to_its_models_home(cluster, jobs) -> None:
    model_id = jobs["tiny-llama"].model_id
    response = httpx.post(
        f"{cluster['node-a'].url}/api/v1/get_info", content=gzip.compress(json.dumps({"model_id": model_id}).encode()),
        headers={**HEADERS, "Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=30,
    )
    assert (response.status_code, response.json()["model_id"]) == (200, model_id)


def test_the_oldest_sdk_runs_its_loop_through_the_front_node(cluster) -> None:
    # SDK 0.16.1 sends forward_backward and forward as JSON and reads results as JSON: the
    # relay finds the model in a JSON body as in a protobuf one, and passes Accept on.
    result = run_loop(OLDEST_SERVED, cluster["node-a"].url, "tiny-llama")
    assert result["restored_loss"] == result["trained_loss"]
    assert result["checkpoints"] == [["sampler", "sampler_weights/sampler-a"], ["training", "weights/state-a"]]


def test_a_base_model_sampler_asked_of_the_front_node_runs_on_another(cluster, service) -> None:
    sampler = service.create_sampling_client(base_model="tiny-qwen3").result()
    result = sampler.sample(
        types.ModelInput.from_ints([1, 5, 9]), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=1.0, seed=3),
    ).result()
    assert [len(s.tokens) for s in result.sequences] == [3]
    # A's own statistics, not its gossip (which shows a group only at the next payload refresh).
    assert groups_on(cluster["node-a"].url) == set()


def test_every_node_lists_the_runs_of_every_node(cluster, jobs) -> None:
    wanted = {job.model_id for job in jobs.values()}
    for daemon in cluster.values():
        other = tinker.ServiceClient(base_url=daemon.url, api_key=KEY)
        listed = {run.training_run_id for run in other.create_rest_client().list_training_runs(limit=50).result().training_runs}
        other.close("success").result()
        assert wanted <= listed, daemon.url


def test_a_model_no_node_has_is_404_from_any_node(cluster) -> None:
    for daemon in cluster.values():
        answer = httpx.get(f"{daemon.url}/openrl/v1/models/s-0000000000000000:train:9/status", headers=HEADERS, timeout=10)
        assert (answer.status_code, answer.json()) == (404, {"detail": "no model 's-0000000000000000:train:9'"})


def test_locate_without_the_cluster_secret_is_403(cluster) -> None:
    answer = httpx.post(
        f"{cluster['node-b'].url}{LOCATE_PATH}", json={"kind": "model", "id": "x"},
        headers={LOCATE_TAG_HEADER: "0" * 64}, timeout=10,
    )
    assert (answer.status_code, answer.json()) == (403, {"detail": "locate needs a tag made with the cluster secret"})


def test_a_session_forged_without_the_cluster_secret_is_not_taken(cluster) -> None:
    snapshot = SessionSnapshot("s-forged", "anyone", [], {}, "0.38.0", None, None)
    value = base64.urlsafe_b64encode(msgspec.json.encode(snapshot)).decode()
    answer = httpx.post(
        f"{cluster['node-b'].url}/api/v1/create_model", timeout=10,
        headers={**HERE_ONLY, SESSION_HEADER: value, SESSION_TAG_HEADER: "0" * 64},
        json={"session_id": "s-forged", "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
    )
    assert (answer.status_code, answer.json()) == (404, {"detail": "no session 's-forged'"})


def test_a_killed_node_is_declared_dead_within_the_bound_and_its_job_is_lost(cluster, jobs) -> None:
    victim = next(j for j in jobs.values() if home_of(cluster, j.model_id) == ["node-c"])
    path = victim.save_state("before-the-crash").result().path
    a = cluster["node-a"].url
    # A must hold the checkpoint in C's gossip before C dies: C publishes it at its next payload refresh.
    wait_for(lambda: gossiped_checkpoint(a, "node-c", victim.model_id) == path, timeout_s=10.0)
    cluster["node-c"].kill()
    bound = detection_bound(LOCAL, 3)
    took = wait_for(lambda: view(a)["node-c"]["state"] == "dead", timeout_s=bound.total_s + 5.0)
    assert took <= bound.total_s + 1.0, (took, bound)
    status = httpx.get(f"{a}/openrl/v1/models/{victim.model_id}/status", headers=HEADERS, timeout=10).json()
    assert (status["state"], status["last_checkpoint"]) == ("lost", path)


def test_a_call_to_a_lost_job_fails_at_once_naming_its_checkpoint(cluster, jobs) -> None:
    victim = next(j for j in jobs.values() if j.model_id in view(cluster["node-a"].url)["node-c"]["jobs"])
    started = time.monotonic()
    with pytest.raises(tinker.APIStatusError) as excinfo:
        victim.forward_backward([datum([1, 5, 9])], "cross_entropy").result()
    assert time.monotonic() - started < 5.0
    assert excinfo.value.status_code == 410
    assert f"tinker://{victim.model_id}/weights/before-the-crash" in str(excinfo.value)


def test_a_lost_job_resumes_on_a_surviving_node_from_the_shared_checkpoint_root(cluster, jobs, service) -> None:
    victim = next(j for j in jobs.values() if j.model_id in view(cluster["node-a"].url)["node-c"]["jobs"])
    resumed = service.create_training_client_from_state(f"tinker://{victim.model_id}/weights/before-the-crash")
    assert home_of(cluster, resumed.model_id) == ["node-b"]
    result = resumed.forward_backward([datum([1, 5, 9, 13])], "cross_entropy").result()
    assert len(result.loss_fn_outputs) == 1


def test_the_node_that_adopted_a_lost_run_still_reports_the_old_job_lost(cluster, jobs) -> None:
    victim = next(j for j in jobs.values() if j.model_id in view(cluster["node-a"].url)["node-c"]["jobs"])
    status = httpx.get(f"{cluster['node-b'].url}/openrl/v1/models/{victim.model_id}/status", headers=HEADERS, timeout=10)
    assert (status.status_code, status.json()["state"]) == (200, "lost")


# ---------------------------------------------------------------- concurrent placement


@pytest.fixture(scope="module")
def trio_of_nodes(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("cluster-race")
    daemons = start_cluster(root, {"tiny-llama": tiny_llama}, {"race-a": "", "race-b": "", "race-c": ""})
    try:
        names = list(daemons)
        wait_for(lambda: all(devices_seen(d.url, names) for d in daemons.values()), timeout_s=15.0)
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


def test_exclusive_jobs_fired_at_every_node_at_once_never_share_a_device(trio_of_nodes) -> None:
    entries = [d.url for d in trio_of_nodes.values()] * 2  # six jobs, three devices in the cluster
    sessions = [
        httpx.post(
            f"{url}/api/v1/create_session", headers=HEADERS, timeout=10,
            json={"sdk_version": "0.38.0", "tags": [], "user_metadata": {"openrl.exclusive": "true"}},
        ).json()["session_id"]
        for url in entries
    ]

    def create(i: int) -> httpx.Response:
        return httpx.post(
            f"{entries[i]}/api/v1/create_model", headers=HEADERS, timeout=60,
            json={"session_id": sessions[i], "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
        )

    with concurrent.futures.ThreadPoolExecutor(len(entries)) as pool:
        answers = list(pool.map(create, range(len(entries))))
    accepted = [a.json()["model_id"] for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    homes = sorted(home for model_id in accepted for home in home_of(trio_of_nodes, model_id))
    assert homes == ["race-a", "race-b", "race-c"]
    assert [(a.status_code, "openrl.exclusive" in a.json()["detail"]) for a in refused] == [(400, True)] * 3
    RACE_SESSIONS.extend(zip(entries, sessions))


RACE_SESSIONS: list[tuple[str, str]] = []  # (entry node url, session id) of the race above


def exclusive_job(url: str) -> httpx.Response:
    session = httpx.post(
        f"{url}/api/v1/create_session", headers=HEADERS, timeout=10,
        json={"sdk_version": "0.38.0", "tags": [], "user_metadata": {"openrl.exclusive": "true"}},
    ).json()["session_id"]
    return httpx.post(
        f"{url}/api/v1/create_model", headers=HEADERS, timeout=60,
        json={"session_id": session, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
    )


def test_finishing_sessions_at_their_entry_node_frees_the_devices_of_jobs_placed_elsewhere(trio_of_nodes) -> None:
    for url, session in RACE_SESSIONS:
        finished = httpx.post(
            f"{url}/api/v1/sessions/{session}/finish", headers=HEADERS, timeout=30,
            json={"reason": {"type": "success"}, "detail": None},
        )
        assert finished.status_code == 200, finished.text

    def three_free() -> bool:
        return all(
            d["groups"] == 0 for m in view(trio_of_nodes["race-a"].url).values() for d in m["devices"]
        )

    wait_for(three_free, timeout_s=15.0, poll_s=0.2)  # the groups stop, then a payload refresh shows it
    # A stopped group's device goes back to its node's pool just after the gossip shows the group
    # gone, so a node may still refuse an exclusive job for a moment (a 400 naming the job).
    answers = [exclusive_job_once_free(d.url) for d in trio_of_nodes.values()]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]


def exclusive_job_once_free(url: str, timeout_s: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = exclusive_job(url)
        if answer.status_code != 400 or "is in use" not in answer.text or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def test_every_placement_is_counted_once_in_metrics(trio_of_nodes) -> None:
    def placed(url: str) -> int:
        text = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=10).text
        line = next(row for row in text.splitlines() if row.startswith('openrld_placements_total{outcome="placed"}'))
        return int(float(line.split()[-1]))

    assert sum(placed(d.url) for d in trio_of_nodes.values()) == 6  # three in the race, three after the finish
