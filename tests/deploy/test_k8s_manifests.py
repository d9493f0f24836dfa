"""The GKE manifests in config/k8s/ parse, and agree with the daemon's config and with each other."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from openrld.config import ENV_PREFIX, NodeConfig, load_config

yaml = pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install -e .[test])")

K8S = Path(__file__).resolve().parents[2] / "config" / "k8s"


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.fixture(scope="module")
def pod(objects) -> dict:
    return objects[("DaemonSet", "openrld")]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    [openrld] = [c for c in pod["spec"]["containers"] if c["name"] == "openrld"]
    return openrld


def _mount_of(container: dict, pod: dict, volume_kind: str) -> tuple[str, dict]:
    """(mountPath, volume) of the container's mount whose volume has `volume_kind` (configMap, secret, ...)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    [(path, volume)] = [
        (m["mountPath"], volumes[m["name"]]) for m in container["volumeMounts"] if volume_kind in volumes[m["name"]]
    ]
    return path, volume


@pytest.fixture(scope="module")
def node_config(objects, container, pod, tmp_path_factory) -> NodeConfig:
    """The config the pod's daemon would load: the ConfigMap's file, then the container's OPENRLD_* env."""
    path = tmp_path_factory.mktemp("k8s") / "openrld.toml"
    path.write_text(objects[("ConfigMap", "openrld-config")]["data"]["openrld.toml"])
    env = {e["name"]: _env_value(e, objects) for e in container["env"]}
    return load_config(path, {}, env)


# What Kubernetes fills in for the pod's fieldRefs, for a node named gke-pool-1-abcd.
_FIELD_VALUES = {"spec.nodeName": "gke-pool-1-abcd", "status.podIP": "10.8.0.7"}


def _env_value(entry: dict, objects: dict) -> str:
    """An env entry's value as the pod sees it: literal, from a Secret key, or from a pod field."""
    if "value" in entry:
        return entry["value"]
    source = entry["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return objects[("Secret", ref["name"])]["stringData"][ref["key"]]
    return _FIELD_VALUES[source["fieldRef"]["fieldPath"]]


def test_manifests_hold_the_five_objects_gke_needs(objects):
    assert sorted(objects) == [
        ("ConfigMap", "openrld-config"), ("DaemonSet", "openrld"), ("Namespace", "openrld"),
        ("Secret", "openrld-secrets"), ("Service", "openrld"), ("Service", "openrld-peers"),
    ]
    assert {doc["metadata"].get("namespace") for kind, doc in objects.items() if kind[0] != "Namespace"} == {"openrld"}


def test_daemonset_runs_only_on_gpu_nodes(pod, container):
    [term] = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "cloud.google.com/gke-accelerator", "operator": "Exists"}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_the_command_reads_the_configmap_file(container, pod):
    mount, volume = _mount_of(container, pod, "configMap")
    assert volume["configMap"]["name"] == "openrld-config"
    assert container["command"] == ["openrld", "serve", "--config", f"{mount}/openrld.toml"]


def test_every_openrld_env_var_names_a_config_field(container):
    fields = {f.name for f in msgspec.structs.fields(NodeConfig)}
    names = [e["name"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)]
    assert names == ["OPENRLD_LOG_JSON", "OPENRLD_NODE_NAME", "OPENRLD_ADVERTISE_HOST", "OPENRLD_CLUSTER_SECRET"]
    assert {name.removeprefix(ENV_PREFIX).lower() for name in names} <= fields


def test_config_serves_all_interfaces_with_keys_and_json_logs(node_config):
    assert (node_config.host, node_config.is_open_mode, node_config.log_json) == ("0.0.0.0", False, True)


def test_container_port_and_both_services_use_the_config_port(objects, container, node_config):
    [port] = [p for p in container["ports"] if p["name"] == "http"]
    assert (port["containerPort"], port["protocol"]) == (node_config.port, "TCP")
    for name in ("openrld", "openrld-peers"):
        [service_port] = objects[("Service", name)]["spec"]["ports"]
        assert (service_port["port"], service_port["targetPort"]) == (node_config.port, "http")


def test_gossip_port_is_the_config_gossip_port_over_udp(container, node_config):
    [port] = [p for p in container["ports"] if p["name"] == "gossip"]
    assert (port["containerPort"], port["protocol"]) == (node_config.gossip_port, "UDP")


def test_pods_join_through_the_headless_peers_service_on_the_http_port(objects, node_config):
    peers = objects[("Service", "openrld-peers")]["metadata"]
    assert node_config.join == (f"{peers['name']}.{peers['namespace']}.svc.cluster.local:{node_config.port}",)


def test_member_identity_and_cluster_secret_come_from_the_pod_and_the_secret(objects, node_config):
    secret = objects[("Secret", "openrld-secrets")]["stringData"]["cluster-secret"]
    assert (node_config.node_name, node_config.advertise_host, node_config.cluster_secret) == (
        "gke-pool-1-abcd", "10.8.0.7", secret
    )


def test_services_select_the_daemonset_pods_and_peers_are_headless(objects, pod):
    labels = pod["metadata"]["labels"]
    for name in ("openrld", "openrld-peers"):
        assert objects[("Service", name)]["spec"]["selector"].items() <= labels.items()
    peers = objects[("Service", "openrld-peers")]["spec"]
    assert (peers["clusterIP"], peers["publishNotReadyAddresses"]) == ("None", True)
    assert "clusterIP" not in objects[("Service", "openrld")]["spec"]


def test_data_dir_is_the_host_path_volume(container, pod, node_config):
    mount, volume = _mount_of(container, pod, "hostPath")
    assert Path(mount) == node_config.data_dir == Path(volume["hostPath"]["path"])


def test_api_keys_file_is_a_key_of_the_mounted_secret(objects, container, pod, node_config):
    mount, volume = _mount_of(container, pod, "secret")
    secret = objects[("Secret", volume["secret"]["secretName"])]
    assert node_config.api_keys_file is not None and node_config.api_keys_file.parent == Path(mount)
    assert sorted(secret["stringData"]) == [node_config.api_keys_file.name, "cluster-secret"]
    keys = tomllib.loads(secret["stringData"][node_config.api_keys_file.name])
    assert all(key.startswith("tml-") for key in keys)


def test_probes_ask_the_health_route_on_the_http_port(container):
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/api/v1/healthz", "port": "http"}


def test_container_runs_unprivileged_on_a_read_only_root(container, pod):
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }
