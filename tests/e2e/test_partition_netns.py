"""Three real daemons in three network namespaces: they converge, a partition is detected in time, and it heals.

Each daemon runs under `ip netns exec` in its own namespace, joined to the
others by a veth pair into a Linux bridge in the root namespace, which also
holds an address on the bridge: this test process polls every daemon's HTTP
API from there, and keeps that path through the partition.

The partition cuts node C off from A and B in both directions, for UDP
gossip and TCP push-pull alike, and leaves the root namespace's path to all
three: each side gets a permanent neighbour entry that maps the other side's
address to an Ethernet address nobody owns, so their frames are flooded by
the bridge and dropped by every receiver. Nothing errors; packets just
vanish, as in a real partition. It needs only iproute2 (no netfilter, tc
filters or netem, which minimal kernels and this machine lack).

It needs root and `ip` (iproute2); where the namespaces, veth pairs or the
bridge cannot be made (CI containers without CAP_NET_ADMIN), it is skipped,
naming what failed. Names carry this process's pid, and the namespaces,
bridge and links are removed in a `finally` whatever happens.

The tests share one cluster and run in file order: converge, partition, heal; then, where
the Automodel environment is built, a trainer that spans A and B (issue 40, as in
test_spanning_trainer.py) is cut in two by a partition of B: the job ends on both sides
(A declares B dead, B declares A dead), every device of both is free, no rank is left,
and the client gets the 410 of a lost job. A and B have two CPU devices each for it; each
daemon's ranks bind gloo to its namespace's interface (GLOO_SOCKET_IFNAME), since the
hostname resolves to 127.0.0.1 here, which gloo would otherwise take and tell the others.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import tinker
from conftest import Daemon, write_api_keys, write_config  # the suite's real-daemon helpers
from tinker import types

from openrld.cluster.membership.config import (
    MembershipConfig,
    detection_bound,
    expected_confirmations,
    suspicion_max_s,
    suspicion_min_s,
)
from tests.processes import children, running, torchruns

logger = logging.getLogger(__name__)

SECRET = "test-partition-secret"
API_KEY = "tml-test"
HEADERS = {"X-API-Key": API_KEY}
NODES = ("node-a", "node-b", "node-c")
ISOLATED = "node-c"
# The daemons run the "local" timing preset; every bound below is computed from it.
LOCAL = MembershipConfig.local()
# The three cluster views are polled every 50 ms (plus the GETs themselves).
POLL_S = 0.05
# What a measured time holds beyond the protocol's bound. Not the polling: the
# times come from the nodes' own clocks (state_age_s). But the clock starts
# before the `ip` commands that make the cut or heal it (4 commands, 20-60 ms
# measured here), and three daemons share 2 CPU cores with other work, so
# their timers fire late (by tens of ms when loaded). 0.25 s covers both; it is
# about one of A's 0.2 s probe rounds, so what fails this test is a node that
# needs another mechanism (a 2 s push-pull timeout) or misses the partition.
SLACK_S = 0.25
# An Ethernet address that no interface has (locally administered, unicast).
NOBODY_MAC = "02:00:00:0d:ea:d0"
AUTOMODEL_PYTHON = Path(__file__).resolve().parents[2] / ".venv-automodel" / "bin" / "python"
SPANNED = ("node-a", "node-b")  # two CPU devices each: the span test's job takes all four
SPAN = {"openrl.trainer_backend": "automodel", "openrl.trainer_gpus": "4", "openrl.exclusive": "true"}
# Each namespace is new and empty, so every daemon can take the same fixed port,
# and each can be given the others' addresses as seeds before any has started.
HTTP_PORT = 8000
# Starting three daemons in namespaces, with model loads, on a loaded machine.
CONVERGE_TIMEOUT_S = 20.0


class Unsupported(Exception):
    """This machine cannot make network namespaces, veth pairs or a bridge; the reason says which."""


def ip(*args: str) -> None:
    """Run `ip ARGS`; RuntimeError naming the command and its stderr if it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")


