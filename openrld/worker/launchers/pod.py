"""The Pod launcher: a worker in a container image, as a Pod beside the daemon on Kubernetes.

On Kubernetes the daemon (a DaemonSet Pod) has no container runtime to call; it asks
the API server for a Pod instead, through the official `kubernetes` client (the
`k8s` extra, imported lazily). The Pod is what the container launcher runs, in
Kubernetes' terms:
- `nodeName` is the daemon's own node, so the worker reaches the daemon's Unix
  socket through the node's filesystem: the socket directory must be on a hostPath
  volume of the daemon's Pod (config/k8s: `[workers] socket_dir` under the data
  dir, /var/lib/openrld). Setting nodeName skips the scheduler, so the Pod cannot
  land elsewhere;
- the socket file alone is mounted (a hostPath of type Socket, read-only), at
  `WORKER_SOCKET_DIR`/<name>; the spec's mounts are the same volumes the daemon's
  own Pod mounts at their paths (`PodVolume`): a hostPath (the node's data dir,
  where models live) at the file's path on the node, a PersistentVolumeClaim (the
  shared checkpoint root) with a subPath;
- `nvidia.com/gpu: 1` for a cuda device: the device plugin, not the daemon, picks
  which GPU, from those no other Pod holds (docs/custom-images.md says what the
  operator must leave free); the worker sees it as cuda:0;
- the daemon's uid and gid, no capabilities, no privilege escalation, no service
  account token, no service links, restartPolicy Never, and no network need (a
  NetworkPolicy in config/k8s denies worker Pods all traffic);
- the labels `openrld.node`, `openrld.role`, `openrld.job` (a job id made a valid
  label value; the id itself is an annotation), for `reap`.

The token is in the Pod's environment, readable by whoever may read Pods in the
namespace; it is good for one hello only: `start_worker` closes the listener at
the first connection, so a token read later opens nothing.

`poll` reads the Pod: Succeeded or Failed give the container's exit status; an
image that cannot be pulled or a container that cannot be created ends it too
(status -1, the reason in the log), so that the daemon does not wait out the
hello deadline for a worker that will never start. `stop` deletes the Pod with
the timeout as its grace period (the worker ignores SIGTERM, so that is the time
it has to finish after Bye) and waits until the Pod is gone. Each API call has
`API_S` as its deadline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec

from openrld.errors import ServerError
from openrld.worker.launchers import WORKER_SOCKET_DIR, LaunchedWorker, Mount, WorkerSpec
from openrld.worker.launchers.remote import LOST, RemoteWorker

logger = logging.getLogger(__name__)

API_S = 30.0  # one request to the API server
GONE_MARGIN_S = 60.0  # after a delete's grace period, for the kubelet to report the Pod gone
GONE_POLL_S = 0.5  # how often `stop` asks whether the Pod is gone (the API server has no cheaper signal short of a watch)
CONTAINER = "worker"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Waiting reasons after which the container will never start on its own.
_NEVER_STARTS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "ErrImageNeverPull"}
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


class PodLaunchError(ServerError):
    """The API server refused a request, did not answer, or the client is not installed."""


class PodVolume(msgspec.Struct, frozen=True):
    """A directory of the daemon's Pod that a worker Pod can mount too."""

    path: str  # where the daemon's container mounts it
    host_path: str | None = None  # a hostPath volume: the node's directory
    claim: str | None = None  # or a PersistentVolumeClaim, by name


