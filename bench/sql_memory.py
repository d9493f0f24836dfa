"""The daemon's resident memory under the README's text-to-SQL sweep, and where it goes.

It starts a default `openrld serve` (its own data dir and port, no config but those) and runs the
sweep's shape against it through the recipe, in a process of its own: the README's command
(SmolLM2-135M-Instruct, the filter family with half its questions held out, lr 1e-3 and 2e-3,
`importance_sampling`, LoRA rank 16, group 8, 4 questions a step, 2 jobs at once, 2 rounds of
autoresearch) with fewer steps by default (`--steps 2 --eval-every 2`; the README's run is
`--steps 10 --eval-every 5`): each round still has a held-out eval of 64 requests beside the
other job's training steps. Every half second it reads the daemon's VmRSS; at each round's end
it reads VmRSS, VmHWM, /proc/<pid>/smaps_rollup and the node's /metrics. It prints:

    RESULT peak: the daemon's VmHWM over the run (target <= 4 GB)
    RESULT round R end: VmRSS at the end of each round (growth across rounds: target none)
    RESULT breakdown of the peak: the interpreter and libraries (the idle daemon's VmRSS), the
        float32 base weights the trainer and the sampler each map, the jobs' LoRA with its
        gradients and Adam moments, the sampler's LoRA versions, the prefix cache (the node's
        `openrld_host_memory_bytes{part="prefix_cache"}`, else its default budget); the rest is
        the steps' working memory (KV rows, activations, logits chunks) and the allocator's.
    and every `openrld_host_memory*` sample of /metrics, and the Rss the weights count twice.

    .venv/bin/python bench/sql_memory.py [--steps 2 --eval-every 2 --rounds 2]

About 20 minutes on 2 CPU cores shared with other work (load average 7-11): its sweep took 1,073 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import SMOLLM2, clean_env, daemon_process, smollm2_dir

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
SAMPLE_EVERY_S = 0.5
ROUND_LINE = re.compile(r"round (\d+)( done)?:")
JOBS, RANK, FP32 = 2, 16, 4  # the sweep's jobs at once and LoRA rank; the node's CPU weights are float32
PREFIX_CACHE_BUDGET = 256 * 2**20  # the default sampler_prefix_cache_bytes, where /metrics has no gauge of it


def proc_kib(pid: int, file: str, field: str) -> int:
    """One `field: N kB` line of /proc/<pid>/<file>, in bytes."""
    for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/{file}")


def smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup's kB lines, in bytes (Rss, Anonymous, File-backed pages as Rss minus Anonymous)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name] = int(parts[0]) * 1024
    return fields


def host_memory_parts(url: str) -> dict[str, float]:
    """Every `openrld_host_memory_bytes`-like sample of the node's /metrics ({} when it has none), by its
    labels, and the sampler's loaded LoRA versions."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    parts = {}
    for line in text.splitlines():
        if line.startswith(("openrld_host_memory", "openrld_sampler_loaded_weight_versions")):
            name, _, value = line.rpartition(" ")
            parts[name] = float(value)
    return parts


class RssSampler:
    """The daemon's VmRSS every SAMPLE_EVERY_S seconds, in a thread, with the round each sample fell in."""

    def __init__(self, pid: int) -> None:
        self.pid, self.round, self.samples = pid, -1, []  # samples: (seconds, round, rss bytes)
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            try:
                rss = proc_kib(self.pid, "status", "VmRSS")
            except (OSError, RuntimeError):  # the daemon has exited (the sweep failed)
                return
            self.samples.append((time.monotonic() - self.started, self.round, rss))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def peak(self, round_: int) -> int:
        return max((rss for _, r, rss in self.samples if r == round_), default=0)


def sweep_command(url: str, out: Path, args: argparse.Namespace) -> list[str]:
    """The README's sweep, with the bench's steps, evals and rounds."""
    return [sys.executable, "-m", "recipes.sql", "sweep", "--url", url, "--families", "filter",
            "--heldout-fraction", "0.5", "--temperature", "0.7", "--lr", "1e-3,2e-3", "--loss", "importance_sampling",
            "--rank", "16", "--group-size", "8", "--questions-per-step", "4", "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--jobs", "2", "--autoresearch", "--rounds", str(args.rounds),
            "--out", str(out)]


