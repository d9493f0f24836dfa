"""The GKE backend: kubernetes-sigs/agent-sandbox, gVisor pods taken from a warm pool.

An `AgentSandbox` claims one sandbox per episode: it creates a `SandboxClaim`
(extensions.agents.x-k8s.io/v1alpha1) naming the `SandboxTemplate` in
`config/k8s/agentic/` (runtimeClassName gvisor), which the controller fills from
the `SandboxWarmPool` when a warm pod is free; it waits for the claim's Ready
condition, takes the sandbox's name from the claim's status (the sandbox's pod
has that name), uploads the documents into `/workspace`, makes them read-only,
and then runs each command through the pod's exec API under the same `timeout`
and `prlimit` limits as the bubblewrap backend. `close` deletes the claim, which
returns the pod to the controller.

Nothing here runs on a development machine: it needs a cluster with the
agent-sandbox controller. The tests drive it through fakes of the two API edges
it uses (`CustomObjectsApi` and the exec call), which is also why both are
constructor arguments.
"""

from __future__ import annotations

import base64
import logging
import shlex
import time
import uuid
from collections.abc import Callable

from recipes.agentic.sandbox import WORKSPACE, CommandResult, SandboxLimits

logger = logging.getLogger(__name__)

GROUP = "extensions.agents.x-k8s.io"
VERSION = "v1alpha1"
CLAIMS = "sandboxclaims"
TEMPLATE_NAME = "agentic-workspace"  # config/k8s/agentic/sandbox-template.yaml
WARM_POOL_NAME = "agentic-workspace-pool"  # config/k8s/agentic/sandbox-warmpool.yaml
NAMESPACE = "openrld"
CONTAINER = "workspace"
# (pod name, namespace, command) -> (exit code, stdout, stderr). No stdin: the exec API's
# half-close of stdin differs across protocol versions, so input travels in the command, base64-encoded.
ExecFn = Callable[[str, str, list[str]], tuple[int, bytes, bytes]]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def claim_manifest(name: str, *, template: str = TEMPLATE_NAME, warm_pool: str = WARM_POOL_NAME) -> dict:
    """The SandboxClaim for one episode."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SandboxClaim",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "openrld-agentic"}},
        "spec": {"sandboxTemplateRef": {"name": template}, "warmpool": warm_pool},
    }


def ready_sandbox_name(claim: dict) -> str | None:
    """The claimed sandbox's name once the claim is Ready, else None."""
    status = claim.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return (status.get("sandbox") or {}).get("name") if ready else None


def pod_exec(core_api, pod: str, namespace: str, command: list[str]) -> tuple[int, bytes, bytes]:
    """Run `command` in the pod's workspace container through the exec API (kubernetes.stream)."""
    from kubernetes.stream import stream

    client = stream(
        core_api.connect_get_namespaced_pod_exec, pod, namespace, container=CONTAINER, command=command,
        stdin=False, stdout=True, stderr=True, tty=False, _preload_content=False, binary=True,
    )
    client.run_forever()
    stdout, stderr = client.read_stdout() or b"", client.read_stderr() or b""
    return client.returncode or 0, stdout, stderr