def volumes_of_pod(pod: dict, container: str = "openrld") -> tuple[PodVolume, ...]:
    """The hostPath and PersistentVolumeClaim mounts of the daemon's own Pod (its manifest,
    as the API server returns it): what a worker Pod on the same node can share."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    [daemon] = [c for c in pod["spec"]["containers"] if c["name"] == container]
    found = []
    for mount in daemon.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sub = mount.get("subPath", "")
        if "hostPath" in volume:
            found.append(PodVolume(mount["mountPath"], host_path=str(PurePosixPath(volume["hostPath"]["path"], sub))))
        elif "persistentVolumeClaim" in volume and not sub:
            found.append(PodVolume(mount["mountPath"], claim=volume["persistentVolumeClaim"]["claimName"]))
    return tuple(found)


def in_cluster(node: str, pod_name: str) -> PodLauncher:
    """The launcher for a daemon running in a Pod: its credentials, namespace, node and
    volumes come from the service account and from its own Pod, `pod_name`."""
    client = _client()
    client.config.load_incluster_config()
    api = client.CoreV1Api()
    namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    own = _json(lambda: api.read_namespaced_pod(pod_name, namespace, _preload_content=False, _request_timeout=API_S),
                f"read its own Pod {pod_name}")
    return PodLauncher(api, namespace, node, own["spec"]["nodeName"], volumes_of_pod(own))


class PodLauncher:
    def __init__(
        self, api: Any, namespace: str, node: str, kubernetes_node: str, volumes: tuple[PodVolume, ...],
        *, uid: int | None = None, gid: int | None = None,
    ) -> None:
        self.api = api  # a kubernetes.client.CoreV1Api
        self.namespace = namespace  # the daemon's: its Role allows Pods there only
        self.node = node  # the openrld node name, the label `reap` looks for
        self.kubernetes_node = kubernetes_node  # the node the daemon's Pod runs on
        self.volumes = volumes
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid

    def launch(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str]) -> LaunchedWorker:
        if spec.image is None:
            raise ValueError(f"{spec.name}: the Pod launcher runs images, and this spec names none")
        manifest, device = self.manifest(spec, socket_path, environment, f"openrld-worker-{secrets.token_hex(6)}")
        name = manifest["metadata"]["name"]
        _json(lambda: self.api.create_namespaced_pod(self.namespace, manifest, _preload_content=False, _request_timeout=API_S),
              f"create Pod {name}")
        logger.info("worker %s runs in Pod %s/%s (image %s)", spec.name, self.namespace, name, spec.image)
        return WorkerPod(self, name, device, spec.name)

    def reap(self) -> int:
        listed = _json(lambda: self.api.list_namespaced_pod(
            self.namespace, label_selector=f"openrld.node={self.node}", _preload_content=False, _request_timeout=API_S,
        ), "list this node's worker Pods")
        names = [pod["metadata"]["name"] for pod in listed.get("items", [])]
        if names:
            logger.warning("deleting %d worker Pod(s) an earlier daemon left: %s", len(names), " ".join(names))
        for name in names:
            self._delete(name, 0)
        return len(names)

    def manifest(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str], name: str) -> tuple[dict, str]:
        """The Pod for `spec`, and the device its worker sees."""
        inside = f"{WORKER_SOCKET_DIR}/{PurePosixPath(socket_path).name}"
        volumes = [{"name": "socket", "hostPath": {"path": self._host_path(socket_path), "type": "Socket"}}]
        mounts = [{"name": "socket", "mountPath": inside, "readOnly": True}]
        for index, mount in enumerate(spec.mounts):
            volume, mounted = self._volume(f"mount-{index}", mount)
            volumes.append(volume)
            mounts.append(mounted)
        env = {**environment, "OPENRLD_WORKER_SOCKET": inside, "OPENRLD_WORKER_IGNORE_SIGNALS": "1"}
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "env": [{"name": key, "value": value} for key, value in env.items()],
            "volumeMounts": mounts,
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
        device = spec.start.device
        if device != "cpu":
            kind, _, ordinal = device.partition(":")
            if kind != "cuda" or not (ordinal or "0").isdigit():
                raise ValueError(f"a worker Pod takes 'cpu' or 'cuda:N', got {device!r}")
            container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}  # a quantity: a string
            device = "cuda:0"
        security: dict[str, Any] = {"runAsUser": self.uid, "runAsGroup": self.gid, "seccompProfile": {"type": "RuntimeDefault"}}
        if self.uid != 0:
            security["runAsNonRoot"] = True
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {
                    "app.kubernetes.io/name": "openrld-worker",
                    "openrld.node": _label_value(self.node),
                    "openrld.role": spec.role,
                    "openrld.job": _label_value(spec.job or ""),
                },
                "annotations": {"openrld.job": spec.job or "", "openrld.worker": spec.name},
            },
            "spec": {
                "nodeName": self.kubernetes_node,
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "securityContext": security,
                "containers": [container],
                "volumes": volumes,
            },
        }
        return manifest, device

    # ------------------------------------------------------------------ volumes

    def _owner(self, path: str) -> tuple[PodVolume, str]:
        """The daemon's volume that holds `path`, and the path within it."""
        target = PurePosixPath(path)
        for volume in sorted(self.volumes, key=lambda v: len(v.path), reverse=True):
            root = PurePosixPath(volume.path)
            if target == root or root in target.parents:
                return volume, str(target.relative_to(root))
        known = ", ".join(v.path for v in self.volumes) or "none"
        raise ValueError(
            f"{path} is on no volume a worker Pod can share (hostPath or PersistentVolumeClaim mounts of the "
            f"daemon's Pod: {known})"
        )

    def _host_path(self, path: str) -> str:
        volume, within = self._owner(path)
        if volume.host_path is None:
            raise ValueError(f"{path} must be on a hostPath volume of the daemon's Pod: a socket is not shared over a claim")
        return str(PurePosixPath(volume.host_path, within))

    def _volume(self, name: str, mount: Mount) -> tuple[dict, dict]:
        volume, within = self._owner(mount.source)
        mounted: dict[str, Any] = {"name": name, "mountPath": mount.target, "readOnly": mount.read_only}
        if volume.host_path is not None:
            return {"name": name, "hostPath": {"path": str(PurePosixPath(volume.host_path, within))}}, mounted
        if within != ".":
            mounted["subPath"] = within
        return {"name": name, "persistentVolumeClaim": {"claimName": volume.claim, "readOnly": mount.read_only}}, mounted

    # ------------------------------------------------------------------ the API

    def _read(self, name: str) -> dict | None:
        """The Pod as the API server has it; None once it is gone."""
        return _json(lambda: self.api.read_namespaced_pod(name, self.namespace, _preload_content=False, _request_timeout=API_S),
                     f"read Pod {name}", missing_ok=True)

    def _delete(self, name: str, grace_s: int) -> None:
        _json(lambda: self.api.delete_namespaced_pod(
            name, self.namespace, grace_period_seconds=grace_s, _preload_content=False, _request_timeout=API_S,
        ), f"delete Pod {name}", missing_ok=True)