def run(args: argparse.Namespace) -> None:
    model_dir = smollm2_dir()
    if model_dir is None:
        raise SystemExit("SmolLM2 is not installed (make install)")
    with tempfile.TemporaryDirectory(prefix="openrld-sql-memory-") as tmp, daemon_process({}) as (url, pid):
        idle = proc_kib(pid, "status", "VmRSS")
        print(f"daemon {url} pid {pid}; idle VmRSS {idle / GB:.2f} GB", flush=True)
        sampler = RssSampler(pid)
        command = sweep_command(url, Path(tmp) / "sweep", args)
        print("sweep: " + " ".join(command[1:]), flush=True)
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=clean_env(os.environ))
        assert proc.stdout is not None
        ends = {}
        try:
            for line in proc.stdout:
                match = ROUND_LINE.match(line)
                if match is None:
                    continue
                round_ = int(match.group(1))
                if match.group(2) is None:
                    sampler.round = round_
                    print(line.rstrip(), flush=True)
                    continue
                ends[round_] = round_end(pid, url, sampler, round_)
            if proc.wait() != 0:
                raise SystemExit(f"the sweep failed (exit status {proc.returncode})")
        finally:
            sampler.stop()
        report(pid, url, sampler, ends, idle, model_dir)


def round_end(pid: int, url: str, sampler: RssSampler, round_: int) -> dict[str, object]:
    end = dict(rss=proc_kib(pid, "status", "VmRSS"), hwm=proc_kib(pid, "status", "VmHWM"), peak=sampler.peak(round_),
               smaps=smaps_rollup(pid), metrics=host_memory_parts(url), t=time.monotonic() - sampler.started)
    print(f"round {round_} done at {end['t']:.0f} s: VmRSS {end['rss'] / GB:.2f} GB, the round's peak "
          f"{end['peak'] / GB:.2f} GB, VmHWM {end['hwm'] / GB:.2f} GB", flush=True)
    return end


def report(pid: int, url: str, sampler: RssSampler, ends: dict[int, dict], idle: int, model_dir: Path) -> None:
    hwm = proc_kib(pid, "status", "VmHWM")
    print(f"RESULT peak: VmHWM {hwm / GB:.2f} GB over the sweep (target <= 4 GB)", flush=True)
    for round_, end in sorted(ends.items()):
        print(f"RESULT round {round_} end: VmRSS {end['rss'] / GB:.2f} GB, anonymous {end['smaps']['Anonymous'] / GB:.2f} GB "
              f"(the round's peak {end['peak'] / GB:.2f} GB)", flush=True)
    last = ends[max(ends)]
    metrics = last["metrics"]
    for name, value in metrics.items():
        if name.startswith("openrld_host_memory"):
            print(f"metrics at the last round's end: {name} {value / GB:.3f} GB", flush=True)
    versions = sum(v for name, v in metrics.items() if name.startswith("openrld_sampler_loaded_weight_versions"))
    prefix = metrics.get('openrld_host_memory_bytes{part="prefix_cache"}', PREFIX_CACHE_BUDGET)
    parts = breakdown(model_dir, idle, hwm, int(versions), int(prefix))
    print("RESULT breakdown of the peak: " + ", ".join(f"{name} {size / GB:.2f} GB" for name, size in parts.items()),
          flush=True)
    smaps = last["smaps"]
    print(f"at the last round's end: Rss {smaps['Rss'] / GB:.2f} GB = anonymous {smaps['Anonymous'] / GB:.2f} + "
          f"file-backed {(smaps['Rss'] - smaps['Anonymous']) / GB:.2f} (Pss {smaps['Pss'] / GB:.2f} GB: the two engines "
          f"map the same weight file, which Rss counts twice and Pss once)", flush=True)


def breakdown(model_dir: Path, idle: int, peak: int, versions: int, prefix_cache: int) -> dict[str, int]:
    """Where the peak goes, by what can be computed from the model and the sweep's shape; the rest
    is the step's working memory (KV rows, activations, logits chunks) and what the allocator holds."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
    lora = lora_parameters(config, RANK) * FP32
    parts = {
        "interpreter and libraries (idle daemon)": idle,
        "base weights, trainer's and sampler's copies": 2 * weights,
        f"{JOBS} jobs' LoRA, gradients and Adam moments": JOBS * 4 * lora,
        f"sampler's LoRA versions ({versions} loaded at the end)": versions * lora,
        "prefix cache": prefix_cache,
    }
    parts["KV, activations, logits and the allocator (the rest)"] = peak - sum(parts.values())
    return parts


def lora_parameters(config: dict, rank: int) -> int:
    """A Llama's LoRA parameters at `rank` on every linear layer and the output layer (the SDK's default)."""
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    per_layer = (hidden + q) * 2 + (hidden + kv) * 2 + (hidden + inner) * 3  # q o, k v, gate up down
    return rank * (layers * per_layer + hidden + config["vocab_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{SMOLLM2}: the SQL sweep's shape, {args.steps} steps, eval every {args.eval_every}, {args.rounds} rounds",
          flush=True)
    run(args)


if __name__ == "__main__":
    main()
