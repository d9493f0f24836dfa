"""The torchrun launcher: several ranks behind one worker endpoint, for a multi-GPU engine.

It runs `<python> -m torch.distributed.run --standalone --nnodes 1
--nproc-per-node <nproc> <command...>` (`--standalone`: a rendezvous on this
host, on a free port), in a session of its own. Each rank runs the worker
program; rank 0 speaks for the group (`openrld/worker/ranks.py`). The ranks get
the environment the process launcher gives a worker (the socket, the token, the
role, OPENRLD_WORKER_IGNORE_SIGNALS, its malloc settings) plus torchrun's own
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...).

Devices: a group's `Start.device` names one device per rank, as a comma list in
rank order: "cuda:2,3" for two ranks on this node's GPUs 2 and 3, or "cpu" for a
CPU group (any number of ranks). The group sees only its own GPUs
(CUDA_VISIBLE_DEVICES=2,3) and the device it is told is "cuda:0,1"; rank r
builds its engine on the r-th, cuda:LOCAL_RANK. A list whose length is not
`nproc` is refused at launch.

A lost rank fails the whole group: torchrun sees it, stops the other ranks
(SIGTERM, which a rank honours) and exits non-zero, and the daemon sees rank 0's
connection end. `poll` is torchrun's exit status. `stop` waits for torchrun to
exit by itself (after Bye), then sends SIGTERM to its process group (torchrun
stops its ranks), then past `TERM_GRACE_S` SIGKILL to torchrun and to each rank
(torchrun starts every rank in a session of its own, so one signal to a group
cannot reach them all); a rank also dies with torchrun (PR_SET_PDEATHSIG). It
returns once torchrun is reaped and no rank runs.

Over several nodes (`SpanRendezvous`, a trainer wider than any node): each node's
daemon runs one torchrun for its own ranks, `--nnodes K --rdzv-backend c10d
--rdzv-endpoint HOME:PORT --rdzv-id <job>`; the home node's hosts the rendezvous
(`is_host=1`), the members' join it. The home's ranks get the socket, as on one
node; a member's get no socket and no token (`member_command`): they follow
global rank 0, which is the home's (`worker/ranks.py` renumbers them). The ports
the ranks use besides the rendezvous (torchrun's store, gloo's and NCCL's
connections) are ephemeral: docs/deploy.md says what to open. A node cut off
from the others leaves a span's Bye and torchrun's own SIGTERM handling (which
closes the rendezvous) waiting on the network, so a span's group waits at most
`SPAN_BYE_S` for its Bye, and a member whose home is gone `kill`s its ranks at once.

Why by hand: torchrun has no API for its process tree, and /proc/<pid>/task/*/children
needs a kernel option that not every kernel has; the ranks are found by their
parent pid in /proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from openrld.worker.launchers import LaunchedWorker, WorkerSpec
from openrld.worker.launchers.process import _MALLOC  # the same working-set settings, for the same reason
from openrld.worker.launchers.visible_devices import worker_visible_devices

logger = logging.getLogger(__name__)

SPAN_HOME_ENV = "OPENRLD_SPAN_HOME"  # "1" on the home node's ranks, "0" on a member's; unset: one node
SPAN_DEVICE_ENV = "OPENRLD_SPAN_DEVICE"  # a member node's ranks: their group device, as rank 0's Start names its own
SPAN_MODEL_DIR_ENV = "OPENRLD_SPAN_MODEL_DIR"  # a member node's ranks: the model's directory on that node
TERM_GRACE_S = 5.0  # after SIGTERM: torchrun stops its ranks (a second at most here), then exits
# A span's group after Bye: its ranks pass it on over the network, which takes milliseconds, or,
# with a node cut off, forever (gloo has no peer to answer); past this, SIGTERM.
SPAN_BYE_S = 2.0


def group_devices(device: str, nproc: int, inherited: str | None = None) -> tuple[str, str | None]:
    """(the group's device as its ranks see it, CUDA_VISIBLE_DEVICES or None) for a Start.device,
    the daemon's own CUDA_VISIBLE_DEVICES being `inherited` (`visible_devices`).

    Raises:
        ValueError: a device list whose length is not `nproc`.
    """
    kind, _, indices = device.partition(":")
    if kind != "cuda" or not indices:
        return device, None
    listed = indices.split(",")
    if len(listed) != nproc:
        raise ValueError(f"a torchrun group of {nproc} ranks was given {len(listed)} device(s): {device!r}")
    return "cuda:" + ",".join(str(i) for i in range(nproc)), worker_visible_devices(listed, inherited)


class SpanRendezvous(msgspec.Struct, frozen=True):
    """Where one node's torchrun meets the others of a group that spans nodes."""

    nodes: int  # torchrun agents, one per node
    endpoint: str  # "host:port": the home node's rendezvous (c10d, hosted by the home's torchrun)
    run_id: str  # the job's id: one rendezvous per job
    is_home: bool  # this node hosts the rendezvous and global rank 0
    local_addr: str  # the address the other nodes reach this one at (torchrun's --local-addr)
    join_timeout_s: float = 120.0  # how long the rendezvous waits for every node


def rendezvous_arguments(span: SpanRendezvous) -> list[str]:
    """torchrun's arguments for one node of a group that spans nodes (its --nproc-per-node aside)."""
    conf = f"is_host={int(span.is_home)},join_timeout={int(span.join_timeout_s)}"
    return [
        "--nnodes", str(span.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", span.endpoint,
        "--rdzv-id", span.run_id, "--rdzv-conf", conf, "--local-addr", span.local_addr, "--max-restarts", "0",
    ]


def member_command(python: str, span: SpanRendezvous, nproc: int, device: str, model_dir: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a member node's torchrun: `nproc` ranks that follow the home's rank 0, on
    `device` (this node's, as `group_devices` makes it for them), reading the model from `model_dir`."""
    own, visible = group_devices(device, nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
    env = {**_MALLOC, **os.environ, "OPENRLD_WORKER_ROLE": "trainer", "OPENRLD_WORKER_IGNORE_SIGNALS": "1"}
    env.update({"OPENRLD_WORKER_RANKS": "1", SPAN_HOME_ENV: "0", SPAN_DEVICE_ENV: own, SPAN_MODEL_DIR_ENV: model_dir})
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    arguments = [*rendezvous_arguments(span), "--nproc-per-node", str(nproc)]
    return [python, "-m", "torch.distributed.run", *arguments, "-m", "openrld.worker"], env


class TorchrunGroup:
    """A running torchrun and its ranks."""

    def __init__(
        self, process: subprocess.Popen, device: str, name: str, nproc: int, bye_s: float | None = None
    ) -> None:
        self.process = process
        self.device = device
        self.name = name
        self.nproc = nproc
        self.bye_s = bye_s  # a span's: the most `stop` waits for torchrun to exit by itself

    def poll(self) -> int | None:
        return self.process.poll()

    def rank_pids(self) -> list[int]:
        """The ranks torchrun runs now (its children)."""
        return _children(self.process.pid)

    def stop(self, timeout: float) -> None:
        if self.bye_s is not None:
            timeout = min(timeout, self.bye_s)
        try:
            self.process.wait(timeout)
            return  # torchrun ends only once its ranks have ended
        except subprocess.TimeoutExpired:
            pass
        ranks = _pidfds(self.rank_pids())  # taken while torchrun still holds them: no pid reuse
        try:
            if timeout > 0:
                logger.warning("worker %s did not stop in %.0f s; stopping its group", self.name, timeout)
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s: torchrun did not stop in %.0f s; killing the group", self.name, TERM_GRACE_S)
                self._kill(ranks)
            for fd in ranks:
                if not select.select([fd], [], [], TERM_GRACE_S)[0]:  # readable once the rank has ended
                    _pidfd_kill(fd)
                    select.select([fd], [], [], TERM_GRACE_S)
        finally:
            for fd in ranks:
                os.close(fd)

    def kill(self) -> None:
        """SIGKILL torchrun and every rank now, and return once all are gone: for ranks whose job is lost
        with a node, where torchrun's SIGTERM would wait on a rendezvous it cannot reach."""
        ranks = _pidfds(self.rank_pids())
        try:
            self._kill(ranks)
            for fd in ranks:
                select.select([fd], [], [], TERM_GRACE_S)  # readable once the rank has ended
        finally:
            for fd in ranks:
                os.close(fd)

    def _kill(self, ranks: list[int]) -> None:
        _signal_group(self.process.pid, signal.SIGKILL)
        for fd in ranks:
            _pidfd_kill(fd)
        self.process.wait()

    def describe(self) -> str:
        return f"torchrun pid {self.process.pid}, {self.nproc} ranks"


class TorchrunLauncher:
    def __init__(
        self, python: str = "", nproc: int = 2, command: tuple[str, ...] = ("-m", "openrld.worker"),
        span: SpanRendezvous | None = None,
    ) -> None:
        if nproc < 1:
            raise ValueError(f"a torchrun group needs at least 1 rank, not {nproc}")
        self.python = python or sys.executable
        self.nproc = nproc  # this node's ranks
        self.command = command
        self.span = span  # None: the group is on this node alone

    def launch(self, spec: WorkerSpec, socket_path: str, environment: dict[str, str]) -> LaunchedWorker:
        device, visible = group_devices(spec.start.device, self.nproc, os.environ.get("CUDA_VISIBLE_DEVICES"))
        env = {**_MALLOC, **os.environ, **environment}
        env["OPENRLD_WORKER_SOCKET"] = socket_path
        env["OPENRLD_WORKER_IGNORE_SIGNALS"] = "1"
        env["OPENRLD_WORKER_RANKS"] = "1"  # the ranks' marker: a stray WORLD_SIZE elsewhere means nothing
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible  # the group cannot take another's memory
        arguments = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(self.nproc), "--max-restarts", "0"]
        if self.span is not None:  # the home node of a group over several: its ranks come first (ranks.py)
            env[SPAN_HOME_ENV] = "1"
            arguments = [*rendezvous_arguments(self.span), "--nproc-per-node", str(self.nproc)]
        # A session of its own: a Ctrl-C at the daemon's terminal does not reach it, and stop() reaches
        # torchrun's whole process group. Its stdout is the daemon's stderr, as a worker process's is.
        process = subprocess.Popen(
            [self.python, "-m", "torch.distributed.run", *arguments, *self.command],
            stdin=subprocess.DEVNULL, stdout=2, env=env, start_new_session=True,
        )
        return TorchrunGroup(process, device, spec.name, self.nproc, bye_s=SPAN_BYE_S if self.span else None)

    def reap(self) -> int:
        return 0  # rank 0 exits when its daemon's end of the connection closes, and torchrun ends the rest


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(entry.name))
    return found


def _pidfds(pids: list[int]) -> list[int]:
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    return fds


def _pidfd_kill(fd: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(fd, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
