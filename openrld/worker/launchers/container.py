"""The container launcher: a worker in a container image, run by podman or docker on a VM.

A custom trainer or sampler image (`openrl.trainer_backend=<image>`) is code the
operator did not write, so its container gets as little as the protocol needs:
- no network (`--network none`): it talks to the daemon over a Unix socket;
- its own socket, and nothing else of the daemon's socket directory. The socket
  file alone is bind-mounted (read-only: connecting needs no write to the mount),
  at `WORKER_SOCKET_DIR`/<name>, since the directory also holds the pending
  listeners of other jobs' workers, which an image could race to connect to;
- the model and checkpoint directories the spec names (read-only where it says);
- the job's one device: CDI `nvidia.com/gpu=N` under podman (the NVIDIA container
  toolkit's `nvidia-ctk cdi generate` must have written the node's CDI spec), and
  `--gpus device=N` under docker; the worker sees it as cuda:0;
- the daemon's uid and gid (`--user`, and `--userns keep-id` under rootless
  podman), so that it can reach the socket (0660 in a 0700 directory) and the
  files it writes into a checkpoint belong to the daemon, which commits them;
- no capabilities and no privilege escalation.

The image's own entrypoint runs; the launcher passes only environment variables
(the socket, the token, the role). They go as `-e NAME`, the value taken from the
runtime command's environment, so that the token is not on a command line.

`OPENRLD_WORKER_IGNORE_SIGNALS=1` makes the worker ignore SIGTERM, as a process
worker does: `stop -t N` then means what `LaunchedWorker.stop` says (N seconds to
finish the call in hand after Bye, then SIGKILL) whatever the image's entrypoint
does with signals, and a worker that is PID 1 behaves as one that is not.

The container is not run with `--rm`: its exit status is read with `inspect`
after it ends, and `stop` removes it. Every container carries the labels
`openrld.node`, `openrld.role` and `openrld.job`; `reap` removes every container
of this node's, which is how a restarted daemon clears what an earlier one left.

Global options of the runtime (podman's `--runtime`, `--cgroup-manager`,
`--root`) go before the subcommand, on every call, not only on `run`: podman
stops and removes a container through the same OCI runtime it ran it with. They
are `global_args`; `run_args` go to `run` alone (extra mounts, `--shm-size`).
Why by hand: the runtimes' Python clients talk to a socket API that podman serves
only as a separate service; the CLI is what every host with a runtime has.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import subprocess
from pathlib import Path
from typing import Literal

from openrld.errors import ServerError
from openrld.worker.launchers import WORKER_SOCKET_DIR, LaunchedWorker, Mount, WorkerSpec
from openrld.worker.launchers.remote import RemoteWorker
from openrld.worker.launchers.visible_devices import worker_visible_devices

logger = logging.getLogger(__name__)

Runtime = Literal["podman", "docker"]

# A first run pulls the image, gigabytes for one with torch in it; the daemon's wait for the
# hello starts after the run returns.
RUN_S = 900.0
# inspect, ps, logs and rm answer from the runtime's local state.
QUERY_S = 60.0
# `stop -t N` takes up to N seconds by itself; this much more for the runtime's own work.
STOP_MARGIN_S = 60.0
LOG_TAIL_LINES = 40  # of a worker that ended on its own with a failure, into the daemon's log
_ENDED = ("exited", "stopped", "dead")


class ContainerRuntimeError(ServerError):
    """The container runtime is missing, failed or did not answer in time."""


class ContainerLauncher:
    def __init__(
        self, runtime: Runtime, node: str, run_args: tuple[str, ...] = (), *, global_args: tuple[str, ...] = (),
    ) -> None:
        if runtime not in ("podman", "docker"):
            raise ValueError(f"container runtime must be 'podman' or 'docker', got {runtime!r}")
        self.runtime = runtime
        self.node = node  # this daemon's node name: the label `reap` looks for
        self.run_args = run_args
        self.global_args = global_args

    def launch(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str]) -> LaunchedWorker:
        if spec.image is None:
            raise ValueError(f"{spec.name}: the container launcher runs images, and this spec names none")
        name = f"openrld-worker-{secrets.token_hex(6)}"
        inside = f"{WORKER_SOCKET_DIR}/{Path(socket_path).name}"
        worker_env = {**environment, "OPENRLD_WORKER_SOCKET": inside, "OPENRLD_WORKER_IGNORE_SIGNALS": "1"}
        device_args, device = self._devices(spec.start.device)
        argv = [
            "run", "--detach", "--name", name,
            "--label", f"openrld.node={self.node}",
            "--label", f"openrld.role={spec.role}",
            "--label", f"openrld.job={spec.job or ''}",
            "--network", "none",
            *self._user_args(),
            "--cap-drop", "all", "--security-opt", "no-new-privileges",
            "--volume", _volume(Mount(socket_path, inside, read_only=True)),
            *(arg for mount in spec.mounts for arg in ("--volume", _volume(mount))),
            *(arg for variable in worker_env for arg in ("--env", variable)),
            *device_args,
            *self.run_args,
            spec.image,
        ]
        try:
            self._call(argv, RUN_S, env={**os.environ, **worker_env})
        except ContainerRuntimeError as error:
            # A run that created the container and failed to start it leaves it behind. The
            # run's error is the one to report, whatever the removal says.
            try:
                self._call(self._remove_argv([name]), QUERY_S, missing_ok=True)
            except ContainerRuntimeError as removal:
                logger.warning("after %s: %s", error, removal)
            raise
        logger.info("worker %s runs in container %s (image %s)", spec.name, name, spec.image)
        return Container(self, name, device, spec.name)

    def reap(self) -> int:
        listed = self._call(
            ["ps", "--all", "--filter", f"label=openrld.node={self.node}", "--format", "{{.Names}}"], QUERY_S
        )
        names = listed.stdout.split()
        if names:
            logger.warning("removing %d worker container(s) an earlier daemon left: %s", len(names), " ".join(names))
            self._call(self._remove_argv(names), QUERY_S, missing_ok=True)
        return len(names)

    # ------------------------------------------------------------------ the runtime

    def _devices(self, device: str) -> tuple[list[str], str]:
        if device == "cpu":
            return [], "cpu"
        kind, _, index = device.partition(":")
        if kind != "cuda" or not (index or "0").isdigit():
            raise ValueError(f"a container worker takes 'cpu' or 'cuda:N', got {device!r}")
        # The node's name for the daemon's cuda:N (an index or a UUID, both of which CDI and
        # docker's --gpus take), not N itself when the daemon sees a slice of the node.
        gpu = worker_visible_devices([index or "0"], os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self.runtime == "podman":
            return ["--device", f"nvidia.com/gpu={gpu}"], "cuda:0"
        return ["--gpus", f"device={gpu}"], "cuda:0"

    def _user_args(self) -> list[str]:
        user = ["--user", f"{os.getuid()}:{os.getgid()}"]
        if self.runtime == "podman" and os.geteuid() != 0:
            # Rootless: the container's ids map to subordinate ones unless keep-id maps ours to ours.
            return ["--userns", "keep-id", *user]
        return user

    def _remove_argv(self, names: list[str]) -> list[str]:
        # podman's rm -f stops with a 10 s grace first; docker's kills at once and has no -t.
        return ["rm", "--force", *(["--time", "0"] if self.runtime == "podman" else []), *names]

    def _call(
        self, argv: list[str], seconds: float, *, env: dict[str, str] | None = None, missing_ok: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run `<runtime> <global args> <argv>`. `missing_ok`: a container that is not
        there (already removed) is no failure."""
        command = [self.runtime, *self.global_args, *argv]
        what = f"{self.runtime} {argv[0]}"
        try:
            done = subprocess.run(
                command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=seconds, env=env,
            )
        except FileNotFoundError:
            raise ContainerRuntimeError(
                f"{what}: the container runtime {self.runtime!r} is not installed here (not on PATH); install it "
                "or configure the node's workers.container_runtime"
            ) from None
        except subprocess.TimeoutExpired:
            raise ContainerRuntimeError(f"{what} did not finish in {seconds:.0f} s") from None
        if done.returncode != 0:
            if missing_ok and _is_missing(done.stderr):
                return done
            detail = done.stderr.strip().splitlines()[-1:] or ["(no message)"]
            raise ContainerRuntimeError(f"{what} failed (exit status {done.returncode}): {detail[0]}")
        return done


