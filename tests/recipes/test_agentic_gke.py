"""The agent-sandbox backend against fakes of its two API edges, and the shape of its manifests.

No cluster here: `FakeCustomObjects` stands in for kubernetes' CustomObjectsApi (it
stores claims and turns one Ready after a set number of reads), and the exec edge is
either a recorder or a local subprocess, which runs the very command the pod would
run, so its limits and output cut are checked for real.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from recipes.agentic import gke_sandbox
from recipes.agentic.gke_sandbox import AgentSandbox, claim_manifest, ready_sandbox_name
from recipes.agentic.sandbox import SandboxLimits

yaml = pytest.importorskip("yaml", reason="PyYAML is a test dependency (pip install -e .[test])")

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "config" / "k8s" / "agentic"


class FakeCustomObjects:
    def __init__(self, ready_after_reads: int = 2, sandbox: str = "agentic-workspace-pool-x7k2p"):
        self.claims: dict[str, dict] = {}
        self.deleted: list[str] = []
        self.reads = 0
        self.ready_after_reads = ready_after_reads
        self.sandbox = sandbox

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, namespace, plural) == ("extensions.agents.x-k8s.io", "v1alpha1", "openrld",
                                                       "sandboxclaims")
        self.claims[body["metadata"]["name"]] = body
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.reads += 1
        claim = dict(self.claims[name])
        if self.reads >= self.ready_after_reads:
            claim["status"] = {"conditions": [{"type": "Ready", "status": "True"}], "sandbox": {"name": self.sandbox}}
        return claim

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.deleted.append(name)
        del self.claims[name]


class RecordingExec:
    def __init__(self, reply: tuple[int, bytes, bytes] = (0, b"", b"")):
        self.calls: list[tuple[str, str, list[str]]] = []
        self.reply = reply

    def __call__(self, pod, namespace, command):
        self.calls.append((pod, namespace, command))
        return self.reply


def _no_sleep(_seconds: float) -> None:
    pass


def test_a_claim_names_the_template_and_the_warm_pool():
    claim = claim_manifest("agentic-abc")
    assert claim["spec"] == {"sandboxTemplateRef": {"name": "agentic-workspace"}, "warmpool": "agentic-workspace-pool"}
    assert (claim["apiVersion"], claim["kind"]) == ("extensions.agents.x-k8s.io/v1alpha1", "SandboxClaim")


def test_a_claim_is_ready_only_with_a_true_ready_condition_and_a_sandbox_name():
    assert ready_sandbox_name({}) is None
    assert ready_sandbox_name({"status": {"conditions": [{"type": "Ready", "status": "False"}],
                                          "sandbox": {"name": "s"}}}) is None
    assert ready_sandbox_name({"status": {"conditions": [{"type": "Ready", "status": "True"}],
                                          "sandbox": {"name": "s"}}}) == "s"


def test_opening_claims_waits_for_ready_uploads_and_locks_the_documents():
    api, exec_fn = FakeCustomObjects(ready_after_reads=3), RecordingExec()
    box = AgentSandbox({"contract.txt": "terminates on 2027-07-22"}, custom_api=api, exec_fn=exec_fn, sleep=_no_sleep)
    assert api.reads == 3
    assert box.pod == "agentic-workspace-pool-x7k2p"
    [(pod, namespace, upload), (_, _, lock)] = exec_fn.calls
    assert (pod, namespace) == ("agentic-workspace-pool-x7k2p", "openrld")
    assert upload[:2] == ["sh", "-c"] and upload[-1] == "/workspace/contract.txt"
    assert "dGVybWluYXRlcyBvbiAyMDI3LTA3LTIy" in upload[2]  # the text, base64-encoded
    assert lock == ["chmod", "-R", "a-w", "/workspace"]


def test_close_deletes_the_claim():
    api = FakeCustomObjects(ready_after_reads=1)
    box = AgentSandbox({}, custom_api=api, exec_fn=RecordingExec(), sleep=_no_sleep)
    box.close()
    assert (api.deleted, api.claims) == ([box.claim_name], {})


def test_a_claim_never_ready_times_out_and_is_deleted():
    api = FakeCustomObjects(ready_after_reads=10**9)
    with pytest.raises(TimeoutError):
        AgentSandbox({}, custom_api=api, exec_fn=RecordingExec(), ready_timeout_s=2.0, poll_s=0.5, sleep=_no_sleep)
    assert (api.reads, len(api.deleted), api.claims) == (4, 1, {})


def test_exit_137_reads_as_killed_at_the_wall_time():
    box = AgentSandbox({}, custom_api=FakeCustomObjects(1), exec_fn=RecordingExec((137, b"", b"")), sleep=_no_sleep)
    result = box.run(["sleep", "30"])
    assert (result.exit_code, result.timed_out) == (-9, True)


needs_local_tools = pytest.mark.skipif(
    not all(shutil.which(p) for p in ("bash", "prlimit", "timeout", "base64", "head")),
    reason="needs bash, prlimit, timeout, base64 and head to run the pod's command locally",
)


def _local_exec(workspace: Path):
    """Runs the pod's command here, with /workspace standing for `workspace`."""

    def run(_pod, _namespace, command):
        command = [part.replace("/workspace", str(workspace)) for part in command]
        done = subprocess.run(command, capture_output=True, timeout=30)
        return done.returncode, done.stdout, done.stderr

    return run


