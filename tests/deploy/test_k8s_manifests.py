"""The GKE manifests in config/k8s/: valid for the supported Kubernetes versions, in
agreement with the daemon's config and with each other, and with the properties a
GPU cluster needs (requests, probes, drain, update strategy, no secret to overwrite)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import tomllib
from pathlib import Path

import msgspec
import pytest
from deploy_support import REPO, comment_text, require_module

from openrld.config import ENV_PREFIX, ConfigError, NodeConfig, load_api_keys, load_config
from openrld.worker.launchers import WorkerSpec
from openrld.worker.launchers.pod import PodLauncher, PodVolume, volumes_of_pod
from openrld.worker.protocol import Start

yaml = pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install -e .[test])")

K8S = REPO / "config" / "k8s"
SECRET_EXAMPLE = REPO / "config" / "k8s-secret.example.yaml"
# Every Kubernetes minor the manifests are checked against: 1.30 is the oldest with
# preStop's sleep action on by default; GKE's supported versions fall in this range.
K8S_VERSIONS = [f"1.{minor}.0" for minor in range(30, 38)]
# The uid the image runs as (Containerfile) and the systemd sysusers file makes.
DAEMON_UID = 10001


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.fixture(scope="module")
def pod(objects) -> dict:
    return objects[("DaemonSet", "openrld")]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    [openrld] = [c for c in pod["spec"]["containers"] if c["name"] == "openrld"]
    return openrld


@pytest.fixture(scope="module")
def init(pod) -> dict:
    [prepare] = pod["spec"]["initContainers"]
    return prepare


def _volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def _mount_of(container: dict, pod: dict, volume_kind: str) -> tuple[str, dict]:
    """(mountPath, volume) of the container's one mount whose volume has `volume_kind` (configMap, ...)."""
    volumes = _volumes(pod)
    [(path, volume)] = [
        (m["mountPath"], volumes[m["name"]]) for m in container["volumeMounts"] if volume_kind in volumes[m["name"]]
    ]
    return path, volume


def _mount_path(container: dict, volume: str) -> str:
    [path] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return path


# What Kubernetes fills in for the pod's fieldRefs, for a node named gke-pool-1-abcd.
_FIELD_VALUES = {"spec.nodeName": "gke-pool-1-abcd", "status.podIP": "10.8.0.7", "metadata.name": "openrld-x7k2p"}
# The real Secret is made from the operator's files; the tests make one up.
_CLUSTER_SECRET = secrets.token_hex(32)


def _env_value(entry: dict) -> str:
    """An env entry's value as the pod sees it: literal, from the Secret, or from a pod field."""
    if "value" in entry:
        return entry["value"]
    source = entry["valueFrom"]
    if "secretKeyRef" in source:
        assert source["secretKeyRef"] == {"name": "openrld-secrets", "key": "cluster-secret"}
        return _CLUSTER_SECRET
    return _FIELD_VALUES[source["fieldRef"]["fieldPath"]]


@pytest.fixture(scope="module")
def pod_env(container) -> dict[str, str]:
    return {e["name"]: _env_value(e) for e in container["env"]}