class Container(RemoteWorker):
    """One worker's container, as `start_worker` and `WorkerConnection` watch and stop it."""

    def __init__(self, launcher: ContainerLauncher, name: str, device: str, worker: str) -> None:
        super().__init__(name, device, worker)
        self.launcher = launcher

    def _ask_status(self) -> int | None:
        try:
            state = self.launcher._call(
                ["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.name], QUERY_S
            ).stdout
        except ContainerRuntimeError as error:
            if not _is_missing(str(error)):
                raise
            return self._gone()  # removed by someone else
        status, _, code = state.strip().partition(" ")
        return int(code) if status in _ENDED else None

    def stop(self, timeout: float) -> None:
        if self._removed:
            return
        if self.poll() not in (None, 0):
            self._log_tail()
        seconds = math.ceil(max(timeout, 0.0))
        self.launcher._call(["stop", "--time", str(seconds), self.name], seconds + STOP_MARGIN_S, missing_ok=True)
        self.poll()
        self.launcher._call(self.launcher._remove_argv([self.name]), QUERY_S, missing_ok=True)
        self._removed = True

    def describe(self) -> str:
        return f"container {self.name}"

    def _log_tail(self) -> None:
        """A worker that failed on its own: its last lines, since its output is not the daemon's."""
        try:
            done = self.launcher._call(["logs", "--tail", str(LOG_TAIL_LINES), self.name], QUERY_S)
            tail = done.stdout + done.stderr  # the container's stdout and stderr, as the runtime replays them
        except ContainerRuntimeError as error:
            tail = f"(its log could not be read: {error})"
        logger.warning("worker %s: container %s ended with status %s; its last lines:\n%s",
                       self.worker, self.name, self._status, tail.rstrip())


def _volume(mount: Mount) -> str:
    for path in (mount.source, mount.target):
        if ":" in path or "," in path or not path.startswith("/"):
            raise ValueError(f"cannot bind-mount {path!r} into a container: an absolute path without ':' or ','")
    return f"{mount.source}:{mount.target}" + (":ro" if mount.read_only else "")


def _is_missing(message: str) -> bool:
    """podman says 'no such container' / 'no such object', docker 'No such container'."""
    return "no such" in message.lower() or "no container with" in message.lower()
