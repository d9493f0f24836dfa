"""Node config (openrld/config.py) and the shipped config/openrld.toml."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from openrld.config import ConfigError, HttpLimits, NodeConfig, load_api_keys, load_config

SHIPPED = Path(__file__).resolve().parent.parent / "config" / "openrld.toml"
ENV = {"HOME": "/home/alice"}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    assert load_config(None, {}, ENV) == NodeConfig(
        data_dir=Path("/home/alice/.local/share/openrld"),
        host="127.0.0.1",
        port=8000,
        api_keys_file=None,
        device="auto",
        models={},
        longpoll_s=30.0,
        max_body_bytes=64 * 1024 * 1024,
        max_batch_tokens=8192,
        max_num_samples=128,
        max_lora_rank=128,
        sample_queue_limit=256,
        log_json=False,
    )


def test_shipped_config_parses_to_exactly_the_defaults() -> None:
    assert load_config(SHIPPED, {}, ENV) == load_config(None, {}, ENV)


def test_shipped_config_documents_every_option() -> None:
    text = SHIPPED.read_text()
    undocumented = [
        name
        for name in NodeConfig.__struct_fields__
        if f"\n{name} = " not in text and f"\n# {name} = " not in text and f"\n[{name}]" not in text
    ]
    assert undocumented == []


def test_shipped_config_sets_no_key_outside_node_config() -> None:
    raw = tomllib.loads(SHIPPED.read_text())
    assert set(raw) - set(NodeConfig.__struct_fields__) == set()


def test_data_dir_default_follows_xdg_data_home() -> None:
    config = load_config(None, {}, {"HOME": "/home/alice", "XDG_DATA_HOME": "/data"})
    assert config.data_dir == Path("/data/openrld")


def test_relative_xdg_data_home_is_ignored() -> None:
    config = load_config(None, {}, {"HOME": "/home/alice", "XDG_DATA_HOME": "data"})
    assert config.data_dir == Path("/home/alice/.local/share/openrld")


@pytest.mark.parametrize(
    ("use_env", "overrides", "port"),
    [
        (False, {}, 9001),
        (True, {}, 9002),
        (True, {"port": 9003}, 9003),
        (False, {"port": "9003"}, 9003),
        (True, {"port": None}, 9002),
    ],
    ids=["file-over-default", "env-over-file", "flag-over-env", "flag-as-text", "unset-flag-is-ignored"],
)
def test_flags_over_env_over_file(tmp_path: Path, use_env: bool, overrides: dict[str, object], port: int) -> None:
    path = write(tmp_path / "openrld.toml", "port = 9001\n")
    env = {**ENV, "OPENRLD_PORT": "9002"} if use_env else ENV
    assert load_config(path, overrides, env).port == port


def test_env_values_are_converted_from_text() -> None:
    env = {
        **ENV,
        "OPENRLD_LOG_JSON": "true",
        "OPENRLD_LONGPOLL_S": "10.5",
        "OPENRLD_DATA_DIR": "/srv/openrld",
        "OPENRLD_API_KEYS_FILE": "/etc/openrld/keys.toml",
        "OPENRLD_HOST": "0.0.0.0",
    }
    config = load_config(None, {}, env)
    assert (config.log_json, config.longpoll_s, config.data_dir, config.api_keys_file, config.host) == (
        True,
        10.5,
        Path("/srv/openrld"),
        Path("/etc/openrld/keys.toml"),
        "0.0.0.0",
    )


def test_empty_api_keys_file_variable_means_open_mode(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", 'api_keys_file = "/etc/keys.toml"\n')
    assert load_config(path, {}, {**ENV, "OPENRLD_API_KEYS_FILE": ""}).api_keys_file is None


def test_models_table_maps_names_to_directories(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", '[models]\n"org/tiny-llama" = "/srv/models/tiny"\nqwen = "~/m/qwen"\n')
    assert load_config(path, {}, ENV).models == {
        "org/tiny-llama": Path("/srv/models/tiny"),
        "qwen": Path("~/m/qwen").expanduser(),
    }


def test_unknown_key_in_file_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", "prot = 8001\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, {}, ENV)
    assert str(excinfo.value) == (
        f"config file {path}: unknown key 'prot'; known keys are data_dir, checkpoint_root, host, port, api_keys_file, device, "
        "devices, timeslice_quantum_s, cpu_threads, models, longpoll_s, max_body_bytes, max_batch_tokens, "
        "activation_budget_bytes, max_num_samples, max_lora_rank, "
        "sample_queue_limit, sampler_backend, sampler_routing, sampler_prefix_cache_bytes, sampler_packed_weights, "
        "host_memory_budget_bytes, "
        "vllm_gpu_memory_utilization, "
        "log_json, loop_watch_ms, jwt_auth, jwt_ttl_s, "
        "maintenance_interval_s, node_name, cluster_secret, join, gossip_port, advertise_host, network_segment, "
        "gossip_timing, accept_jobs, http, "
        "workers, "
            "tls_certfile, tls_keyfile, tls_ca_certs"
    )


def test_unknown_override_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {"verbose": True}, ENV)
    assert str(excinfo.value).startswith("overrides: unknown key 'verbose'; known keys are data_dir, ")


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('port = "8001"\n', {}, "config file {path}: port: Expected `int`, got `str` (received '8001')"),
        ("port = 70000\n", {}, "config file {path}: port: Expected `int` <= 65535 (received 70000)"),
        ("", {"OPENRLD_PORT": "http"}, "environment OPENRLD_PORT: port: Expected `int`, got `str` (received 'http')"),
        ("", {"OPENRLD_LONGPOLL_S": "45"}, "environment OPENRLD_LONGPOLL_S: longpoll_s: Expected `float` < 45.0 (received '45')"),
        ("max_num_samples = 0\n", {}, "config file {path}: max_num_samples: Expected `int` >= 1 (received 0)"),
        ("port = \n", {}, "config file {path}: not valid TOML: Invalid value (at line 1, column 8)"),
    ],
    ids=["port-as-string-in-file", "port-out-of-range", "env-not-a-number", "longpoll-at-sdk-timeout", "zero-samples", "bad-toml"],
)  # fmt: skip
def test_bad_value_is_an_error_naming_where_it_came_from(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    path = write(tmp_path / "openrld.toml", text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, {}, {**ENV, **env})
    assert str(excinfo.value) == message.format(path=path)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(tmp_path / "absent.toml", {}, ENV)
    assert str(excinfo.value).startswith(f"config file {tmp_path / 'absent.toml'}: cannot read it: ")


def test_open_mode_refuses_a_non_loopback_host() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {"host": "0.0.0.0"}, ENV)
    assert str(excinfo.value) == (
        "host '0.0.0.0' is not loopback, and no api_keys_file is set: "
        "open mode (no keys) serves anyone who can connect, so it binds only to loopback"
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_open_mode_accepts_loopback_hosts(host: str) -> None:
    assert load_config(None, {"host": host}, ENV).host == host


def test_a_key_file_allows_any_host() -> None:
    config = load_config(None, {"host": "0.0.0.0", "api_keys_file": "/etc/keys.toml"}, ENV)
    assert (config.host, config.api_keys_file, config.is_open_mode) == ("0.0.0.0", Path("/etc/keys.toml"), False)


def test_config_is_frozen() -> None:
    config = load_config(None, {}, ENV)
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


def test_api_keys_from_toml(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.toml", '"tml-alice-0001" = "alice"\n"tml-bob-0002" = "bob"\n')
    assert load_api_keys(path) == {"tml-alice-0001": "alice", "tml-bob-0002": "bob"}


def test_api_keys_from_json(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.json", '{"tml-alice-0001": "alice"}')
    assert load_api_keys(path) == {"tml-alice-0001": "alice"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"sk-secret" = "alice"\n', "entry 1: a key must be 'tml-' followed by non-space characters"),
        ('"tml-a" = "alice"\n"tml-" = "bob"\n', "entry 2: a key must be 'tml-' followed by non-space characters"),
        ('"tml-a b" = "alice"\n', "entry 1: a key must be 'tml-' followed by non-space characters"),
        ('"tml-a" = ""\n', "entry 1: the user must be a non-empty string, got ''"),
        ('"tml-a" = 3\n', "entry 1: the user must be a non-empty string, got 3"),
        ("", "expected a non-empty table of key = user"),
    ],
    ids=["wrong-prefix", "prefix-only", "whitespace", "empty-user", "user-not-a-string", "empty-file"],
)
def test_bad_api_key_file_is_refused_without_echoing_keys(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "keys.toml", text)
    with pytest.raises(ConfigError) as excinfo:
        load_api_keys(path)
    assert str(excinfo.value) == f"api keys file {path}: {message}"



def test_api_keys_file_readable_by_others_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "keys.toml", '"tml-alice-0001" = "alice"\n')
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="openrld.config"):
        load_api_keys(path)
    assert caplog.messages == [f"api keys file {path} can be read by other users (mode 644)"]


def test_private_api_keys_file_is_not_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "keys.toml", '"tml-alice-0001" = "alice"\n')
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="openrld.config"):
        load_api_keys(path)
    assert caplog.messages == []


def test_devices_list_is_read_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", 'devices = ["cpu:0", "cpu:1"]\n')
    assert load_config(path, {}, ENV).devices == ("cpu:0", "cpu:1")


def test_malformed_device_label_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", 'devices = ["gpu0"]\n')
    with pytest.raises(ConfigError, match=r"devices: .*gpu0"):
        load_config(path, {}, ENV)


def test_checkpoint_root_is_unset_by_default() -> None:
    assert load_config(None, {}, ENV).checkpoint_root is None


def test_checkpoint_root_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", 'checkpoint_root = "/mnt/shared"\n')
    assert (
        load_config(path, {}, ENV).checkpoint_root,
        load_config(path, {}, {**ENV, "OPENRLD_CHECKPOINT_ROOT": "/mnt/other"}).checkpoint_root,
    ) == (Path("/mnt/shared"), Path("/mnt/other"))


def test_empty_checkpoint_root_variable_means_no_shared_root(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", 'checkpoint_root = "/mnt/shared"\n')
    assert load_config(path, {}, {**ENV, "OPENRLD_CHECKPOINT_ROOT": ""}).checkpoint_root is None


def test_the_http_table_sets_the_servers_limits_and_keeps_the_other_defaults(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", "[http]\nhead_timeout = 2\nmax_connections = 100\n")
    assert load_config(path, {}, ENV).http == HttpLimits(head_timeout=2.0, max_connections=100)


def test_an_unknown_key_in_the_http_table_is_an_error_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", "[http]\nread_timeout = 5\n")
    with pytest.raises(ConfigError, match=r"http: Object contains unknown field `read_timeout`"):
        load_config(path, {}, ENV)


def test_a_zero_deadline_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "openrld.toml", "[http]\nbody_timeout = 0\n")
    with pytest.raises(ConfigError, match=r"http: Expected `float` > 0.0 - at `\$.body_timeout`"):
        load_config(path, {}, ENV)


def test_tls_needs_both_a_certificate_and_its_key(tmp_path: Path) -> None:
    cert = write(tmp_path / "node.crt", "x")
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {"tls_certfile": str(cert)}, ENV)
    assert str(excinfo.value) == "tls_certfile and tls_keyfile: TLS needs both, a certificate and its key; one is set"


def test_a_missing_tls_file_is_refused_naming_it(tmp_path: Path) -> None:
    cert = write(tmp_path / "node.crt", "x")
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {"tls_certfile": str(cert), "tls_keyfile": str(tmp_path / "gone.key")}, ENV)
    assert str(excinfo.value) == f"tls_keyfile: {tmp_path / 'gone.key'} is not a readable file"


def test_tls_files_come_from_the_environment_too(tmp_path: Path) -> None:
    cert, key = write(tmp_path / "node.crt", "x"), write(tmp_path / "node.key", "x")
    env = {**ENV, "OPENRLD_TLS_CERTFILE": str(cert), "OPENRLD_TLS_KEYFILE": str(key)}
    config = load_config(None, {}, env)
    assert (config.tls_certfile, config.tls_keyfile, config.is_tls) == (cert, key, True)


@pytest.mark.parametrize("secret", ["REPLACE-WITH-A-LONG-RANDOM-SECRET", "changeme-changeme-changeme"])
def test_a_placeholder_cluster_secret_is_refused(secret: str) -> None:
    with pytest.raises(ConfigError, match=r"^cluster_secret: still the example's placeholder; "):
        load_config(None, {"cluster_secret": secret}, ENV)


def test_a_short_cluster_secret_is_refused() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {"cluster_secret": "fifteen-chars!!"}, ENV)
    assert str(excinfo.value) == (
        "cluster_secret: 15 characters is too short to authenticate peers; use at least 16 random ones "
        "(e.g. openssl rand -hex 32)"
    )


def test_a_placeholder_api_key_is_refused_naming_its_user_not_the_key(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.toml", '"tml-good-key" = "bob"\n"tml-REPLACE-WITH-A-LONG-RANDOM-KEY" = "alice"\n')
    path.chmod(0o600)
    with pytest.raises(ConfigError) as excinfo:
        load_api_keys(path)
    assert str(excinfo.value) == (
        f"api keys file {path}: entry 2 (user 'alice'): the key is still the example's placeholder; "
        "give each user a long random key of their own (e.g. tml-$(openssl rand -hex 24))"
    )


def test_a_kubernetes_service_link_in_the_environment_is_refused_saying_what_it_is() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, {}, {**ENV, "OPENRLD_PORT": "tcp://10.4.0.9:8000"})
    assert str(excinfo.value) == (
        "environment OPENRLD_PORT='tcp://10.4.0.9:8000' is a Kubernetes service link for a Service named openrld, "
        "not an openrld setting; set enableServiceLinks: false in the pod spec"
    )