def probe_namespace_support() -> None:
    """Make and remove a throwaway namespace, veth pair and bridge.

    Raises:
        Unsupported: not root, no `ip` on PATH, or one of the three cannot be made.
    """
    if os.geteuid() != 0:
        raise Unsupported(f"network namespaces need root; running as uid {os.geteuid()}")
    if shutil.which("ip") is None:
        raise Unsupported("`ip` (iproute2) is not on PATH")
    pid = os.getpid()
    namespace, veth, bridge = f"openrld-probe{pid}", f"orpr{pid}v", f"orpr{pid}b"
    try:
        for args in (
            ("netns", "add", namespace),
            ("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p", "netns", namespace),
            ("link", "add", bridge, "type", "bridge"),
            ("link", "set", veth, "master", bridge),
        ):
            try:
                ip(*args)
            except RuntimeError as exc:
                raise Unsupported(str(exc)) from exc
    finally:
        for args in (("link", "del", bridge), ("link", "del", veth), ("netns", "del", namespace)):
            subprocess.run(["ip", *args], capture_output=True, timeout=30)


def free_subnet_prefix() -> str:
    """A 10.213.X. prefix whose /24 no interface here uses, starting from one the pid picks."""
    in_use = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    start = os.getpid() % 250
    for offset in range(250):
        prefix = f"10.213.{(start + offset) % 250 + 1}."
        if f" {prefix}" not in in_use:
            return prefix
    raise RuntimeError("no free /24 under 10.213.0.0/16 for the test bridge")


class BridgedNamespaces:
    """One namespace per node, each with a veth into a root-namespace bridge, on a private /24.

    Node i has address PREFIX.(i+1); the root namespace has PREFIX.254 on the bridge.
    """

    def __init__(self, nodes: tuple[str, ...]) -> None:
        pid = os.getpid()
        prefix = free_subnet_prefix()
        self.bridge = f"orpt{pid}"
        self.namespace = {node: f"openrld-pt{pid}-{node}" for node in nodes}
        self.host_veth = {node: f"orpt{pid}{i}" for i, node in enumerate(nodes)}
        self.node_veth = {node: f"orpt{pid}{i}n" for i, node in enumerate(nodes)}
        self.address = {node: f"{prefix}{i + 1}" for i, node in enumerate(nodes)}
        self.gateway = f"{prefix}254"
        self._cuts: list[tuple[str, str]] = []  # (node, peer address) pairs pointed at NOBODY_MAC

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for node, namespace in self.namespace.items():
            ip("netns", "add", namespace)
            ip("-n", namespace, "link", "set", "lo", "up")
            ip("link", "add", self.host_veth[node], "type", "veth",
               "peer", "name", self.node_veth[node], "netns", namespace)
            ip("link", "set", self.host_veth[node], "master", self.bridge, "up")
            ip("-n", namespace, "addr", "add", f"{self.address[node]}/24", "dev", self.node_veth[node])
            ip("-n", namespace, "link", "set", self.node_veth[node], "up")

    def destroy(self) -> None:
        """Remove everything `create` made; each step runs even if an earlier one fails."""
        for namespace in self.namespace.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)  # takes its veth pair
        for veth in self.host_veth.values():
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)  # if its namespace never was
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def exec_prefix(self, node: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespace[node])

    def cut_off(self, isolated: str) -> None:
        """Drop all traffic between `isolated` and the other nodes, both ways; the root namespace still reaches all."""
        for other in self.namespace:
            if other != isolated:
                self._point_at_nobody(isolated, self.address[other])
                self._point_at_nobody(other, self.address[isolated])

    def heal(self) -> None:
        """Remove the cut: the neighbour entries go, and ARP finds the real addresses again."""
        while self._cuts:
            node, address = self._cuts.pop()
            ip("-n", self.namespace[node], "neigh", "del", address, "dev", self.node_veth[node])

    def _point_at_nobody(self, node: str, address: str) -> None:
        ip("-n", self.namespace[node], "neigh", "replace", address, "lladdr", NOBODY_MAC,
           "dev", self.node_veth[node], "nud", "permanent")
        self._cuts.append((node, address))


