"""Node config: read once at startup into a frozen struct, then passed down by hand.

This module owns `NodeConfig` and the only reads of the process environment
in openrld. `load_config` layers, strongest first: explicit overrides (CLI
flags), `OPENRLD_*` environment variables, the TOML config file, and the
defaults below, whose reasons are written out in `config/openrld.toml`. It
guarantees that a returned config has every value checked (types, ranges,
`tml-` keys, open mode only on loopback) and that an unknown key in the file
or the overrides is an error naming it. It never re-reads anything after
startup and never holds live objects.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

logger = logging.getLogger(__name__)

ENV_PREFIX = "OPENRLD_"
API_KEY_PREFIX = "tml-"

# The SDK gives up on one retrieve_future poll after 45 s; holding it longer
# than that turns every slow result into a client-side timeout and retry.
_SDK_POLL_TIMEOUT_S = 45.0


# Words that mark a value copied from an example instead of made up: a node refuses to start
# with one as its cluster secret or an API key, since everyone who read the example knows it.
_PLACEHOLDER_MARKS = ("REPLACE", "CHANGEME", "CHANGE-ME", "CHANGE_ME", "PLACEHOLDER", "XXXXXXXX")
MIN_CLUSTER_SECRET_CHARS = 16


def is_placeholder(value: str) -> bool:
    upper = value.upper()
    return any(mark in upper for mark in _PLACEHOLDER_MARKS)


# A device label: what `devices` may list (gpu/devices.py says what each means).
_DEVICE_NAME = r"^(cpu|cuda)(:[0-9]{1,3})?$"
# A node name goes into gossip, logs and URLs: letters, digits, '.', '-', '_' (a host name fits).
_NODE_NAME = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,62})?$"


class ConfigError(ValueError):
    """The node config or the API key file is wrong; the daemon does not start.

    It lives here rather than in errors.py because it never reaches a client:
    the CLI prints it and exits.
    """


class HttpLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The HTTP server's deadlines and caps (`[http]` in the config file; reasons there).

    Where hypercorn has an option for the same thing, the name and meaning are
    hypercorn's (docs/http-server.md puts them side by side). Seconds are
    floats, every one of them bounded: an operator can loosen a deadline, not remove it.
    """

    head_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    body_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    keep_alive_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 75.0
    discard_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    write_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    graceful_timeout: Annotated[float, msgspec.Meta(ge=0.0)] = 3.0
    shutdown_timeout: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    h11_max_incomplete_size: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024
    keep_alive_max_requests: Annotated[int, msgspec.Meta(ge=1)] = 1000
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 4096


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where engines run (`[workers]` in the config file; reasons there; docs/worker-protocol.md)."""

    launcher: Literal["inproc", "process"] = "inproc"  # the built-in engines: in the daemon, or a process each
    python: str = ""  # the process launcher's interpreter; "": the daemon's own
    vllm_python: str = ""  # the vLLM environment's interpreter; set: the vLLM sampler runs there, in a process
    automodel_python: str = ""  # the Automodel environment's interpreter; "": openrl.trainer_backend=automodel is refused
    rendezvous_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29400  # the first of a spanning trainer's rendezvous ports
    container_runtime: Literal["podman", "docker", "kubernetes"] = "podman"  # for custom images
    container_global_args: tuple[str, ...] = ()  # before the runtime's subcommand, every call: podman's --runtime runc
    container_run_args: tuple[str, ...] = ()  # to `run` alone: extra mounts, --shm-size
    allowed_images: tuple[str, ...] = ()  # fnmatch patterns of the images a job may name; none: no custom images
    socket_dir: Path | None = None  # where worker sockets live; None: $XDG_RUNTIME_DIR or /tmp
    pod_name: str = ""  # the daemon's own Pod (container_runtime = "kubernetes"); "": $POD_NAME
    hello_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    heartbeat_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0
    stop_timeout_s: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one openrld node is configured with. Reasons: config/openrld.toml.

    `data_dir` has no default here because its default depends on the
    environment; `load_config` fills it in (see `default_data_dir`).
    """

    data_dir: Path
    checkpoint_root: Path | None = None  # None: <data_dir>/checkpoints, this node's alone
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    api_keys_file: Path | None = None
    device: Annotated[str, msgspec.Meta(min_length=1)] = "auto"
    devices: tuple[Annotated[str, msgspec.Meta(pattern=_DEVICE_NAME)], ...] = ()
    timeslice_quantum_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    cpu_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    models: dict[str, Path] = msgspec.field(default_factory=dict)
    longpoll_s: Annotated[float, msgspec.Meta(gt=0.0, lt=_SDK_POLL_TIMEOUT_S)] = 30.0
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 * 1024 * 1024
    max_batch_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    activation_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: the device's default
    max_num_samples: Annotated[int, msgspec.Meta(ge=1)] = 128
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1)] = 128
    sample_queue_limit: Annotated[int, msgspec.Meta(ge=1)] = 256
    sampler_backend: Literal["torch", "vllm"] = "torch"
    sampler_routing: Literal["prefix", "least_loaded"] = "prefix"  # which sampler replica takes a request
    sampler_prefix_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * 1024 * 1024  # per torch sampler; 0: off
    sampler_packed_weights: bool = True  # a CPU torch sampler's weights packed for oneDNN (gpu/packed_linear.py)
    host_memory_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: half the machine's memory (actors/host_memory.py)
    vllm_gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    log_json: bool = False
    loop_watch_ms: Annotated[int, msgspec.Meta(ge=0)] = 0  # debug: log event-loop steps over this; 0: off
    jwt_auth: bool = False
    jwt_ttl_s: Annotated[int, msgspec.Meta(ge=120, le=7 * 24 * 3600)] = 3600
    maintenance_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    node_name: Annotated[str, msgspec.Meta(pattern=_NODE_NAME)] = ""  # "": the host name
    cluster_secret: str = ""
    join: tuple[Annotated[str, msgspec.Meta(min_length=1)], ...] = ()
    gossip_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 7946
    advertise_host: str = ""
    network_segment: str = ""  # zone, rack or node pool: a trainer that spans nodes keeps to one; "": unknown
    gossip_timing: Literal["lan", "local"] = "lan"
    accept_jobs: bool = True
    http: HttpLimits = HttpLimits()
    workers: WorkerSettings = WorkerSettings()
    tls_certfile: Path | None = None  # PEM certificate chain; with tls_keyfile, the API and peers speak HTTPS
    tls_keyfile: Path | None = None
    tls_ca_certs: Path | None = None  # the CA that signed the peers' certificates; None: the system's CAs

    @property
    def is_tls(self) -> bool:
        return self.tls_certfile is not None

    @property
    def is_open_mode(self) -> bool:
        """No key file: every request is served, so the node must be on loopback."""
        return self.api_keys_file is None