@pytest.fixture(scope="module")
def config_file(objects, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("k8s") / "openrld.toml"
    path.write_text(objects[("ConfigMap", "openrld-config")]["data"]["openrld.toml"])
    return path


@pytest.fixture(scope="module")
def node_config(config_file, pod_env) -> NodeConfig:
    """The config the pod's daemon would load: the ConfigMap's file, then the container's OPENRLD_* env."""
    return load_config(config_file, {}, pod_env)


# --- the set of objects, and their schema ---------------------------------------------------


def test_manifests_hold_the_objects_gke_needs_and_no_secret(objects):
    assert sorted(objects) == [
        ("ConfigMap", "openrld-config"), ("DaemonSet", "openrld"), ("Namespace", "openrld"),
        ("NetworkPolicy", "openrld-daemons"), ("NetworkPolicy", "openrld-workers-no-network"),
        ("PersistentVolumeClaim", "openrld-checkpoints"), ("PriorityClass", "openrld-node"),
        ("Role", "openrld-workers"), ("RoleBinding", "openrld-workers"),
        ("Service", "openrld"), ("Service", "openrld-peers"), ("ServiceAccount", "openrld"),
    ]
    namespaced = {doc["metadata"].get("namespace") for (kind, _), doc in objects.items()
                  if kind not in ("Namespace", "PriorityClass")}
    assert namespaced == {"openrld"}


def test_the_namespace_is_applied_first():
    # `kubectl apply -f config/k8s/` takes the files in name order; the rest need the namespace.
    first = sorted(K8S.glob("*.yaml"))[0]
    assert [doc["kind"] for doc in _docs(first)] == ["Namespace"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version):
    kubernetes_validate = require_module("kubernetes_validate", "make install-test, or pip install kubernetes-validate")
    paths = [*sorted(K8S.glob("*.yaml")), SECRET_EXAMPLE]
    for path in paths:
        for doc in _docs(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']} is invalid for {version}: "
                            f"{'.'.join(map(str, error.path))}: {error.message}")


def test_every_mount_names_a_volume_and_every_volume_is_mounted(pod):
    volumes = set(_volumes(pod))
    mounted = {m["name"] for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
               for m in c["volumeMounts"]}
    assert mounted == volumes


def test_the_pod_uses_the_service_account_and_priority_class_defined_here(objects, pod):
    spec = pod["spec"]
    assert ("ServiceAccount", spec["serviceAccountName"]) in objects
    assert ("PriorityClass", spec["priorityClassName"]) in objects


# --- secrets: none applied, none readable by others ---------------------------------------------


def test_no_secret_and_no_placeholder_in_the_applied_directory():
    # An applied Secret would write its placeholders over the real one at every apply.
    for path in K8S.glob("*.yaml"):  # what `kubectl apply -f config/k8s/` applies (agentic/ is its own)
        text = path.read_text()
        assert "kind: Secret" not in text, path.name
        assert not re.search(r"REPLACE|CHANGE.?ME|PLACEHOLDER", text, re.IGNORECASE), path.name


def test_the_example_secret_has_the_keys_the_pod_reads(objects, container, pod, node_config):
    [example] = _docs(SECRET_EXAMPLE)
    assert (example["kind"], example["metadata"]["name"]) == ("Secret", "openrld-secrets")
    refs = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert {ref["name"] for ref in refs} == {"openrld-secrets"}
    assert sorted(example["stringData"]) == sorted([node_config.api_keys_file.name, *(r["key"] for r in refs)])
    sources = _volumes(pod)["secrets-source"]["projected"]["sources"]
    assert {"name": "openrld-secrets"} in [s["secret"] for s in sources]


def test_the_daemon_refuses_the_example_secret_values(tmp_path):
    """Copying the example as it is must not give a working cluster."""
    [example] = _docs(SECRET_EXAMPLE)
    keys = tmp_path / "api-keys.toml"
    keys.write_text(example["stringData"]["api-keys.toml"])
    keys.chmod(0o600)
    assert all(key.startswith("tml-") for key in tomllib.loads(keys.read_text()))
    with pytest.raises(ConfigError, match="placeholder"):
        load_api_keys(keys)
    env = {"OPENRLD_CLUSTER_SECRET": example["stringData"]["cluster-secret"]}
    with pytest.raises(ConfigError, match="cluster_secret"):
        load_config(None, {}, env)


def test_the_daemon_reads_its_key_file_from_an_in_memory_copy_only_it_can_read(container, init, pod, node_config):
    volumes = _volumes(pod)
    [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == node_config.api_keys_file.parent]
    assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    assert mount.get("readOnly") is True
    # The Secret itself is mounted only in the init container, which copies it as 0400.
    assert "secrets-source" not in {m["name"] for m in container["volumeMounts"]}
    assert _mount_path(init, mount["name"]) == mount["mountPath"]
    # fsGroup would make every file of a Secret volume group-readable (0440): the daemon warns.
    assert "fsGroup" not in pod["spec"]["securityContext"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the init script sets owners: run as root (CI does)")
def test_the_init_script_hands_the_volumes_and_a_0400_key_file_to_the_daemon(init, tmp_path):
    """Run the init container's script here, its paths moved under tmp_path."""
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    moved = {name: tmp_path / name for name in mounts}
    for directory in moved.values():
        directory.mkdir()
    source = moved["secrets-source"]
    (source / "..data").mkdir()  # kubelet's layout: the visible names link into ..data
    (source / "..data" / "api-keys.toml").write_text(f'"tml-{secrets.token_hex(16)}" = "alice"\n')
    (source / "..data" / "cluster-secret").write_text(_CLUSTER_SECRET)
    for name in ("api-keys.toml", "cluster-secret"):
        (source / name).symlink_to(f"..data/{name}")
    by_path = {path: str(moved[name]) for name, path in mounts.items()}
    longest_first = sorted(by_path, key=len, reverse=True)
    script = re.sub("|".join(map(re.escape, longest_first)), lambda m: by_path[m.group(0)], init["command"][-1])
    assert init["command"][:2] == ["sh", "-ec"]
    subprocess.run(["sh", "-ec", script], check=True, timeout=30)
    for name in ("data", "checkpoints", "secrets"):
        info = moved[name].stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (DAEMON_UID, DAEMON_UID, 0o700), name
    for name in ("api-keys.toml", "cluster-secret"):
        info = (moved["secrets"] / name).lstat()
        assert (info.st_uid, info.st_mode & 0o7777) == (DAEMON_UID, 0o400), name
    assert sorted(p.name for p in moved["secrets"].iterdir()) == ["api-keys.toml", "cluster-secret"]


def test_the_init_container_runs_the_daemon_image_with_only_chown_and_fowner(init, container):
    assert init["image"] == container["image"]
    security = init["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert (security["allowPrivilegeEscalation"], security["readOnlyRootFilesystem"]) == (False, True)


# --- the config the pod's daemon runs with ----------------------------------------------------------


def test_the_command_reads_the_configmap_file(container, pod):
    mount, volume = _mount_of(container, pod, "configMap")
    assert volume["configMap"]["name"] == "openrld-config"
    assert container["command"] == ["openrld", "serve", "--config", f"{mount}/openrld.toml"]


def test_the_environment_sets_only_what_differs_per_pod_or_is_secret(container):
    # OPENRLD_* beat the file: anything set here would silently override the ConfigMap.
    fields = {f.name for f in msgspec.structs.fields(NodeConfig)}
    names = [e["name"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)]
    assert names == ["OPENRLD_NODE_NAME", "OPENRLD_ADVERTISE_HOST", "OPENRLD_CLUSTER_SECRET"]
    assert {name.removeprefix(ENV_PREFIX).lower() for name in names} <= fields


def test_service_links_are_off_because_they_would_set_openrld_port(pod, config_file, pod_env):
    # With service links on, Kubernetes adds OPENRLD_PORT=tcp://<ip>:8000 (from the Service
    # named openrld) and the daemon reads it as its port.
    assert pod["spec"]["enableServiceLinks"] is False
    links = {"OPENRLD_PORT": "tcp://10.12.0.5:8000", "OPENRLD_SERVICE_HOST": "10.12.0.5"}
    with pytest.raises(ConfigError):
        load_config(config_file, {}, {**pod_env, **links})


def test_config_serves_all_interfaces_with_keys_json_logs_and_requires_a_gpu(node_config):
    assert (node_config.host, node_config.is_open_mode, node_config.log_json) == ("0.0.0.0", False, True)
    assert node_config.device == "cuda"


def test_container_port_and_both_services_use_the_config_port(objects, container, node_config):
    [port] = [p for p in container["ports"] if p["name"] == "http"]
    assert (port["containerPort"], port["protocol"]) == (node_config.port, "TCP")
    for name in ("openrld", "openrld-peers"):
        [service_port] = objects[("Service", name)]["spec"]["ports"]
        assert (service_port["port"], service_port["targetPort"]) == (node_config.port, "http")


def test_gossip_port_is_the_config_gossip_port_over_udp(container, node_config):
    [port] = [p for p in container["ports"] if p["name"] == "gossip"]
    assert (port["containerPort"], port["protocol"]) == (node_config.gossip_port, "UDP")


def test_rendezvous_port_is_the_config_rendezvous_port_over_tcp(container, node_config):
    [port] = [p for p in container["ports"] if p["name"] == "rendezvous"]
    assert (port["containerPort"], port["protocol"]) == (node_config.workers.rendezvous_port, "TCP")


def test_daemon_pods_admit_the_api_from_anywhere_and_every_port_from_each_other(objects, pod, node_config):
    # A spanning trainer's ranks talk on ephemeral ports: only "every port" from the peers admits them.
    spec = objects[("NetworkPolicy", "openrld-daemons")]["spec"]
    assert spec["podSelector"]["matchLabels"] == pod["metadata"]["labels"]
    assert spec["ingress"] == [
        {"ports": [{"port": node_config.port, "protocol": "TCP"}]},
        {"from": [{"podSelector": {"matchLabels": pod["metadata"]["labels"]}}]},
    ]


def test_pods_join_through_the_headless_peers_service_on_the_http_port(objects, node_config):
    peers = objects[("Service", "openrld-peers")]["metadata"]
    assert node_config.join == (f"{peers['name']}.{peers['namespace']}.svc.cluster.local:{node_config.port}",)


def test_member_identity_and_cluster_secret_come_from_the_pod_and_the_secret(node_config):
    assert (node_config.node_name, node_config.advertise_host, node_config.cluster_secret) == (
        "gke-pool-1-abcd", "10.8.0.7", _CLUSTER_SECRET
    )


def test_services_select_the_daemonset_pods_and_peers_are_headless(objects, pod):
    labels = pod["metadata"]["labels"]
    for name in ("openrld", "openrld-peers"):
        assert objects[("Service", name)]["spec"]["selector"].items() <= labels.items()
    peers = objects[("Service", "openrld-peers")]["spec"]
    assert (peers["clusterIP"], peers["publishNotReadyAddresses"]) == ("None", True)
    assert "clusterIP" not in objects[("Service", "openrld")]["spec"]


# --- state: the database node-local, checkpoints on a shared volume -----------------------------------


def test_data_dir_is_the_host_path_volume(container, pod, node_config):
    mount, volume = _mount_of(container, pod, "hostPath")
    assert Path(mount) == node_config.data_dir == Path(volume["hostPath"]["path"])


def test_checkpoint_root_is_a_read_write_many_volume_mounted_at_the_same_path(objects, container, pod, node_config):
    mount, volume = _mount_of(container, pod, "persistentVolumeClaim")
    assert node_config.checkpoint_root == Path(mount)
    claim = objects[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert node_config.checkpoint_root != node_config.data_dir and node_config.data_dir not in node_config.checkpoint_root.parents


# --- the pod's resources, probes and life cycle ------------------------------------------------------------


def test_every_container_requests_cpu_and_memory_so_the_pod_is_never_best_effort(pod, container):
    for each in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
        requests = each["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), each["name"]
    # The daemon never uses more memory than it asked for: under node pressure the kubelet
    # evicts every pod over its request before it.
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "cpu" not in container["resources"]["limits"]


def test_probes_ask_the_health_route_with_timeouts_a_busy_node_meets(container):
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/api/v1/healthz", "port": "http"}, probe
        assert container[probe]["timeoutSeconds"] >= 5, probe
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    # Torch's import and CUDA's start may take minutes on a loaded node; a restart kills jobs.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    assert "initialDelaySeconds" not in liveness  # the startup probe holds it off


def test_stopping_pauses_then_drains_within_the_grace_period(pod, container, node_config):
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause >= 3
    drain = node_config.http.graceful_timeout + node_config.http.shutdown_timeout + 1.0  # + gossip leave
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + drain + 10


def test_the_drain_times_in_the_comments_are_the_codes(node_config):
    prose = comment_text((K8S / "daemonset.yaml").read_text())
    http = node_config.http
    assert f"graceful_timeout ({http.graceful_timeout:g} s)" in prose
    assert f"shutdown_timeout ({http.shutdown_timeout:g} s)" in prose


def test_updates_wait_for_each_pod_to_be_deleted(objects):
    assert objects[("DaemonSet", "openrld")]["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_only_the_daemons_pod_gets_the_service_account_token(objects, pod):
    # The daemon calls the API (worker Pods); any other Pod under this account would not get it.
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert objects[("ServiceAccount", "openrld")]["automountServiceAccountToken"] is False


def test_the_daemon_may_only_create_get_list_and_delete_pods_in_its_namespace(objects, pod):
    assert not [kind for kind, _ in objects if kind in ("ClusterRole", "ClusterRoleBinding")]
    role = objects[("Role", "openrld-workers")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]}]
    binding = objects[("RoleBinding", "openrld-workers")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "openrld-workers"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["spec"]["serviceAccountName"], "namespace": "openrld"}]


def test_the_pod_launcher_finds_its_own_pod_by_name(pod_env):
    assert pod_env["POD_NAME"] == _FIELD_VALUES["metadata.name"]


def test_worker_pods_get_no_network_in_or_out(objects):
    policy = objects[("NetworkPolicy", "openrld-workers-no-network")]["spec"]
    assert (policy["policyTypes"], "ingress" in policy, "egress" in policy) == (["Ingress", "Egress"], False, False)
    # It selects the Pods the launcher makes, by the label the launcher sets.
    spec = WorkerSpec(name="w", role="trainer", start=Start("lora_trainer", "/m", "cpu"), image="i/j:1")
    launcher = PodLauncher(None, "openrld", "n", "n", (PodVolume("/var/lib/openrld", host_path="/var/lib/openrld"),))
    manifest, _ = launcher.manifest(spec, "/var/lib/openrld/workers/w.sock", {}, "openrld-worker-1")
    assert policy["podSelector"]["matchLabels"].items() <= manifest["metadata"]["labels"].items()


def test_worker_pods_can_share_the_daemons_data_dir_and_checkpoint_claim(pod, node_config):
    assert volumes_of_pod(pod) == (
        PodVolume(str(node_config.data_dir), host_path=str(node_config.data_dir)),
        PodVolume(str(node_config.checkpoint_root), claim="openrld-checkpoints"),
    )


# --- placement and privileges ------------------------------------------------------------------------------


def test_daemonset_runs_only_on_gpu_nodes(pod, container):
    [term] = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def test_container_runs_as_the_image_uid_unprivileged_on_a_read_only_root(container, pod):
    security = pod["spec"]["securityContext"]
    assert (security["runAsNonRoot"], security["runAsUser"], security["runAsGroup"]) == (True, DAEMON_UID, DAEMON_UID)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }


def test_the_image_is_the_one_the_containerfile_builds(container):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"].endswith(f"/openrld:{version}")
    assert "Containerfile" in (K8S / "daemonset.yaml").read_text()
