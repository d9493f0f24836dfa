"""Which launcher hosts each engine, and the one call that starts a worker for it.

The daemon builds one `WorkerHosting` from its `[workers]` config and hands it to
the engine factory (`engines.py`). The factory asks it for a trainer or a
sampler of a kind; `None` from `launcher_for` means inproc (the engine in the
daemon's own worker thread), anything else a worker, started here and returned
as a `RemoteTrainer` or `RemoteSampler`:
- the built-in engines run where `[workers] launcher` says;
- the vLLM samplers (LoRA, and a full fine-tuning job's) run in the vLLM environment when
  `vllm_python` names one;
- a job's image runs through the container runtime, after the allow-list said yes;
- an engine on several devices (`nproc` > 1) runs as a torchrun group of that many
  ranks (`launchers/torchrun.py`), in the built-in process launcher's Python
  environment, else the daemon's; `start` gets the devices as one comma list,
  device="cuda:2,3";
- the Automodel trainer (openrl.trainer_backend=automodel) always runs as a torchrun
  group, of openrl.trainer_gpus ranks (one too: its FSDP2 setup wants a process group),
  in the Automodel environment that `automodel_python` names (`automodel_launcher`).

It owns the private socket directory (made at start, removed at close) and reaps,
at start, the containers or Pods an earlier daemon of this node left.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

from openrld.errors import ServerError
from openrld.worker.client import RemoteSampler, RemoteTrainer, WorkerTimeouts
from openrld.worker.launchers import Launcher, Mount, WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.launchers.torchrun import (
    SPAN_BYE_S,
    SPAN_DEVICE_ENV,
    SpanRendezvous,
    TorchrunGroup,
    TorchrunLauncher,
    member_command,
)
from openrld.worker.protocol import Role, Scalar, Start

logger = logging.getLogger(__name__)


class WorkerHosting:
    def __init__(
        self, *, builtin: Launcher | None = None, vllm: Launcher | None = None, images: Launcher | None = None,
        automodel_python: str = "", socket_root: Path | None = None, timeouts: WorkerTimeouts = WorkerTimeouts(),
        mounts: tuple[Mount, ...] = (),
    ) -> None:
        self.builtin = builtin  # None: the built-in engines run inproc
        self.vllm = vllm  # None: the vLLM sampler (if any) runs inproc
        self.images = images  # None: this node runs no images
        self.automodel_python = automodel_python  # "": this node runs no Automodel trainer
        self.timeouts = timeouts
        self.mounts = mounts  # what every worker sees besides its model: the checkpoint root
        self.socket_root = socket_root
        self.directory = socket_directory(socket_root) if (builtin or vllm or images) else None

    @classmethod
    def inproc(cls) -> WorkerHosting:
        return cls()

    def reap(self) -> int:
        """Stop what an earlier daemon of this node left running (containers, Pods)."""
        found = self.images.reap() if self.images is not None else 0
        if found:
            logger.warning("reaped %d worker(s) an earlier daemon of this node left running", found)
        return found

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def launcher_for(self, kind: str, image: str | None = None, *, nproc: int = 1) -> Launcher | None:
        """None (inproc) or the launcher of a worker for `kind`; `nproc` > 1: a torchrun group."""
        if nproc > 1:
            if image is not None:
                raise ServerError(f"image {image}: an image runs on one device; a torchrun group runs built-in engines")
            python = self.builtin.python if isinstance(self.builtin, ProcessLauncher) else ""
            return TorchrunLauncher(python, nproc)
        if image is not None:
            if self.images is None:
                raise ServerError(f"image {image}: this node runs no images ([workers] allowed_images is empty)")
            return self.images
        if kind in ("vllm_sampler", "vllm_full_sampler"):
            return self.vllm
        return self.builtin

    @property
    def has_automodel(self) -> bool:
        return bool(self.automodel_python)

    def automodel_launcher(self, nproc: int, span: SpanRendezvous | None = None) -> Launcher:
        """A torchrun group of `nproc` ranks in the Automodel environment; with `span`, this node's
        ranks of a group over several nodes, this node its home.

        Raises:
            ServerError: this node has no Automodel environment (jobs.py refuses such jobs first).
        """
        if not self.automodel_python:
            raise ServerError("this node has no Automodel environment: [workers] automodel_python is unset")
        return TorchrunLauncher(self.automodel_python, nproc, span=span)

    def member_ranks(self, span: SpanRendezvous, devices: tuple[str, ...], model_dir: str) -> TorchrunGroup:
        """A member node's ranks of another node's Automodel trainer (`actors/span_members.py`): one per
        device of `devices`, following the home's rank 0, in the Automodel environment.

        Raises:
            ServerError: this node has no Automodel environment.
        """
        if not self.automodel_python:
            raise ServerError("this node has no Automodel environment: [workers] automodel_python is unset")
        from openrld.gpu.devices import group_device

        argv, env = member_command(self.automodel_python, span, len(devices), group_device(devices), model_dir)
        # A session of its own, as the home's torchrun: stop() reaches its whole process group.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=2, env=env, start_new_session=True)
        name = f"openrld-trainer ranks of job {span.run_id}"
        return TorchrunGroup(process, env[SPAN_DEVICE_ENV], name, len(devices), bye_s=SPAN_BYE_S)

    def start(
        self, launcher: Launcher, *, role: Role, kind: str, model_name: str, model_dir: str, device: str,
        threads: int | None, options: dict[str, Scalar], image: str | None = None, job: str | None = None,
    ) -> Any:
        """A ready worker for one engine, as the engine interface of its role.

        `device` is one device, or a torchrun group's devices as one comma list ("cuda:2,3").
        """
        if self.directory is None:  # a torchrun group on a node whose engines otherwise run inproc
            self.directory = socket_directory(self.socket_root)
        name = f"openrld-{role} {model_name}" + (f" (job {job})" if job else "") + (f" [{image}]" if image else "")
        spec = WorkerSpec(
            name=name, role=role, start=Start(kind, model_dir, device, threads=threads, options=options),
            image=image, mounts=(Mount(model_dir, model_dir, read_only=True), *self.mounts), job=job,
        )
        connection, _ = start_worker(launcher, spec, self.directory, timeouts=self.timeouts)
        return RemoteTrainer(connection) if role == "trainer" else RemoteSampler(connection)