class Cluster(msgspec.Struct):
    network: BridgedNamespaces
    daemons: dict[str, Daemon]
    # What the partition test saw, for the heal test: C's incarnation as A and B declared it dead.
    dead_incarnation: int = -1
    refutations_before: int = -1  # C's refutations before the cut


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Cluster]:
    try:
        probe_namespace_support()
    except Unsupported as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    root = tmp_path_factory.mktemp("partition")
    # Off loopback, a daemon serves only with an API key file (open mode is loopback-only).
    keys = write_api_keys(root / "api-keys.toml", {API_KEY: "partition-test"})
    network = BridgedNamespaces(NODES)
    daemons: dict[str, Daemon] = {}
    try:
        network.create()
        for name in NODES:
            address = network.address[name]
            seeds = ", ".join(f'"{network.address[other]}:{HTTP_PORT}"' for other in NODES if other != name)
            extra = (
                f'host = "{address}"\nadvertise_host = "{address}"\napi_keys_file = "{keys}"\n'
                f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\n'
                f'gossip_timing = "local"\njoin = [{seeds}]\n'
            )
            prefix = network.exec_prefix(name)
            if name in SPANNED and AUTOMODEL_PYTHON.exists():
                extra += f'devices = ["cpu:0", "cpu:1"]\n\n[workers]\nautomodel_python = "{AUTOMODEL_PYTHON}"\n'
                prefix += ("env", f"GLOO_SOCKET_IFNAME={network.node_veth[name]}")
            config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, extra)
            daemons[name] = Daemon(root / name, config, root / f"{name}.log", command_prefix=prefix, port=HTTP_PORT)
        # All start side by side (each start is seconds of imports and a model load); a node
        # whose seeds are not up yet retries them every push-pull round.
        with ThreadPoolExecutor(len(NODES)) as pool:
            list(pool.map(Daemon.start, daemons.values()))
        yield Cluster(network, daemons)
    finally:
        # SIGKILL: nothing here needs a graceful leave, and a clustered daemon takes seconds to drain on SIGTERM.
        for daemon in daemons.values():
            daemon.kill()
        network.destroy()


class Observation(msgspec.Struct, frozen=True):
    """One node's cluster view, with the local time at which it saw each member's state begin."""

    states: dict[str, str]
    incarnations: dict[str, int]
    # time.monotonic() here minus the member's state_age_s there: a state change
    # timed by the node itself, so the poll's own delay does not count. It errs
    # late by the answer's time in flight (milliseconds), never early.
    changed_at_s: dict[str, float]
    refutations: int
    awareness_score: int


def observe(daemon: Daemon) -> Observation:
    response = httpx.get(f"{daemon.url}/openrl/v1/cluster", headers=HEADERS, timeout=5, trust_env=False)
    received_s = time.monotonic()
    response.raise_for_status()
    body = response.json()
    members = body["members"]
    return Observation(
        states={m["name"]: m["state"] for m in members},
        incarnations={m["name"]: m["incarnation"] for m in members},
        changed_at_s={m["name"]: received_s - m["state_age_s"] for m in members},
        refutations=body["statistics"]["refutations"],
        awareness_score=body["statistics"]["awareness_score"],
    )


def wait_for_views(
    daemons: dict[str, Daemon], expected: dict[str, dict[str, str]], timeout_s: float
) -> dict[str, Observation]:
    """The first observation of each node whose states equal `expected[node]`, polled every POLL_S.

    Raises:
        AssertionError: some node's view did not match within `timeout_s`; names it and what it listed.
    """
    deadline_s = time.monotonic() + timeout_s
    matched: dict[str, Observation] = {}
    last: dict[str, dict[str, str]] = {}
    while len(matched) < len(daemons):
        for name, daemon in daemons.items():
            if name not in matched:
                observation = observe(daemon)
                last[name] = observation.states
                if observation.states == expected[name]:
                    matched[name] = observation
        if len(matched) < len(daemons) and time.monotonic() > deadline_s:
            raise AssertionError(
                f"views not as expected within {timeout_s:.1f} s: expected {expected}, last seen {last}"
            )
        time.sleep(POLL_S)
    return matched


def rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {name: round(s, 3) for name, s in seconds.items()}


def across_the_cut(observations: dict[str, Observation], since_s: float) -> dict[str, float]:
    """Per node, seconds from `since_s` until it saw the last member on the other side of the cut change state."""
    return {
        name: max(obs.changed_at_s[other] for other in NODES if (other == ISOLATED) != (name == ISOLATED)) - since_s
        for name, obs in observations.items()
    }


def isolated_node_bound_s(config: MembershipConfig, n: int, awareness_score: int) -> float:
    """The longest until a node cut off from all n-1 others declares every one of them dead.

    Every probe it makes fails without a nack (its helpers are cut off too),
    so Lifeguard's awareness adds min(indirect_checks, n-2) (or 1 without
    helpers) to its score after each round, and each round lasts
    probe_interval * (score + 1), capped at awareness_max_multiplier. Counted
    as failing from the round under way at the cut: that round, then
    2(n-1)-1 more, within which the round-robin walk reaches the last other
    member (see `DetectionBound`); its suspicion then runs unconfirmed.
    """
    step = min(config.indirect_checks, n - 2) or 1
    rounds = 1 + max(1, 2 * (n - 1) - 1)
    probing_s = sum(
        config.probe_interval_s * min(config.awareness_max_multiplier, awareness_score + 1 + i * step)
        for i in range(rounds)
    )
    minimum_s = suspicion_min_s(config, n)
    suspicion_s = suspicion_max_s(config, n) if expected_confirmations(config, n) else minimum_s
    return probing_s + suspicion_s