class WorkerPod(RemoteWorker):
    """One worker's Pod, as `start_worker` and `WorkerConnection` watch and stop it."""

    def __init__(self, launcher: PodLauncher, name: str, device: str, worker: str) -> None:
        super().__init__(name, device, worker)
        self.launcher = launcher

    def _ask_status(self) -> int | None:
        pod = self.launcher._read(self.name)
        if pod is None:
            return self._gone()
        ended: int | None = None
        status = pod.get("status", {})
        for container in status.get("containerStatuses", []):
            state = container.get("state", {})
            if "terminated" in state:
                ended = int(state["terminated"].get("exitCode", LOST))
            elif state.get("waiting", {}).get("reason") in _NEVER_STARTS:
                waiting = state["waiting"]
                logger.error("worker %s: Pod %s cannot start: %s: %s", self.worker, self.name,
                             waiting["reason"], waiting.get("message", ""))
                ended = LOST
        if ended is None and status.get("phase") in ("Succeeded", "Failed"):
            ended = LOST  # ended with no container status: evicted, or its node went away
        return ended

    def stop(self, timeout: float) -> None:
        if self._removed:
            return
        self.poll()
        grace = math.ceil(max(timeout, 0.0))
        self.launcher._delete(self.name, grace)
        deadline = time.monotonic() + grace + GONE_MARGIN_S
        waiting = threading.Event()  # never set: a wait with a timeout, between two reads
        while True:
            pod = self.launcher._read(self.name)
            if pod is None:
                break
            self._record_exit(pod)
            if time.monotonic() > deadline:
                raise PodLaunchError(f"Pod {self.name} was deleted and is still there after {grace + GONE_MARGIN_S:.0f} s")
            waiting.wait(GONE_POLL_S)
        self._removed = True

    def describe(self) -> str:
        return f"Pod {self.launcher.namespace}/{self.name}"

    def _record_exit(self, pod: dict) -> None:
        for container in pod.get("status", {}).get("containerStatuses", []):
            terminated = container.get("state", {}).get("terminated")
            if terminated is not None and self._status is None:
                self._status = int(terminated.get("exitCode", LOST))


def _label_value(text: str) -> str:
    """A valid label value: at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends."""
    return _LABEL_VALUE.sub(".", text)[:63].strip("_.-")


def _client() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise PodLaunchError(
            "the Pod launcher needs the 'kubernetes' package: install openrld with the k8s extra "
            "(pip install 'openrld[k8s]')"
        ) from None
    return kubernetes


def _json(request: Any, what: str, *, missing_ok: bool = False) -> Any:
    """Make one API request (the client's raw response) and read its JSON body."""
    client = _client().client
    import urllib3  # the client's transport

    try:
        response = request()
    except client.ApiException as error:
        if missing_ok and error.status == 404:
            return None
        reason = _status_message(error.body) or error.reason
        raise PodLaunchError(f"Kubernetes API: {what} failed ({error.status}): {reason}") from None
    except (urllib3.exceptions.HTTPError, OSError) as error:  # refused, reset, timed out
        raise PodLaunchError(f"Kubernetes API: {what} failed: {type(error).__name__}: {error}") from None
    return json.loads(response.data) if response.data else {}


def _status_message(body: Any) -> str:
    try:
        return json.loads(body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return ""
