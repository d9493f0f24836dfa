"""`openrld serve` as a user starts it: each flag, and the same setting from the config file and OPENRLD_*.

Every node here is the installed console script in a subprocess. What a setting
did is read from outside: the address the node printed, the data dir it made,
the devices in /openrl/v1/info, its name and members in /openrl/v1/cluster.
One node per source (flags, environment, file) carries all of them, and each
test reads one. `--config` is the file's source; `-v` and `--version` have no other.
Precedence is what `config.load_config` does: flags over the OPENRLD_*
variables over the file over the defaults.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Daemon, ServeCommand, write_config

from openrld import __version__

OPENRLD = str(Path(sys.executable).with_name("openrld"))
KEY = "tml-serve-flags"
SECRET = "serve-flags-cluster-secret"
JOIN_TIMEOUT_S = 30.0

# The values each source sets; distinct per source, so a test sees which one took effect.
HOSTS = {"flag": "127.0.0.2", "env": "127.0.0.3", "file": "127.0.0.4"}
DEVICES = {"flag": "cpu:1", "env": "cpu:2", "file": "cpu:3"}
NODE_NAMES = {"flag": "from-flag", "env": "from-env", "file": "from-file"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(**variables: str) -> dict[str, str]:
    """This process's environment without OPENRLD_* (a developer's own would leak in), plus `variables`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OPENRLD_")}
    return {**env, "PYTHONUNBUFFERED": "1", **variables}


def _get(url: str, path: str) -> dict:
    response = httpx.get(f"{url}{path}", headers={"X-API-Key": KEY}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


class Node:
    """A started `openrld serve` and what it was told."""

    def __init__(self, command: ServeCommand, url: str, port: int, data_dir: Path) -> None:
        self.command, self.url, self.port, self.data_dir = command, url, port, data_dir


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Daemon]:
    """A one-node cluster for the others to join."""
    root = tmp_path_factory.mktemp("seed")
    extra = f'node_name = "seed"\ncluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"'
    daemon = Daemon(root / "data", write_config(root / "openrld.toml", root / "data", {}, extra), root / "seed.log")
    yield daemon.start()
    daemon.stop()


def _serve_argv_env(source: str, root: Path, port: int, seed_address: str) -> tuple[list[str], dict[str, str]]:
    """`openrld serve` with every setting under test given by `source`, and cluster membership from elsewhere."""
    data_dir = root / "data"
    if source == "flag":
        argv = [
            OPENRLD, "serve", "--host", HOSTS[source], "--port", str(port), "--data-dir", str(data_dir),
            "--device", DEVICES[source], "--node-name", NODE_NAMES[source], "--join", seed_address, "-v",
        ]
        # No flag sets these; the environment does, for the flags under test to have a cluster to join.
        env = _env(OPENRLD_CLUSTER_SECRET=SECRET, OPENRLD_GOSSIP_PORT="0", OPENRLD_GOSSIP_TIMING="local")
        return argv, env
    if source == "env":
        env = _env(
            OPENRLD_HOST=HOSTS[source], OPENRLD_PORT=str(port), OPENRLD_DATA_DIR=str(data_dir),
            OPENRLD_DEVICE=DEVICES[source], OPENRLD_NODE_NAME=NODE_NAMES[source], OPENRLD_JOIN=seed_address,
            OPENRLD_CLUSTER_SECRET=SECRET, OPENRLD_GOSSIP_PORT="0", OPENRLD_GOSSIP_TIMING="local",
        )
        return [OPENRLD, "serve"], env
    config = root / "openrld.toml"
    config.write_text(
        f'host = "{HOSTS[source]}"\nport = {port}\ndata_dir = "{data_dir}"\ndevice = "{DEVICES[source]}"\n'
        f'node_name = "{NODE_NAMES[source]}"\njoin = ["{seed_address}"]\n'
        f'cluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"\n'
    )
    return [OPENRLD, "serve", "--config", str(config)], _env()


@pytest.fixture(scope="module", params=["flag", "env", "file"])
def node(request, tmp_path_factory: pytest.TempPathFactory, seed: Daemon) -> Iterator[tuple[str, Node]]:
    """(source, the node it configured)."""
    source = request.param
    root = tmp_path_factory.mktemp(f"serve-{source}")
    port = _free_port()
    argv, env = _serve_argv_env(source, root, port, seed.url.removeprefix("http://"))
    command = ServeCommand(argv, root / "serve.log", env=env)
    url = command.start()
    yield source, Node(command, url, port, root / "data")
    command.stop()