class AgentSandbox:
    """One episode's sandbox on GKE: a claimed agent-sandbox pod.

    Args:
        documents: path inside the workspace -> text.
        custom_api: a `kubernetes.client.CustomObjectsApi` (or a fake).
        exec_fn: runs a command in a pod (`pod_exec` bound to a CoreV1Api, or a fake).
        limits: per-command limits, enforced in the pod with timeout and prlimit.
        ready_timeout_s: how long to wait for the claim (a warm pool answers in about a second).
    """

    backend = "agent-sandbox"

    def __init__(
        self, documents: dict[str, str], *, custom_api, exec_fn: ExecFn, limits: SandboxLimits = SandboxLimits(),
        namespace: str = NAMESPACE, ready_timeout_s: float = 60.0, poll_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.custom_api = custom_api
        self.exec_fn = exec_fn
        self.limits = limits
        self.namespace = namespace
        self.claim_name = f"agentic-{uuid.uuid4().hex[:12]}"
        custom_api.create_namespaced_custom_object(GROUP, VERSION, namespace, CLAIMS, claim_manifest(self.claim_name))
        try:
            self.pod = self._wait_ready(ready_timeout_s, poll_s, sleep)
            self._upload(documents)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float, poll_s: float, sleep: Callable[[float], None]) -> str:
        for _ in range(max(1, int(timeout_s / poll_s))):
            claim = self.custom_api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, CLAIMS, self.claim_name)
            name = ready_sandbox_name(claim)
            if name is not None:
                logger.info("claim=%s sandbox=%s ready", self.claim_name, name)
                return name
            sleep(poll_s)
        raise TimeoutError(f"sandbox claim {self.claim_name} not ready after {timeout_s:.0f} s")

    def _upload(self, documents: dict[str, str]) -> None:
        for relative, text in documents.items():
            target = f"{WORKSPACE}/{relative}"
            write = f'mkdir -p -- "$(dirname -- "$1")" && echo {_b64(text.encode())} | base64 -d > "$1"'
            code, _, err = self.exec_fn(self.pod, self.namespace, ["sh", "-c", write, "sh", target])
            if code != 0:
                raise RuntimeError(f"upload of {relative} to {self.pod} failed: {err[-200:]!r}")
        self.exec_fn(self.pod, self.namespace, ["chmod", "-R", "a-w", WORKSPACE])

    def wrapped(self, argv: list[str], stdin: bytes = b"") -> list[str]:
        """`argv` under the limits, as the pod runs it (gVisor is the isolation; these bound the work)."""
        limits = self.limits
        limited = [
            "prlimit", f"--as={limits.memory_bytes}", f"--nproc={limits.max_processes}", f"--cpu={limits.cpu_s}",
            f"--fsize={limits.max_file_bytes}", "--", *argv,
        ]
        # Output is cut in the pod too, so a flood never crosses the API.
        cap = limits.max_output_bytes + 1
        feed = f"echo {_b64(stdin)} | base64 -d" if stdin else "true"
        script = (f"cd {WORKSPACE} && {feed} | timeout -s KILL {limits.wall_s:g} {shlex.join(limited)} "
                  f"> >(head -c {cap}) 2> >(head -c {cap} >&2)")
        return ["bash", "-c", script]

    def run(self, argv: list[str], stdin: bytes = b"") -> CommandResult:
        code, out, err = self.exec_fn(self.pod, self.namespace, self.wrapped(argv, stdin))
        limit = self.limits.max_output_bytes
        return CommandResult(
            exit_code=-9 if code == 137 else code, stdout=out[:limit].decode("utf-8", "replace"),
            stderr=err[:limit].decode("utf-8", "replace"), timed_out=code == 137,
            truncated=len(out) > limit or len(err) > limit,
        )

    def close(self) -> None:
        try:
            self.custom_api.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, CLAIMS, self.claim_name)
        except Exception as error:  # the controller reaps claims past their TTL anyway
            logger.warning("claim=%s delete failed: %s", self.claim_name, error)


def in_cluster_factory(namespace: str = NAMESPACE, limits: SandboxLimits = SandboxLimits()):
    """A documents -> AgentSandbox factory from the pod's service account, or None outside a cluster."""
    try:
        from kubernetes import client, config

        config.load_incluster_config()
    except Exception:
        return None
    custom, core = client.CustomObjectsApi(), client.CoreV1Api()

    def exec_fn(pod: str, ns: str, command: list[str]) -> tuple[int, bytes, bytes]:
        return pod_exec(core, pod, ns, command)

    return lambda documents: AgentSandbox(documents, custom_api=custom, exec_fn=exec_fn, limits=limits,
                                          namespace=namespace)
