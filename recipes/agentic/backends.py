"""Which sandbox backend this machine has: agent-sandbox inside a GKE cluster, else bubblewrap.

`pick_backend` returns the backend's name with a documents -> Sandbox factory, and
the recipe logs the name. In a pod with a service account (the training Job in
`config/k8s/agentic/`) it is agent-sandbox; on a Linux node with bubblewrap that
can make its namespaces it is bwrap; otherwise it raises `NoSandbox`, naming both, rather
than run the model's actions unconfined.
"""

from __future__ import annotations

from recipes.agentic.env import SandboxFactory
from recipes.agentic.gke_sandbox import in_cluster_factory
from recipes.agentic.sandbox import BwrapSandbox, SandboxLimits, bwrap_works

BACKENDS = ("auto", "agent-sandbox", "bwrap")


class NoSandbox(RuntimeError):
    """The backend asked for cannot run here; the message says what would."""


def pick_backend(choice: str = "auto", limits: SandboxLimits = SandboxLimits()) -> tuple[str, SandboxFactory]:
    """(backend name, factory) for `choice`: "auto" takes agent-sandbox in a cluster, else bwrap."""
    if choice not in BACKENDS:
        raise ValueError(f"sandbox backend {choice!r} is not one of {BACKENDS}")
    if choice in ("auto", "agent-sandbox"):
        factory = in_cluster_factory(limits=limits)
        if factory is not None:
            return "agent-sandbox", factory
        if choice == "agent-sandbox":
            raise NoSandbox("agent-sandbox needs a Kubernetes service account (run as the Job in config/k8s/agentic/)")
    if bwrap_works():
        return "bwrap", lambda documents: BwrapSandbox(documents, limits)
    raise NoSandbox("no sandbox: install bubblewrap (apt-get install bubblewrap) or run in the GKE Job")