def heal_bound_s(config: MembershipConfig) -> float:
    """The longest from healing until every node lists every other alive again.

    Dead members are not probed; partitions heal through push-pull, where each
    round also exchanges with one member believed dead. A node's loop may be
    inside such an exchange started before the heal, which gives up after
    push_pull_timeout_s; it then sleeps at most push_pull_interval_s and
    exchanges with the dead one again (its live exchange first: milliseconds).
    That exchange revives both sides: C, told it is dead, refutes in its
    answer; A learns from that answer that C thinks A dead, refutes, and its
    Alive reaches C by gossip within one gossip interval. The answer also says
    C thinks B dead, which only makes A suspect B: B hears of it and refutes
    within two gossip intervals (far under the 0.8 s suspicion). A and B each
    exchange with C this way, so C need not pick.
    """
    return config.push_pull_timeout_s + config.push_pull_interval_s + 2 * config.gossip_interval_s


def test_three_daemons_in_namespaces_converge(cluster: Cluster) -> None:
    everyone = dict.fromkeys(NODES, "alive")
    wait_for_views(cluster.daemons, dict.fromkeys(NODES, everyone), CONVERGE_TIMEOUT_S)
    members = {m["name"]: m for m in httpx.get(
        f"{cluster.daemons['node-a'].url}/openrl/v1/cluster", headers=HEADERS, timeout=5, trust_env=False
    ).json()["members"]}
    # Each is known by its namespace's address, for HTTP and for gossip.
    assert {name: (m["peer_url"], m["gossip_addr"].rpartition(":")[0]) for name, m in members.items()} == {
        name: (f"http://{cluster.network.address[name]}:{HTTP_PORT}", cluster.network.address[name]) for name in NODES
    }


def test_partitioned_node_and_the_rest_declare_each_other_dead_within_the_bound(cluster: Cluster) -> None:
    everyone = dict.fromkeys(NODES, "alive")
    before = wait_for_views(cluster.daemons, dict.fromkeys(NODES, everyone), CONVERGE_TIMEOUT_S)
    rest_view = everyone | {ISOLATED: "dead"}
    isolated_view = dict.fromkeys(NODES, "dead") | {ISOLATED: "alive"}
    # A and B: healthy survivors of a node gone silent (B nacks A's indirect probes, so A's awareness stays at 0):
    # 1.8 s = 3 rounds to reach C + 1 failed round (0.2 s each) + 0.8 s unconfirmed suspicion + 0.2 s of gossip.
    bounds_s = {name: detection_bound(LOCAL, len(NODES)).total_s for name in NODES}
    # C: its probes fail without nacks, so its rounds stretch; 2.8 s at awareness 0 (see isolated_node_bound_s).
    bounds_s[ISOLATED] = isolated_node_bound_s(LOCAL, len(NODES), before[ISOLATED].awareness_score)

    cut_s = time.monotonic()  # before the ip commands: their few tens of ms count against the bound
    cluster.network.cut_off(ISOLATED)
    seen = wait_for_views(
        cluster.daemons,
        {name: isolated_view if name == ISOLATED else rest_view for name in NODES},
        max(bounds_s.values()) + SLACK_S + 2.0,  # generous: the times asserted come from the nodes' own clocks
    )

    took_s = across_the_cut(seen, cut_s)
    logger.info("partition detected in %s s; bounds %s s, slack %.2f s", rounded(took_s), bounds_s, SLACK_S)
    assert {name: took_s[name] <= bounds_s[name] + SLACK_S for name in NODES} == dict.fromkeys(NODES, True), took_s
    # A and B declared dead the incarnation C had before the cut; the heal test checks that C outbids it.
    incarnation = before[ISOLATED].incarnations[ISOLATED]
    assert {name: seen[name].incarnations[ISOLATED] for name in NODES if name != ISOLATED} == {
        name: incarnation for name in NODES if name != ISOLATED
    }
    cluster.dead_incarnation = incarnation
    cluster.refutations_before = before[ISOLATED].refutations


