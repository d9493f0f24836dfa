"""Real daemons on loopback forming a cluster: join, list each other, refuse strangers, detect a kill -9, leave.

Starting a daemon costs seconds, so the module shares one three-node cluster,
and its tests run in file order: the last two take nodes away (C is killed,
then B shut down); each asserts only its own behaviour.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from conftest import Daemon, ready_all, write_config  # the suite's real-daemon helpers

from openrld.cluster.membership.codec import encode_push_pull
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.membership.messages import PushPull
from openrld.cluster.membership.peer_client import PUSH_PULL_PATH, TAG_HEADER
from tests.waits import wait_for

SECRET = "test-cluster-secret"
HEADERS = {"X-API-Key": "tml-test"}
# The daemons run the "local" timing preset; the bound is computed from its parameters.
LOCAL = MembershipConfig.local()
# Polling the cluster view every 50 ms adds up to that much to a measured detection time.
POLL_S = 0.05


def cluster_config(name: str, join: list[str]) -> str:
    seeds = ", ".join(f'"{seed}"' for seed in join)
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\n'
        f'gossip_timing = "local"\njoin = [{seeds}]\n'
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Daemon]:
    root = tmp_path_factory.mktemp("cluster")
    daemons: dict[str, Daemon] = {}
    try:
        for name in ("node-a", "node-b", "node-c"):  # node-a first, then the two joining it side by side
            seeds = [daemons["node-a"].url.removeprefix("http://")] if daemons else []
            config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, cluster_config(name, seeds))
            daemons[name] = Daemon(root / name, config, root / f"{name}.log").launch()
            if not seeds:
                daemons[name].ready()
        ready_all(daemons.values())
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


def states(url: str) -> dict[str, str]:
    body = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    return {m["name"]: m["state"] for m in body["members"]}


def test_three_daemons_join_and_list_each_other_alive(cluster: dict[str, Daemon]) -> None:
    everyone = {"node-a": "alive", "node-b": "alive", "node-c": "alive"}
    wait_for(lambda: all(states(d.url) == everyone for d in cluster.values()), timeout_s=10.0)
    view = httpx.get(f"{cluster['node-b'].url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    assert (view["node"], view["is_clustered"]) == ("node-b", True)
    members = {m["name"]: m for m in view["members"]}
    assert members["node-c"]["peer_url"] == cluster["node-c"].url
    assert [d["kind"] for d in members["node-a"]["devices"]] == ["cpu"]


def test_push_pull_without_the_tag_is_401_and_with_a_wrong_one_403(cluster: dict[str, Daemon]) -> None:
    url = cluster["node-a"].url
    dropped_before = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()["statistics"]["dropped"]
    body, tag = encode_push_pull(b"another-secret", PushPull("mallory", True, ()))
    missing = httpx.post(f"{url}{PUSH_PULL_PATH}", content=body, timeout=10)
    wrong = httpx.post(f"{url}{PUSH_PULL_PATH}", content=body, headers={TAG_HEADER: tag}, timeout=10)
    assert (missing.status_code, wrong.status_code) == (401, 403)
    assert TAG_HEADER in missing.json()["detail"] and "cluster secret" in wrong.json()["detail"]
    view = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    assert "mallory" not in {m["name"] for m in view["members"]}
    assert view["statistics"]["dropped"].get("bad_tag", 0) == dropped_before.get("bad_tag", 0) + 2


def test_push_pull_declared_as_another_type_is_415_naming_it(cluster: dict[str, Daemon]) -> None:
    body, tag = encode_push_pull(b"another-secret", PushPull("mallory", True, ()))
    response = httpx.post(
        f"{cluster['node-a'].url}{PUSH_PULL_PATH}", content=body,
        headers={TAG_HEADER: tag, "Content-Type": "application/json"}, timeout=10,
    )
    assert (response.status_code, response.json()["detail"]) == (
        415, "push-pull takes application/x-openrl-gossip+msgpack, got Content-Type 'application/json'"
    )


def test_metrics_report_gossip_health(cluster: dict[str, Daemon]) -> None:
    url = cluster["node-b"].url
    wait_for(lambda: states(url) == {"node-a": "alive", "node-b": "alive", "node-c": "alive"}, timeout_s=10.0)
    lines = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=10).text.splitlines()
    assert 'openrld_gossip_members{state="alive"} 3' in lines
    assert 'openrld_gossip_members{state="dead"} 0' in lines


def test_killed_daemon_is_declared_dead_within_the_bound(cluster: dict[str, Daemon]) -> None:
    a, b = cluster["node-a"].url, cluster["node-b"].url
    wait_for(lambda: states(a)["node-c"] == "alive" and states(b)["node-c"] == "alive", timeout_s=10.0)
    cluster["node-c"].stop(signal.SIGKILL)
    bound_s = detection_bound(LOCAL, 3).total_s  # 1.8 s: 3 rounds to a probe, 1 round, 0.8 s suspicion, 0.2 s gossip
    took_s = wait_for(lambda: states(a)["node-c"] == "dead" and states(b)["node-c"] == "dead", bound_s + POLL_S)
    assert took_s <= bound_s + POLL_S


def test_daemon_shut_down_with_sigterm_is_left_not_dead(cluster: dict[str, Daemon]) -> None:
    a = cluster["node-a"].url
    cluster["node-b"].stop(signal.SIGTERM)
    # The farewell goes straight to the other members as the node shuts down.
    wait_for(lambda: states(a)["node-b"] == "left", timeout_s=1.0)


def test_node_without_a_cluster_secret_has_no_peer_api_and_lists_no_cluster(shared_daemon: Daemon) -> None:
    response = httpx.post(f"{shared_daemon.url}{PUSH_PULL_PATH}", content=b"x", timeout=10)
    assert response.status_code == 404 and "cluster_secret" in response.json()["detail"]
    view = httpx.get(f"{shared_daemon.url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    assert (view["is_clustered"], view["members"]) == (False, [])