_FIELDS = {field.name: field for field in msgspec.structs.fields(NodeConfig)}

# The fields an environment variable can set: the scalars. `models` and `http` are
# tables and `devices` a list; they belong in the file (or a ConfigMap mounted as the file).
ENV_FIELDS = tuple(name for name in _FIELDS if name not in ("models", "devices", "http", "workers"))


def default_data_dir(env: Mapping[str, str]) -> Path:
    """$XDG_DATA_HOME/openrld, else ~/.local/share/openrld (the XDG base-dir rule).

    XDG says a relative XDG_DATA_HOME is invalid and must be ignored.
    """
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "openrld"
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return home / ".local" / "share" / "openrld"


def _dec_hook(type_: type, value: object) -> object:
    if type_ is Path and isinstance(value, (str, Path)):  # the file and environment give text, argparse a Path
        return Path(value).expanduser()
    raise NotImplementedError(f"cannot read {type_!r}")


def _convert_field(name: str, value: object, source: str, *, from_text: bool) -> object:
    """One value checked against its field's type and bounds, or ConfigError naming both."""
    try:
        return msgspec.convert(value, _FIELDS[name].type, strict=not from_text, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {name}: {exc} (received {value!r})") from exc


def _unknown_key(key: str, source: str) -> ConfigError:
    known = ", ".join(_FIELDS)
    return ConfigError(f"{source}: unknown key {key!r}; known keys are {known}")


def _file_values(path: Path) -> dict[str, object]:
    source = f"config file {path}"
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            raise _unknown_key(key, source)
        values[key] = _convert_field(key, value, source, from_text=False)
    return values


def _env_values(env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for name in ENV_FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in env:
            text = env[var]
            if name in ("api_keys_file", "checkpoint_root", "tls_certfile", "tls_keyfile", "tls_ca_certs") and text == "":
                # An empty variable is how a manifest says "unset": open mode, or no shared root.
                values[name] = None
            elif text.startswith("tcp://"):
                # Kubernetes' service links: a Service named "openrld" puts OPENRLD_PORT=tcp://IP:PORT
                # (and more) into every pod of the namespace; they are not this node's settings.
                raise ConfigError(
                    f"environment {var}={text!r} is a Kubernetes service link for a Service named openrld, not an "
                    "openrld setting; set enableServiceLinks: false in the pod spec"
                )
            elif name == "join":
                # A list in one variable: comma-separated, as --join takes it.
                values[name] = tuple(seed.strip() for seed in text.split(",") if seed.strip())
            else:
                values[name] = _convert_field(name, text, f"environment {var}", from_text=True)
    return values


def _override_values(overrides: Mapping[str, object]) -> dict[str, object]:
    values: dict[str, object] = {}
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise _unknown_key(key, "overrides")
        if value is None:
            continue  # a flag that was not given
        values[key] = _convert_field(key, value, f"flag --{key.replace('_', '-')}", from_text=isinstance(value, str))
    return values


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (open mode must not listen beyond it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(path: Path | None, overrides: Mapping[str, object], env: Mapping[str, str]) -> NodeConfig:
    """Build the node config from its layers.

    Args:
        path: the TOML config file, or None for none.
        overrides: CLI flags by field name; a None value means the flag was not given.
        env: the process environment (passed in so tests need not touch os.environ).

    Returns:
        The config: overrides over `OPENRLD_<FIELD>` variables over the file over defaults.

    Raises:
        ConfigError: an unreadable file, an unknown key in the file or the overrides,
            a bad value (naming where it came from), or open mode on a non-loopback host.
    """
    values: dict[str, object] = {"data_dir": default_data_dir(env)}
    if path is not None:
        values.update(_file_values(path))
    values.update(_env_values(env))
    values.update(_override_values(overrides))
    config = NodeConfig(**values)  # type: ignore[arg-type]  # every value converted to its field's type
    if config.is_open_mode and not is_loopback(config.host):
        raise ConfigError(
            f"host {config.host!r} is not loopback, and no api_keys_file is set: "
            "open mode (no keys) serves anyone who can connect, so it binds only to loopback"
        )
    for name in config.models:
        if not name:
            raise ConfigError("models: a model name must not be empty")
    if (config.tls_certfile is None) != (config.tls_keyfile is None):
        raise ConfigError("tls_certfile and tls_keyfile: TLS needs both, a certificate and its key; one is set")
    for name in ("tls_certfile", "tls_keyfile", "tls_ca_certs"):
        path = getattr(config, name)
        if path is not None and not path.is_file():
            raise ConfigError(f"{name}: {path} is not a readable file")
    if config.cluster_secret and is_placeholder(config.cluster_secret):
        raise ConfigError(
            "cluster_secret: still the example's placeholder; set a long random string of your own on every node "
            "(e.g. openssl rand -hex 32)"
        )
    if config.cluster_secret and len(config.cluster_secret) < MIN_CLUSTER_SECRET_CHARS:
        raise ConfigError(
            f"cluster_secret: {len(config.cluster_secret)} characters is too short to authenticate peers; "
            f"use at least {MIN_CLUSTER_SECRET_CHARS} random ones (e.g. openssl rand -hex 32)"
        )
    if config.join and not config.cluster_secret:
        raise ConfigError("join: joining a cluster needs cluster_secret (peers authenticate with it); none is set")
    if not config.accept_jobs and not config.cluster_secret:
        raise ConfigError("accept_jobs = false: a node that takes no jobs relays them to a cluster; set cluster_secret")
    if config.workers.container_runtime == "kubernetes" and config.workers.allowed_images and not config.workers.pod_name:
        # The DaemonSet gives the Pod its own name through the downward API (config/k8s/daemonset.yaml).
        if not env.get("POD_NAME"):
            raise ConfigError(
                "workers.container_runtime = \"kubernetes\" needs the daemon's own Pod name: set POD_NAME "
                "from the downward API (config/k8s/daemonset.yaml does) or workers.pod_name"
            )
        config = msgspec.structs.replace(config, workers=msgspec.structs.replace(config.workers, pod_name=env["POD_NAME"]))
    if config.workers.heartbeat_timeout_s <= config.workers.heartbeat_s:
        raise ConfigError(
            f"workers.heartbeat_timeout_s = {config.workers.heartbeat_timeout_s} must be longer than "
            f"workers.heartbeat_s = {config.workers.heartbeat_s}: a worker could never be on time"
        )
    if config.sampler_backend == "vllm" and not config.workers.vllm_python and importlib.util.find_spec("vllm") is None:
        # Found here, at startup, rather than when the first model loads.
        raise ConfigError(
            "sampler_backend = \"vllm\" needs the 'vllm' package, which is not installed here: set [workers] "
            "vllm_python to the interpreter of a vLLM environment (the image has /opt/openrld/envs/vllm/bin/python), "
            "or set sampler_backend = \"torch\""
        )
    return config


def load_api_keys(path: Path) -> dict[str, str]:
    """Read the API key file: a TOML or JSON object mapping key to user.

    A `.json` suffix is read as JSON, anything else as TOML. Every key must
    start with `tml-` (the SDK refuses any other) and every user must be a
    non-empty string.

    Returns:
        key -> user.

    Raises:
        ConfigError: naming the file and, where there is one, the bad entry
            (the key itself is never echoed; it is a secret).
    """
    source = f"api keys file {path}"
    try:
        raw_bytes = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it: {exc}") from exc
    try:
        if path.suffix == ".json":
            raw = json.loads(raw_bytes)
        else:
            raw = tomllib.loads(raw_bytes.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a non-empty table of key = user")
    keys: dict[str, str] = {}
    for number, (key, user) in enumerate(raw.items(), start=1):
        if not key.startswith(API_KEY_PREFIX) or len(key) == len(API_KEY_PREFIX) or any(c.isspace() for c in key):
            raise ConfigError(f"{source}: entry {number}: a key must be '{API_KEY_PREFIX}' followed by non-space characters")
        if not isinstance(user, str) or not user:
            raise ConfigError(f"{source}: entry {number}: the user must be a non-empty string, got {user!r}")
        if is_placeholder(key):
            raise ConfigError(
                f"{source}: entry {number} (user {user!r}): the key is still the example's placeholder; "
                "give each user a long random key of their own (e.g. tml-$(openssl rand -hex 24))"
            )
        keys[key] = user
    if mode & 0o077:
        logger.warning("api keys file %s can be read by other users (mode %o)", path, mode & 0o777)
    return keys


def process_environment() -> Mapping[str, str]:
    """The process environment, for the CLI to pass to `load_config` (the one read of it)."""
    return os.environ
