"""Where the time of rl_throughput.py's figures goes, on openrld's side: the daemon profiled while an
SDK client runs each figure.

For each of rl_throughput.py's three figures (SFT step 8x128, sample 8x32, RL iteration), after
rl_throughput.py's warm-up, an SDK client in a process of its own (bench/_sdk_loop.py) runs the
figure `--runs` times against `openrld serve` with its default config; then rl_throughput.py's
baseline, the bare transformers + peft loop in a process of its own with torch's defaults
(bench/_bare_loop.py, no openrld import), runs the same work `--runs` times, outside the
profile. This prints:

    <model> <figure>: client seconds of each run
        daemon CPU seconds a run (an engine thread that ended idle included), its busiest live
        threads' (/proc/<pid>/task), the client's CPU seconds a run, the daemon's minor page
        faults a run (each a page first touched), its live threads, and their voluntary context
        switches a run (each a thread gone to sleep: a torch pool thread whose spin ran out
        wakes again at the next parallel region)
        with `perf` on the PATH, the daemon's `perf record -g` over those runs: the symbols
        with the largest shares of its samples (`--top`), and the shared objects'
        the bare loop's seconds of each run, and the ratio of the medians (bare / openrld)

It explains the openrld side of rl_throughput.py's ratios (what the engine computes, what the
HTTP and SDK add, whether the cores are busy); the baseline beside it says how far that side
is from what a researcher's own loop takes in the same minutes. rl_throughput.py, with its
alternating rounds, stays the measure of the ratios: times on a shared VM drift by a third
within an hour (README, Benchmarks).

Run: `.venv/bin/python bench/profile_figures.py` (`--models tiny-llama smollm2`, `--runs N`,
`--top N`; about 2 minutes for SmolLM2 on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import bench_models, child, cpu_seconds, daemon_process, vocab_size
from rl_throughput import WORK, seconds

from openrld.actors.sampler import MAX_LOADED_VERSIONS


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process `pid` so far, by thread id."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = _task_seconds(task)
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return times


def _task_seconds(task: Path) -> float:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sleeps(pid: int) -> int:
    """Voluntary context switches of process `pid`'s threads so far: each a thread that went to
    sleep (a torch pool thread whose spin ran out, a wait on a lock or a socket)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def perf_top(data: Path, sort: str, top: int) -> list[str]:
    """The `top` lines of `perf report` by `sort` (their share of the samples first)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--stdio", "--sort", sort, "-g", "none"],
        capture_output=True, text=True, check=False,
    ).stdout
    lines = [line.strip() for line in report.splitlines() if line.strip() and not line.startswith("#")]
    return [line[:150] for line in lines[:top]]


def profile(name: str, model_dir: Path, runs: int, top: int, workdir: Path) -> None:
    perf = shutil.which("perf")
    with daemon_process({name: model_dir}) as (url, pid), \
            child("_sdk_loop.py", url, name, vocab_size(model_dir)) as api, child("_bare_loop.py", model_dir) as bare:
        for _, _, ours, theirs in WORK:  # rl_throughput.py's warm-up
            api.call(**ours)
            bare.call(**theirs)
        api.call("rl_iterations", count=MAX_LOADED_VERSIONS)
        for title, _, ours, theirs in WORK:
            data = workdir / f"{name}-{title.split()[0]}.perf"
            recorder = None
            if perf:
                recorder = subprocess.Popen(
                    [perf, "record", "-F", "499", "-g", "-p", str(pid), "-o", str(data)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)  # perf takes a moment to attach: the tiny Llama's runs are over in less
            threads, daemon, client = thread_seconds(pid), cpu_seconds(pid), cpu_seconds(api.proc.pid)
            faults, slept = minor_faults(pid), sleeps(pid)
            times = [seconds(api.call(**ours)) for _ in range(runs)]
            after = thread_seconds(pid)
            daemon_s, client_s = cpu_seconds(pid) - daemon, cpu_seconds(api.proc.pid) - client
            faults_n, slept_n = minor_faults(pid) - faults, sleeps(pid) - slept
            if recorder is not None:
                recorder.send_signal(signal.SIGINT)  # perf writes its data on SIGINT
                recorder.wait(60)
            used = sorted(((after[t] - threads.get(t, 0.0)) / runs for t in after), reverse=True)
            print(f"{name:10s} {title}: client seconds {', '.join(f'{t:.3f}' for t in times)}", flush=True)
            print(f"    daemon CPU {daemon_s / runs:.2f} s a run (busiest live threads {', '.join(f'{u:.2f}' for u in used[:4])}), "
                  f"client CPU {client_s / runs:.2f} s a run, daemon minor faults {faults_n // runs} a run, "
                  f"daemon threads {len(after)}, their voluntary context switches {slept_n // runs} a run", flush=True)
            if recorder is None:
                print("    perf is not on the PATH: no profile (apt-get install linux-perf)", flush=True)
            elif not data.exists():
                print("    perf recorded nothing (perf_event_paranoid, or no permission to attach)", flush=True)
            else:
                for line in perf_top(data, "sym", top):
                    print(f"    {line}", flush=True)
                print("    by shared object: " + "; ".join(perf_top(data, "dso", 5)), flush=True)
            baseline = [seconds(bare.call(**theirs)) for _ in range(runs)]
            print(f"    bare loop seconds {', '.join(f'{t:.3f}' for t in baseline)}; ratio of the medians "
                  f"{statistics.median(baseline) / statistics.median(times):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny-llama", "smollm2"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    with bench_models(args.models) as models, tempfile.TemporaryDirectory(prefix="openrld-profile-") as workdir:
        for name, model_dir in models:
            profile(name, model_dir, args.runs, args.top, Path(workdir))


if __name__ == "__main__":
    main()