@needs_local_tools
def test_the_pod_command_feeds_stdin_and_returns_output(tmp_path: Path):
    box = AgentSandbox({}, custom_api=FakeCustomObjects(1), exec_fn=_local_exec(tmp_path), sleep=_no_sleep)
    result = box.run(["cat"], stdin=b"2027-07-22\n")
    assert (result.exit_code, result.stdout, result.truncated) == (0, "2027-07-22\n", False)


@needs_local_tools
def test_the_pod_command_cuts_output_and_kills_at_the_wall_time(tmp_path: Path):
    limits = SandboxLimits(wall_s=0.5, max_output_bytes=100)
    box = AgentSandbox({}, custom_api=FakeCustomObjects(1), exec_fn=_local_exec(tmp_path), limits=limits,
                       sleep=_no_sleep)
    flood = box.run(["sh", "-c", "yes | head -c 100000"])
    assert (flood.truncated, len(flood.stdout)) == (True, 100)
    slow = box.run(["sleep", "30"])
    assert (slow.exit_code, slow.timed_out) == (-9, True)


def test_outside_a_cluster_there_is_no_agent_sandbox_factory():
    assert gke_sandbox.in_cluster_factory() is None


# --- manifests: config/k8s/agentic/ ---------------------------------------------------------


def _objects() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_the_directory_holds_the_template_the_pool_and_the_job_with_its_rbac():
    assert sorted(_objects()) == [
        ("Job", "openrld-agentic-train"), ("Role", "openrld-agentic"), ("RoleBinding", "openrld-agentic"),
        ("SandboxTemplate", "agentic-workspace"), ("SandboxWarmPool", "agentic-workspace-pool"),
        ("ServiceAccount", "openrld-agentic"),
    ]
    assert {doc["metadata"]["namespace"] for doc in _objects().values()} == {gke_sandbox.NAMESPACE}


def test_the_template_runs_gvisor_with_no_token_no_network_and_limits():
    template = _objects()[("SandboxTemplate", gke_sandbox.TEMPLATE_NAME)]
    assert template["apiVersion"] == "extensions.agents.x-k8s.io/v1alpha1"
    assert template["spec"]["networkPolicy"] == {"ingress": [], "egress": []}  # empty lists: deny all
    pod = template["spec"]["podTemplate"]["spec"]
    assert (pod["runtimeClassName"], pod["automountServiceAccountToken"]) == ("gvisor", False)
    [container] = pod["containers"]
    assert container["name"] == gke_sandbox.CONTAINER
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
    }
    assert set(container["resources"]["limits"]) == {"cpu", "memory", "ephemeral-storage"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/workspace": "workspace", "/scratch": "scratch", "/tmp": "tmp"}
    assert all("sizeLimit" in v["emptyDir"] for v in pod["volumes"])


def test_the_warm_pool_fills_from_the_template():
    pool = _objects()[("SandboxWarmPool", gke_sandbox.WARM_POOL_NAME)]
    assert pool["spec"]["sandboxTemplateRef"] == {"name": gke_sandbox.TEMPLATE_NAME}
    assert pool["spec"]["replicas"] >= 1


def test_the_job_runs_the_recipe_on_agent_sandbox_as_its_own_service_account():
    objects = _objects()
    job = objects[("Job", "openrld-agentic-train")]
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"][-2:] == ["-m", "recipes.agentic"]
    assert "--sandbox=agent-sandbox" in container["args"]
    assert (pod["serviceAccountName"], pod["restartPolicy"], job["spec"]["backoffLimit"]) == (
        "openrld-agentic", "Never", 0)
    binding = objects[("RoleBinding", "openrld-agentic")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "openrld-agentic", "namespace": "openrld"}]


def test_the_job_may_only_claim_sandboxes_and_exec_into_pods():
    rules = _objects()[("Role", "openrld-agentic")]["rules"]
    assert rules == [
        {"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
         "verbs": ["create", "get", "delete"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
    ]


def test_the_core_objects_and_the_sandbox_pod_are_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    objects = _objects()
    core = [doc for (kind, _), doc in objects.items() if not kind.startswith("Sandbox")]
    # The template's pod is a core Pod spec inside a CRD: checked as a Pod.
    template_pod = objects[("SandboxTemplate", gke_sandbox.TEMPLATE_NAME)]["spec"]["podTemplate"]
    core.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sandbox", **template_pod["metadata"]},
                 "spec": template_pod["spec"]})
    for doc in core:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
