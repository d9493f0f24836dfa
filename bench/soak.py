"""A bounded soak on loopback: 16 SDK clients training and sampling while 2,000 stalled connections are held.

One real daemon with the default config ([http] deadlines and caps as shipped), plus a
key file, so that a stalled request can come with a key the node does not know; the
tiny Llama. Phases:

1. idle: the 16 clients have made their LoRA jobs and run one iteration each (below),
   then wait. A lean client in a process of its own times a future that does no work
   (an `optim_step` with no gradient, then `retrieve_future`, on one kept-alive
   connection, as `future_latency.py` does) and, from a second thread on a
   connection of its own, the bare HTTP round trip (`GET /api/v1/healthz`); both
   paced PACE_S apart; then the round trip alone for IDLE_BARE_S. The daemon's fds
   (/proc/PID/fd) and RSS (VmRSS) are read.
2. load alone, LOAD_S: the 16 SDK clients (threads, one ServiceClient each) loop:
   forward_backward + optim_step on their own job, every SAVE_EVERY steps
   `save_weights_and_get_sampling_client`, and a sample from the latest sampler.
3. attack + load, ATTACK_S: `_stall.py`, a process of its own, also holds STALLED
   connections (silent; a head dripped a byte at a time; a whole head with
   Content-Length 1000000 and no body, with the node's key and with an unknown
   one), reopening each as the server closes it at its deadline. Then the clients
   stop, the attacker closes its sockets and exits, and the daemon must close its
   side of every one.
4. attack alone, ATTACK_ALONE_S: the same attack on the idle node, closed the same
   way; the lean client times only the bare round trip, which leaves nothing behind in
   the daemon. The allocator keeps what the first 2,000 connections took (RSS does not
   fall when they close), so the memory check is this round's RSS growth, spread over
   the connections it served, with no training and no futures to blur it.
5. after: fds and RSS again, and the lean client's timings once more.

Printed, all from this run: the lean client's p50 and p99 per phase as ratios to the
idle node's; the clients' steps per second under attack against load alone; each
process's CPU per phase, and what the rest of the machine took meanwhile (on a shared
machine the timings are only as good as that column is small); the daemon's fds and
RSS; the /metrics connection counters; and PASS/FAIL for
- no failed request: no SDK call raised, the SDK retried nothing (it logs its retries
  at debug level; they are counted here), and the daemon answered no SDK request with
  a status >= 400 (the attacker's refusals are counted apart);
- no connection left: after each attack, the daemon holds no socket whose peer is not
  a live client of this bench;
- fds back to baseline: the daemon's fds other than its live client connections (the
  SDK's pools connect and disconnect as they please) equal the idle baseline's.
It exits 1 if a check failed.

Run: `.venv/bin/python bench/soak.py` (about 3.5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KEY = "tml-soak"
CLIENTS = 16
STALLED = {"silent": 500, "slow_head": 500, "stalled_body": 500, "stalled_body_bad_key": 500}
SPREAD_S = 5.0  # the attacker opens its connections over this long, so their deadlines are spread too
LOAD_S, ATTACK_S, ATTACK_ALONE_S = 30.0, 60.0, 30.0
IDLE_ROUNDS, AFTER_ROUNDS = 1000, 500
IDLE_BARE_S = 10.0
PACE_S = 0.01  # the lean client starts a round at most this often, idle or loaded
BATCH, SEQ_LEN, SAVE_EVERY, SAMPLE_TOKENS = 4, 64, 5, 16
SETTLE_S = 30.0  # longest wait, after the attacker closes its sockets, for the daemon to close its side
# The daemon's fds other than client connections: the listener, the store's database files, pipes,
# the event loop's own. After the load stops none of them is in flight, and the baseline is read
# after every job has run a step, saved weights and sampled, so each lazily opened file is open
# then. A difference is a leak; the tolerance is 0.
FD_TOLERANCE = 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- the lean client, in a process of its own


class _Connection(http.client.HTTPConnection):
    """http.client writes head and body in two sends: without NODELAY the body waits on Nagle for the
    server's delayed ACK. Set on every connect, since the server closes a connection after
    keep_alive_max_requests and http.client then opens a new one by itself."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def probe(pipe, url: str) -> None:
    """Times the daemon for the bench, on commands from `pipe`: ("rounds", n), ("seconds", s) or ("bare", s).

    Answers (future, bare): seconds per no-work future round (n of them, or for s seconds; none
    for "bare"), and, from a second thread on a connection of its own over the same time,
    seconds per bare HTTP round trip (`GET /api/v1/healthz`). Both are paced PACE_S apart.
    A healthz leaves nothing behind in the daemon; a future is kept for a while and logged
    in its database, which "bare" avoids where the daemon's memory is being measured.
    """
    parsed = urlparse(url)
    headers = {"X-API-Key": KEY, "Content-Type": "application/json"}

    def caller(conn: _Connection):
        def call(method: str, path: str, body: dict | None = None) -> dict:
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            return json.loads(conn.getresponse().read())
        return call

    call = caller(_Connection(parsed.hostname, parsed.port))
    bare_call = caller(_Connection(parsed.hostname, parsed.port))
    session = call("POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "bench"})
    created = call(
        "POST", "/api/v1/create_model",
        {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
    )
    while call("POST", "/api/v1/retrieve_future", {"request_id": created["request_id"]}).get("type") == "try_again":
        pass
    model_id, seq = created["model_id"], 0

    def paced(times: list[float], start: float) -> None:
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        if elapsed < PACE_S:
            time.sleep(PACE_S - elapsed)

    pipe.send("ready")
    while (command := pipe.recv()) is not None:
        kind, amount = command
        future: list[float] = []
        bare: list[float] = []
        done = threading.Event()

        def bare_loop(done: threading.Event, bare: list[float]) -> None:
            while not done.is_set():
                start = time.perf_counter()
                bare_call("GET", "/api/v1/healthz")
                paced(bare, start)

        thread = threading.Thread(target=bare_loop, args=(done, bare))
        thread.start()
        end = time.monotonic() + amount if kind != "rounds" else math.inf
        if kind == "bare":
            time.sleep(amount)
        while (len(future) < amount) if kind == "rounds" else (kind == "seconds" and time.monotonic() < end):
            start = time.perf_counter()
            seq += 1
            submitted = call("POST", "/api/v1/optim_step", {"model_id": model_id, "seq_id": seq, "adam_params": {}})
            result = call("POST", "/api/v1/retrieve_future", {"request_id": submitted["request_id"]})
            assert "metrics" in result, result
            paced(future, start)
        done.set()
        thread.join()
        pipe.send((future, bare))


# ---------------------------------------------------------------- the daemon, seen from /proc and /metrics


def daemon_pid() -> int:
    """The `openrld serve` child of this process (bench/_daemon.py starts it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"openrld.cli\0serve" in cmdline:
            return int(entry.name)
    raise RuntimeError("no openrld serve child found")


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of a process's socket fds (none once it has exited)."""
    found = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _tcp_table() -> dict[int, tuple[str, str, str]]:
    """inode -> (local address, remote address, state) for every TCP socket in this network namespace."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            next(f)
            for line in f:
                fields = line.split()
                table[int(fields[9])] = (fields[1], fields[2], fields[3])
    return table


LISTEN = "0A"


def snapshot(pid: int, client_pids: list[int]) -> dict:
    """The daemon's fds, split into client connections, other connections and the rest; and its RSS."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    tcp = _tcp_table()
    ours = {tcp[i][0] for p in client_pids for i in _socket_inodes(p) if i in tcp}
    clients = others = 0
    states: Counter[str] = Counter()
    for inode in _socket_inodes(pid):
        if inode not in tcp or tcp[inode][2] == LISTEN:
            continue
        if tcp[inode][1] in ours:
            clients += 1
        else:
            others += 1
            states[tcp[inode][2]] += 1
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
    return {"fds": fds, "clients": clients, "others": others, "other_states": dict(states), "rss_mb": rss_kb / 1024}


def metrics(url: str) -> dict[str, float]:
    request = urllib.request.Request(url + "/metrics", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def error_answers(scraped: dict[str, float]) -> dict[str, int]:
    """Requests the daemon has answered with a status >= 400, by endpoint and status."""
    found = {}
    for name, value in scraped.items():
        match = re.match(r'openrld_http_requests_total\{endpoint="([^"]*)",method="[^"]*",status="(\d+)"\}', name)
        if match and int(match.group(2)) >= 400:
            found[f"{match.group(1)} {match.group(2)}"] = int(value)
    return found


# ---------------------------------------------------------------- the SDK clients


class RetryCounter(logging.Handler):
    """Counts the SDK's retries (logged at debug level) and keeps its warnings and errors."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retries = 0
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        template = str(record.msg)
        if template.startswith(("Retrying request to", "Retrying in")):
            self.retries += 1
        elif record.levelno >= logging.WARNING:
            self.messages.append(f"{record.name}: {record.getMessage()}")


class Client(threading.Thread):
    """One SDK client: its own ServiceClient and LoRA job; one warm-up iteration, then the loop once `go` is set."""

    def __init__(self, index: int, url: str, go: threading.Event, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.index, self.url, self.go, self.stop = index, url, go, stop
        self.ready = threading.Event()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def run(self) -> None:
        import tinker
        from tinker import types

        try:
            self.service = tinker.ServiceClient(base_url=self.url, api_key=KEY)
            training = self.service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=self.index).result()
            rows = [[(7 * i + 13 * j + self.index) % 370 + 5 for j in range(SEQ_LEN + 1)] for i in range(BATCH)]
            data = [
                types.Datum(model_input=types.ModelInput.from_ints(row[:-1]), loss_fn_inputs={"target_tokens": row[1:]})
                for row in rows
            ]
            prompt = types.ModelInput.from_ints(rows[0][:16])
            params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, stop=[])
            adam = types.AdamParams(learning_rate=1e-4)
            sampler = None
        except Exception as error:  # the bench counts it and goes on
            self.failures.append(f"setup: {type(error).__name__}: {error}")
            self.ready.set()
            return
        step = 0
        while not self.stop.is_set():
            try:
                backward, optim = training.forward_backward(data, "cross_entropy"), training.optim_step(adam)
                backward.result()
                optim.result()
                self.counts["steps"] += 1
                if sampler is None or step % SAVE_EVERY == 0:
                    sampler = training.save_weights_and_get_sampling_client().result()
                    self.counts["saves"] += 1
                result = sampler.sample(prompt, 1, params).result()
                assert len(result.sequences[0].tokens) == SAMPLE_TOKENS
                self.counts["samples"] += 1
            except Exception as error:
                self.failures.append(f"{type(error).__name__}: {error}")
            step += 1
            if not self.ready.is_set():
                self.ready.set()
                self.go.wait()

    def close(self) -> None:
        try:
            self.service.close("success").result()
        except Exception as error:
            self.failures.append(f"close: {type(error).__name__}: {error}")


# ---------------------------------------------------------------- the attacker


class Attacker:
    """`_stall.py` in a process of its own; its last report is kept."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115  # the child writes it; read at the end
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_stall.py"), parsed.hostname, str(parsed.port), KEY,
             json.dumps(STALLED), str(SPREAD_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )
        self.report: dict = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.report = json.loads(line)

    def held(self) -> int:
        return sum(self.report.get("held", {}).values())

    def stop(self) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it has died: its stderr says why
        self.proc.wait(60)
        self._reader.join(10)
        if self.proc.returncode:
            self.stderr.seek(0)
            raise RuntimeError(f"the attacker failed:\n{self.stderr.read()[-3000:]}")
        return self.report


# ---------------------------------------------------------------- the run


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads; 0 once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy (all cores; user, system, interrupts, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Phase:
    """Wall time, and each process's CPU, over one phase; "elsewhere" is the rest of the machine's busy time
    (other processes, interrupts): on a shared machine, the share of the cores this run did not have."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = time.monotonic()
        self.cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self.machine = machine_cpu_seconds()

    def end(self) -> dict[str, float]:
        """CPU cores each process used (CPU seconds per wall second), and the wall seconds."""
        wall = time.monotonic() - self.start
        cores = {name: (cpu_seconds(pid) - self.cpu[name]) / wall for name, pid in self.pids.items()}
        elsewhere = (machine_cpu_seconds() - self.machine) / wall - sum(cores.values())
        return cores | {"elsewhere": max(elsewhere, 0.0), "wall": wall}


def attack(url: str, pid: int, pids: list[int], during, base_fds: int) -> dict:
    """Hold the stalled connections while `during()` runs; then close them, and wait for the daemon to close its
    side: no socket left whose peer is not a client, and no more fds than `base_fds` besides the clients'.

    Waiting on fds, not only on sockets: a socket whose peer reset it leaves the kernel's TCP table at once,
    but its fd stays open until the daemon's event loop gets to it.
    """
    attacker = Attacker(url)
    ramp_deadline = time.monotonic() + SPREAD_S + 30
    while attacker.held() < sum(STALLED.values()) and time.monotonic() < ramp_deadline:
        time.sleep(0.2)
    result: dict = {"held_at_start": attacker.held()}
    watched: list[dict] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(2.0):
            watched.append(snapshot(pid, pids) | {"held": attacker.held()})

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result["during"] = during(attacker.proc.pid)
    watching.set()
    watcher.join()
    result["peak"] = {
        "fds": max(w["fds"] for w in watched), "rss_mb": max(w["rss_mb"] for w in watched),
        "others": max(w["others"] for w in watched), "held_min": min(w["held"] for w in watched),
    }
    start = time.monotonic()
    result["attacker"] = attacker.stop()
    while time.monotonic() - start < SETTLE_S:
        after = snapshot(pid, pids)
        if not after["others"] and after["fds"] - after["clients"] <= base_fds:
            break
        time.sleep(0.1)
    result["settle_s"] = time.monotonic() - start
    result["after"] = after
    return result


def run(url: str, pid: int, retries: RetryCounter) -> dict:
    r: dict = {}
    context = multiprocessing.get_context("spawn")
    pipe, child_pipe = context.Pipe()
    lean = context.Process(target=probe, args=(child_pipe, url), daemon=True)
    lean.start()
    child_pipe.close()  # so that the lean client's death reads as EOF here, not as a wait forever
    go, stop = threading.Event(), threading.Event()
    clients = [Client(i, url, go, stop) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    assert pipe.recv() == "ready"
    for client in clients:
        client.ready.wait()
    pids = [os.getpid(), lean.pid]
    processes = {"daemon": pid, "clients": os.getpid(), "lean": lean.pid}
    time.sleep(2.0)

    def steps() -> int:
        return sum(c.counts["steps"] for c in clients)

    def lean_client(command: tuple[str, float]) -> tuple[list[float], list[float]]:
        pipe.send(command)
        return pipe.recv()

    # 1. idle
    phase = Phase(processes)
    r["idle"] = lean_client(("rounds", IDLE_ROUNDS))
    r["idle_cpu"] = phase.end()
    phase = Phase(processes)
    r["idle_bare"] = lean_client(("bare", IDLE_BARE_S))
    r["idle_bare_cpu"] = phase.end()
    r["base"] = snapshot(pid, pids)
    base_fds = r["base"]["fds"] - r["base"]["clients"]

    # 2. load alone
    go.set()
    first, phase = steps(), Phase(processes)
    r["load"] = lean_client(("seconds", LOAD_S))
    r["load_cpu"] = phase.end()
    r["load_steps"] = steps() - first
    r["before_attack"] = snapshot(pid, pids)

    # 3. attack + load
    def loaded(attacker_pid: int) -> tuple[list[float], list[float]]:
        first, phase = steps(), Phase(processes | {"attacker": attacker_pid})
        timings = lean_client(("seconds", ATTACK_S))
        r["attack_cpu"] = phase.end()
        r["attack_steps"] = steps() - first
        stop.set()
        for client in clients:
            client.join(120)
        return timings

    r["attack1"] = attack(url, pid, pids, loaded, base_fds)
    r["attack"] = r["attack1"]["during"]

    # 4. attack alone
    def alone(attacker_pid: int) -> tuple[list[float], list[float]]:
        phase = Phase(processes | {"attacker": attacker_pid})
        timings = lean_client(("bare", ATTACK_ALONE_S))
        r["alone_cpu"] = phase.end()
        return timings

    r["attack2"] = attack(url, pid, pids, alone, base_fds)
    r["alone"] = r["attack2"]["during"]

    # 5. after
    phase = Phase(processes)
    r["recovered"] = lean_client(("rounds", AFTER_ROUNDS))
    r["after_cpu"] = phase.end()
    r["after"] = snapshot(pid, pids)
    r["metrics_after"] = metrics(url)
    r["sdk_retries"] = retries.retries
    pipe.send(None)
    lean.join(30)
    for client in clients:
        client.close()
    r["clients"] = clients
    return r


def report(r: dict, retries: RetryCounter, log: str) -> bool:
    """Print the figures and the checks; True when every check passed."""
    idle_future, _idle_bare = r["idle"]
    clients: list[Client] = r["clients"]
    counts = sum((c.counts for c in clients), Counter())
    failures = [f"client {c.index}: {f}" for c in clients for f in c.failures]
    errors = error_answers(r["metrics_after"])
    sdk_errors = {k: v for k, v in errors.items() if not k.startswith("refused_from_head ")}
    first, second = r["attack1"], r["attack2"]

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1e3

    def cell(values: list[float], idle: list[float]) -> str:
        if not values:
            return f"{0:>6} {'-':>17} {'-':>7} {'-':>7}"
        p50, p99 = ms(values, 0.5), ms(values, 0.99)
        figures = f"{p50:.2f} / {p99:.2f}" + ("*" if len(values) < 100 else "")
        return f"{len(values):>6} {figures:>17} {p50 / ms(idle, 0.5):>7.2f} {p99 / ms(idle, 0.99):>7.2f}"

    print(
        f"soak: {CLIENTS} SDK clients (threads) training and sampling on the tiny Llama; "
        f"{sum(STALLED.values())} stalled connections; default [http] limits"
    )
    head = f"{'rounds':>6} {'p50 / p99 ms':>17} {'p50 x':>7} {'p99 x':>7}"
    print(f"{'lean client':<20}| {'no-work future (x idle)':<40}| bare HTTP round trip (x idle)")
    print(f"{'':<20}| {head} | {head}")
    # The healthz-only rows have their own idle reference: no future traffic beside them in either.
    phases = (("idle node", "idle", "idle"), ("load alone", "load", "idle"), ("attack + load", "attack", "idle"),
              ("idle, healthz only", "idle_bare", "idle_bare"), ("attack alone, \"", "alone", "idle_bare"),
              ("after", "recovered", "idle"))
    for name, key, reference in phases:
        future, bare = r[key]
        print(f"{name:<20}| {cell(future, idle_future)} | {cell(bare, r[reference][1])}")

    print("* under 100 rounds: the p99 is the slowest round. Under load the no-work future waits its job's turn "
          "on the trainer, behind the clients' jobs")
    load_rate = r["load_steps"] / r["load_cpu"]["wall"]
    attack_rate = r["attack_steps"] / r["attack_cpu"]["wall"]
    print(
        f"client steps/s: load alone {load_rate:.2f}, attack + load {attack_rate:.2f}, ratio {attack_rate / load_rate:.2f}; "
        f"in all {counts['steps']} steps, {counts['saves']} saves, {counts['samples']} samples"
    )
    print(f"{'CPU cores used':<20}{'wall s':>7}{'daemon':>8}{'clients':>8}{'lean':>6}{'attacker':>9}{'elsewhere':>10}")
    for name, key in (("idle node", "idle_cpu"), ("load alone", "load_cpu"), ("attack + load", "attack_cpu"),
                      ("idle, healthz only", "idle_bare_cpu"), ("attack alone, \"", "alone_cpu"), ("after", "after_cpu")):
        c = r[key]
        attacker = f"{c['attacker']:.2f}" if "attacker" in c else ""
        print(
            f"{name:<20}{c['wall']:>7.1f}{c['daemon']:>8.2f}{c['clients']:>8.2f}{c['lean']:>6.2f}{attacker:>9}"
            f"{c['elsewhere']:>10.2f}"
        )
    opened_alone = sum(second["attacker"].get("opened", {}).values())
    extra_cpu = r["alone_cpu"]["daemon"] - r["idle_bare_cpu"]["daemon"]
    print(
        f"daemon CPU per stalled connection (attack alone, over the idle node, healthz only in both): "
        f"{extra_cpu * r['alone_cpu']['wall'] / opened_alone * 1e3:.2f} ms, over {opened_alone} connections"
    )

    print(f"{'daemon':<18}{'fds':>7}{'client':>8}{'other':>7}{'rest':>6}{'RSS MB':>9}")
    rows = (("idle baseline", r["base"]), ("before attack", r["before_attack"]), ("after attack 1", first["after"]),
            ("after attack 2", second["after"]), ("after", r["after"]))
    for name, snap in rows:
        rest = snap["fds"] - snap["clients"] - snap["others"]
        print(f"{name:<18}{snap['fds']:>7}{snap['clients']:>8}{snap['others']:>7}{rest:>6}{snap['rss_mb']:>9.1f}")
    for name, attack_run in (("attack 1 peak", first), ("attack 2 peak", second)):
        peak = attack_run["peak"]
        print(f"{name:<18}{peak['fds']:>7}{'':>8}{peak['others']:>7}{'':>6}{peak['rss_mb']:>9.1f}")
    before, after1, after2 = r["before_attack"]["rss_mb"], first["after"]["rss_mb"], second["after"]["rss_mb"]
    print(
        f"RSS: after attack 1 (with training) / before it {after1 / before:.3f} ({after1 - before:+.1f} MB); "
        f"after attack 2 (alone) / after attack 1 {after2 / after1:.4f} ({after2 - after1:+.2f} MB, "
        f"{(after2 - after1) * 2**20 / opened_alone:+.0f} bytes per connection it opened)"
    )
    for name, attack_run in (("attack 1", first), ("attack 2", second)):
        attacker = attack_run["attacker"]
        print(
            f"{name}: held {attack_run['held_at_start']} at the start, at least {attack_run['peak']['held_min']} "
            "throughout; answers " + ", ".join(f"{k} {v}" for k, v in sorted(attacker.get("answers", {}).items()))
            + f"; connect errors {sum(attacker.get('connect_errors', {}).values())}"
        )
    m = r["metrics_after"]
    timeouts = {
        phase: int(m.get(f'openrld_http_connection_timeouts_total{{phase="{phase}"}}', 0))
        for phase in ("head", "body", "keep_alive", "discard", "write")
    }
    print(
        f"/metrics at the end: connections open {int(m.get('openrld_http_connections_open', -1))}, "
        f"refused {int(m.get('openrld_http_connections_refused_total', -1))}; timeouts "
        + ", ".join(f"{k} {v}" for k, v in timeouts.items())
        + f"; refused from the head {errors.get('refused_from_head 401', 0)} x 401"
    )
    log_problems = [line for line in log.splitlines() if re.search(r"\b(ERROR|CRITICAL|Traceback)\b", line)]
    print(f"daemon log: {len(log_problems)} error lines" + "".join(f"\n  {line[:200]}" for line in log_problems[:5]))
    for message in retries.messages[:5]:
        print(f"  the SDK logged: {message[:200]}")

    failed = len(failures) + r["sdk_retries"] + sum(sdk_errors.values())
    print(
        f"{'PASS' if not failed else 'FAIL'} no failed request: {len(failures)} SDK calls raised, "
        f"{r['sdk_retries']} SDK retries, SDK requests answered >= 400: {sdk_errors or 'none'}"
    )
    for failure in failures[:5]:
        print(f"  {failure[:200]}")
    left = first["after"]["others"] + second["after"]["others"]
    print(
        f"{'PASS' if not left else 'FAIL'} no connection left: daemon sockets without a live client peer after "
        f"attack 1: {first['after']['others']} {first['after']['other_states'] or ''}"
        f"(all closed {first['settle_s']:.1f} s after the attacker began to close its own), after attack 2: "
        f"{second['after']['others']} {second['after']['other_states'] or ''}({second['settle_s']:.1f} s)"
    )
    base, after = r["base"], r["after"]
    base_rest, after_rest = base["fds"] - base["clients"], after["fds"] - after["clients"]
    fds_back = abs(after_rest - base_rest) <= FD_TOLERANCE
    print(
        f"{'PASS' if fds_back else 'FAIL'} fds back to baseline: "
        f"{after_rest} fds other than client connections at the end, {base_rest} at the idle baseline "
        f"(tolerance {FD_TOLERANCE})"
    )
    print(f"no-work future p99, attack + load / idle node: {ms(r['attack'][0], 0.99) / ms(idle_future, 0.99):.2f}")
    return not failed and not left and fds_back


def main() -> int:
    from _daemon import tiny_daemon  # here, not above: the lean client's process need not import torch

    retries = RetryCounter()
    sdk_logger = logging.getLogger("tinker")
    sdk_logger.setLevel(logging.DEBUG)
    sdk_logger.addHandler(retries)
    sdk_logger.propagate = False

    with tempfile.TemporaryDirectory(prefix="openrld-soak-") as keys_dir:
        keys_file = Path(keys_dir) / "keys.toml"
        keys_file.write_text(f'"{KEY}" = "soak"\n')
        keys_file.chmod(0o600)
        with tiny_daemon(f'api_keys_file = "{keys_file}"') as (url, model_dir):
            results = run(url, daemon_pid(), retries)
            log = (model_dir.parent / "daemon.log").read_text()
    return 0 if report(results, retries, log) else 1


if __name__ == "__main__":
    sys.exit(main())