def test_healed_partition_lists_everyone_alive_and_the_isolated_node_refuted(cluster: Cluster) -> None:
    assert cluster.dead_incarnation >= 0, "the partition test runs first and leaves the partition in place"
    everyone = dict.fromkeys(NODES, "alive")
    bound_s = heal_bound_s(LOCAL)  # 4.1 s: a 2 s exchange timing out, a 2 s sleep, two 0.05 s gossip intervals

    heal_s = time.monotonic()
    cluster.network.heal()
    seen = wait_for_views(cluster.daemons, dict.fromkeys(NODES, everyone), bound_s + SLACK_S + 2.0)

    took_s = across_the_cut(seen, heal_s)
    logger.info("partition healed in %s s; bound %.2f s, slack %.2f s", rounded(took_s), bound_s, SLACK_S)
    assert {name: took_s[name] <= bound_s + SLACK_S for name in NODES} == dict.fromkeys(NODES, True), took_s
    # C was told it is dead at incarnation k and refuted once, with k + 1 (max(own, accused) + 1),
    # and everyone lists it at k + 1.
    now = {name: observe(daemon) for name, daemon in cluster.daemons.items()}
    assert now[ISOLATED].refutations == cluster.refutations_before + 1
    assert {name: now[name].incarnations[ISOLATED] for name in NODES} == dict.fromkeys(NODES, cluster.dead_incarnation + 1)


def free_devices(daemon: Daemon, node: str) -> int:
    """How many of `node`'s devices hold no group, as `daemon` sees it."""
    members = httpx.get(f"{daemon.url}/openrl/v1/cluster", headers=HEADERS, timeout=5, trust_env=False).json()["members"]
    return sum(1 for d in next(m for m in members if m["name"] == node)["devices"] if d["groups"] == 0)


def span_processes(daemon: Daemon) -> list[int]:
    """A daemon's torchruns, each followed by its ranks."""
    assert daemon.proc is not None
    return [pid for torchrun in torchruns(daemon.proc.pid) for pid in (torchrun, *(rank for rank, _ in children(torchrun)))]


def span_ended(a: Daemon, b: Daemon, groups: dict[str, list[int]]) -> bool:
    """Each side sees its own devices free, and no torchrun or rank of the span is left."""
    left = running([pid for pids in groups.values() for pid in pids])
    return free_devices(a, "node-a") == 2 and free_devices(b, "node-b") == 2 and not left


@pytest.mark.skipif(not AUTOMODEL_PYTHON.exists(), reason="no Automodel environment: `make automodel-env` builds it")
def test_a_span_cut_in_two_by_a_partition_ends_on_both_sides_and_frees_every_device(cluster: Cluster) -> None:
    a, b = (cluster.daemons[name] for name in SPANNED)
    everyone = dict.fromkeys(NODES, "alive")
    before = wait_for_views(cluster.daemons, dict.fromkeys(NODES, everyone), CONVERGE_TIMEOUT_S)
    service = tinker.ServiceClient(base_url=a.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3, user_metadata=SPAN).result()
    tokens = list(range(5, 21))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    trained = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    groups = {name: span_processes(daemon) for name, daemon in zip(SPANNED, (a, b), strict=True)}
    # A declares B dead as a survivor does; B, cut off from all, as the isolated node does (its rounds stretch).
    bound_s = max(
        detection_bound(LOCAL, len(NODES)).total_s, isolated_node_bound_s(LOCAL, len(NODES), before["node-b"].awareness_score)
    )

    cut_s = time.monotonic()
    cluster.network.cut_off("node-b")
    while not span_ended(a, b, groups) and time.monotonic() - cut_s < bound_s + 30.0:
        time.sleep(POLL_S)
    took_s = time.monotonic() - cut_s
    with pytest.raises(tinker.APIStatusError) as lost:
        training.forward_backward([datum], "cross_entropy").result()
    service.close("success").result()

    logger.info("span cut in two: ended on both sides in %.2f s; bound %.2f s", took_s, bound_s)
    assert trained > 0 and [len(pids) for pids in groups.values()] == [3, 3]  # a torchrun and two ranks each
    assert span_ended(a, b, groups), {"A free": free_devices(a, "node-a"), "B free": free_devices(b, "node-b"), "left": groups}
    assert took_s <= bound_s + 10.0, (took_s, bound_s)  # as test_spanning_trainer: the span's watchers and its stop
    assert lost.value.status_code == 410
    assert "node node-b, which held ranks of its trainer, was declared dead by the cluster" in str(lost.value)