def test_host_and_port_are_the_address_it_listens_on_and_prints(node):
    source, started = node
    assert started.command.printed[-1] == f"openrld listening on http://{HOSTS[source]}:{started.port}\n"
    assert _get(started.url, "/api/v1/healthz")["status"] == "ok"


def test_data_dir_is_where_it_keeps_its_database(node):
    _, started = node
    assert (started.data_dir / "openrld.sqlite3").is_file()


def test_device_is_the_device_it_reports(node):
    source, started = node
    assert [d["name"] for d in _get(started.url, "/openrl/v1/info")["devices"]] == [DEVICES[source]]


def test_node_name_is_its_name_in_the_cluster(node):
    source, started = node
    assert _get(started.url, "/openrl/v1/cluster")["node"] == NODE_NAMES[source]


def test_join_makes_it_a_member_of_the_seeds_cluster(node, seed: Daemon):
    source, started = node
    names = ("seed", NODE_NAMES[source])  # the seed also remembers the nodes of earlier sources, as left
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        views = [
            {m["name"]: m["state"] for m in _get(url, "/openrl/v1/cluster")["members"] if m["name"] in names}
            for url in (seed.url, started.url)
        ]
        if views == [dict.fromkeys(names, "alive")] * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert views == [dict.fromkeys(names, "alive")] * 2  # as the seed sees it, and as the new node does


@pytest.mark.parametrize("node", ["flag"], indirect=True)
def test_verbose_logs_the_config_it_runs_with_and_no_secret(node):
    _, started = node
    lines = [line for line in started.command.log().splitlines() if " DEBUG openrld.cli: config " in line]
    assert len(lines) == 1
    shown = json.loads(lines[0].split(" DEBUG openrld.cli: config ", 1)[1])
    assert (shown["node_name"], shown["device"], shown["cluster_secret"]) == ("from-flag", "cpu:1", "<set>")
    assert SECRET not in started.command.log()


@pytest.mark.parametrize("node", ["env", "file"], indirect=True)
def test_without_verbose_it_logs_nothing_at_debug(node):
    _, started = node
    assert " DEBUG " not in started.command.log()


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path):
    config = tmp_path / "openrld.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "file-data"}"\ndevice = "cpu:3"\nnode_name = "from-file"\nport = {_free_port()}\n'
    )
    env = _env(OPENRLD_DEVICE="cpu:2", OPENRLD_NODE_NAME="from-env", OPENRLD_PORT="0")
    command = ServeCommand(
        [OPENRLD, "serve", "--config", str(config), "--node-name", "from-flag", "--port", "0"], tmp_path / "serve.log",
        env=env,
    )
    url = command.start()
    try:
        assert _get(url, "/openrl/v1/cluster")["node"] == "from-flag"  # flag, environment and file
        assert [d["name"] for d in _get(url, "/openrl/v1/info")["devices"]] == ["cpu:2"]  # environment and file
        assert (tmp_path / "file-data" / "openrld.sqlite3").is_file()  # the file alone
    finally:
        command.stop()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--port", "70000"], {}, "openrld: flag --port: port: Expected `int` <= 65535 (received 70000)"),
        (
            [], {"OPENRLD_PORT": "seventy"},
            "openrld: environment OPENRLD_PORT: port: Expected `int`, got `str` (received 'seventy')",
        ),
        (
            ["--node-name", "no spaces"], {},
            "openrld: flag --node-name: node_name: Expected `str` matching regex "
            "'^([A-Za-z0-9][A-Za-z0-9._-]{0,62})?$' (received 'no spaces')",
        ),
        (
            ["--join", "127.0.0.1:1"], {},
            "openrld: join: joining a cluster needs cluster_secret (peers authenticate with it); none is set",
        ),
        (
            ["--host", "0.0.0.0"], {},
            "openrld: host '0.0.0.0' is not loopback, and no api_keys_file is set: open mode (no keys) serves "
            "anyone who can connect, so it binds only to loopback",
        ),
    ],
    ids=["port-flag", "port-env", "node-name-flag", "join-flag", "host-flag"],
)
def test_a_bad_setting_stops_it_at_once_with_status_2_naming_where_it_came_from(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
):
    result = subprocess.run(
        [OPENRLD, "serve", "--data-dir", str(tmp_path / "data"), *args], env=_env(**env),
        capture_output=True, text=True, timeout=60,
    )
    assert (result.returncode, result.stderr, result.stdout) == (2, message + "\n", "")


def test_version_flag_prints_the_version_and_exits_0():
    result = subprocess.run([OPENRLD, "--version"], env=_env(), capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"openrld {__version__}\n", "")
