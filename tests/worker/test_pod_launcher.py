"""The Pod launcher against a fake Kubernetes API server: the exact Pod it asks for, and how
it reads a Pod's end, deletes it and waits for it to go, and reaps an earlier daemon's.

No Kubernetes API can run here, so the fake (`FakeApiServer`, http.server in a thread)
answers the four requests the official client makes: create, read, list by label,
delete. It cannot start a worker: a Pod's status is what the test sets.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from openrld.errors import EngineLost
from openrld.worker.client import WorkerTimeouts
from openrld.worker.launchers import WORKER_SOCKET_DIR, Mount, WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.pod import PodLauncher, PodLaunchError, PodVolume, volumes_of_pod
from openrld.worker.protocol import Start

kubernetes = pytest.importorskip("kubernetes", reason="the k8s extra (pip install -e .[test])")

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "openrld"
DATA = PodVolume("/var/lib/openrld", host_path="/var/lib/openrld")
CHECKPOINTS = PodVolume("/mnt/openrld-checkpoints", claim="openrld-checkpoints")


class FakeApiServer:
    """Pods in one namespace, kept as the JSON they were created with."""

    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.created: list[dict] = []
        self.deletes: list[tuple[str, int]] = []
        self.reads_after_delete: dict[str, int] = {}  # a deleted Pod is read this often before it is gone
        self.refuse_create: tuple[int, str] | None = None
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self) -> tuple[str | None, dict]:
                url = urlsplit(self.path)
                prefix = f"/api/v1/namespaces/{NAMESPACE}/pods"
                assert url.path.startswith(prefix), url.path
                return url.path[len(prefix) + 1 :] or None, parse_qs(url.query)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    if fake.refuse_create is not None:
                        code, message = fake.refuse_create
                        return self._answer(code, {"kind": "Status", "status": "Failure", "message": message, "code": code})
                    fake.created.append(body)
                    fake.pods[body["metadata"]["name"]] = {**body, "status": {"phase": "Pending"}}
                self._answer(201, body)

            def do_GET(self) -> None:
                name, query = self._route()
                with fake.lock:
                    if name is None:
                        key, _, value = query["labelSelector"][0].partition("=")
                        items = [p for p in fake.pods.values() if p["metadata"]["labels"].get(key) == value]
                        return self._answer(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
                    if name in fake.reads_after_delete:
                        if fake.reads_after_delete[name] == 0:
                            del fake.reads_after_delete[name], fake.pods[name]
                        else:
                            fake.reads_after_delete[name] -= 1
                    if name not in fake.pods:
                        return self._answer(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                    self._answer(200, fake.pods[name])

            def do_DELETE(self) -> None:
                name, query = self._route()
                with fake.lock:
                    fake.deletes.append((name, int(query["gracePeriodSeconds"][0])))
                    if name not in fake.pods:
                        return self._answer(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                    fake.reads_after_delete.setdefault(name, 0)
                    self._answer(200, fake.pods[name])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{self.server.server_port}")
        self.api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))

    def set_status(self, name: str, status: dict) -> None:
        with self.lock:
            self.pods[name]["status"] = status

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def terminated(exit_code: int, phase: str) -> dict:
    return {"phase": phase, "containerStatuses": [{"name": "worker", "state": {"terminated": {"exitCode": exit_code}}}]}


@pytest.fixture
def fake():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def launcher(fake) -> PodLauncher:
    return PodLauncher(fake.api, NAMESPACE, "gke-pool-1-abcd", "gke-pool-1-abcd", (DATA, CHECKPOINTS), uid=10001, gid=10001)


def spec(device: str = "cpu", **fields) -> WorkerSpec:
    start = Start("lora_trainer", "/var/lib/openrld/models/smollm2", device)
    return WorkerSpec(name="trainer", role="trainer", start=start, image="ghcr.io/acme/trainer:1", **fields)


SOCKET = "/var/lib/openrld/workers/openrld-7-ab/w-0123.sock"


def test_the_pod_asked_for_in_full(fake, launcher):
    mounts = (
        Mount("/var/lib/openrld/models/smollm2", "/var/lib/openrld/models/smollm2"),
        Mount("/mnt/openrld-checkpoints/run-1/state", "/ckpt", read_only=False),
    )
    worker = launcher.launch(spec("cuda:3", mounts=mounts, job="s-12ab:train:0"), SOCKET, {"OPENRLD_WORKER_TOKEN": "t0k"})
    [pod] = fake.created
    assert worker.device == "cuda:0"
    assert pod == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": worker.name,
            "namespace": NAMESPACE,
            "labels": {
                "app.kubernetes.io/name": "openrld-worker",
                "openrld.node": "gke-pool-1-abcd",
                "openrld.role": "trainer",
                "openrld.job": "s-12ab.train.0",
            },
            "annotations": {"openrld.job": "s-12ab:train:0", "openrld.worker": "trainer"},
        },
        "spec": {
            "nodeName": "gke-pool-1-abcd",
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsUser": 10001, "runAsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"},
                "runAsNonRoot": True,
            },
            "containers": [{
                "name": "worker",
                "image": "ghcr.io/acme/trainer:1",
                "imagePullPolicy": "IfNotPresent",
                "env": [
                    {"name": "OPENRLD_WORKER_TOKEN", "value": "t0k"},
                    {"name": "OPENRLD_WORKER_SOCKET", "value": f"{WORKER_SOCKET_DIR}/w-0123.sock"},
                    {"name": "OPENRLD_WORKER_IGNORE_SIGNALS", "value": "1"},
                ],
                "volumeMounts": [
                    {"name": "socket", "mountPath": f"{WORKER_SOCKET_DIR}/w-0123.sock", "readOnly": True},
                    {"name": "mount-0", "mountPath": "/var/lib/openrld/models/smollm2", "readOnly": True},
                    {"name": "mount-1", "mountPath": "/ckpt", "readOnly": False, "subPath": "run-1/state"},
                ],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
            "volumes": [
                {"name": "socket", "hostPath": {"path": SOCKET, "type": "Socket"}},
                {"name": "mount-0", "hostPath": {"path": "/var/lib/openrld/models/smollm2"}},
                {"name": "mount-1", "persistentVolumeClaim": {"claimName": "openrld-checkpoints", "readOnly": False}},
            ],
        },
    }


def test_the_pod_is_valid_for_kubernetes(fake, launcher):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    launcher.launch(spec("cuda:0", mounts=(Mount("/mnt/openrld-checkpoints/a", "/a"),)), SOCKET, {})
    kubernetes_validate.validate(fake.created[0], "1.33.0", strict=True)


def test_a_cpu_worker_asks_for_no_gpu(fake, launcher):
    worker = launcher.launch(spec("cpu"), SOCKET, {})
    assert (worker.device, "resources" in fake.created[0]["spec"]["containers"][0]) == ("cpu", False)


def test_a_path_on_no_shared_volume_is_refused(fake, launcher):
    with pytest.raises(ValueError, match=r"^/tmp/model is on no volume a worker Pod can share"):
        launcher.launch(spec(mounts=(Mount("/tmp/model", "/m"),)), SOCKET, {})
    assert fake.created == []


def test_a_socket_on_a_claim_is_refused(fake):
    launcher = PodLauncher(fake.api, NAMESPACE, "n", "n", (CHECKPOINTS,))
    with pytest.raises(ValueError, match="must be on a hostPath volume"):
        launcher.launch(spec(), "/mnt/openrld-checkpoints/w.sock", {})


def test_poll_is_none_until_the_container_terminates_then_its_exit_status(fake, launcher):
    worker = launcher.launch(spec(), SOCKET, {})
    seen = [worker.poll()]
    fake.set_status(worker.name, {"phase": "Running", "containerStatuses": [{"name": "worker", "state": {"running": {}}}]})
    seen.append(worker.poll())
    fake.set_status(worker.name, terminated(3, "Failed"))
    seen.append(worker.poll())
    assert seen == [None, None, 3]


def test_poll_ends_a_pod_whose_image_cannot_be_pulled(fake, launcher):
    worker = launcher.launch(spec(), SOCKET, {})
    fake.set_status(worker.name, {"phase": "Pending", "containerStatuses": [
        {"name": "worker", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}]})
    assert worker.poll() == -1


def test_stop_deletes_with_the_timeout_as_grace_and_waits_until_the_pod_is_gone(fake, launcher):
    worker = launcher.launch(spec(), SOCKET, {})
    fake.set_status(worker.name, terminated(0, "Succeeded"))
    fake.reads_after_delete[worker.name] = 2  # still terminating at the first two reads
    worker.stop(4.2)
    assert (fake.deletes, fake.pods, worker.poll()) == ([(worker.name, 5)], {}, 0)


def test_reap_deletes_this_nodes_pods_at_once_and_leaves_others(fake, launcher):
    other = PodLauncher(fake.api, NAMESPACE, "gke-pool-1-other", "gke-pool-1-other", (DATA,))
    mine = [launcher.launch(spec(), SOCKET, {}).name for _ in range(2)]
    theirs = other.launch(spec(), SOCKET, {}).name
    assert launcher.reap() == 2
    assert sorted(fake.deletes) == sorted((name, 0) for name in mine)
    assert theirs in fake.pods


def test_an_api_refusal_is_an_error_naming_the_request_and_the_servers_message(fake, launcher):
    fake.refuse_create = (403, 'pods is forbidden: User "system:serviceaccount:openrld:openrld" cannot create resource')
    with pytest.raises(PodLaunchError) as raised:
        launcher.launch(spec(), SOCKET, {})
    assert str(raised.value).startswith("Kubernetes API: create Pod openrld-worker-")
    assert str(raised.value).endswith(
        ' failed (403): pods is forbidden: User "system:serviceaccount:openrld:openrld" cannot create resource'
    )


def test_a_worker_pod_that_never_connects_is_lost_after_hello_s_and_deleted(fake, socket_root):
    # The daemon's socket directory on a hostPath volume, as [workers] socket_dir puts it in config/k8s.
    launcher = PodLauncher(fake.api, NAMESPACE, "n", "n", (PodVolume(str(socket_root), host_path="/var/lib/openrld/workers"),))
    with pytest.raises(EngineLost) as lost:
        start_worker(launcher, spec(), socket_directory(socket_root), timeouts=WorkerTimeouts(hello_s=1.0))
    assert str(lost.value) == "trainer did not connect within 1 s; it was stopped"
    [pod] = fake.created
    assert pod["spec"]["volumes"][0]["hostPath"]["path"].startswith("/var/lib/openrld/workers/openrld-")
    assert (fake.deletes, fake.pods) == ([(pod["metadata"]["name"], 0)], {})


def test_the_daemonsets_shareable_volumes_are_the_data_dir_and_the_checkpoint_claim():
    daemonset = next(d for d in yaml.safe_load_all((REPO / "config" / "k8s" / "daemonset.yaml").read_text()) if d)
    assert volumes_of_pod(daemonset["spec"]["template"]) == (DATA, CHECKPOINTS)
