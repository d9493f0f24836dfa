"""How long a training loop waits when its job's home node is killed: from the kill to the first answer on the adopter.

Each round starts three `openrld serve` daemons on loopback that share one checkpoint root
(issue 41): A is a front node (`accept_jobs = false`), B and C take jobs. The real SDK,
in this process, creates a LoRA job through A on the tiny Llama (auto-saved every step)
and trains STEPS steps; then it sends the next step (its forward_backward and optim_step,
pipelined) and the job's home is killed with SIGKILL right after, so that step is in
flight at the home. The survivor adopts the job from its auto-save, A replays what it
kept, and the step is answered from the adopter. Printed per round and as medians:

    detected   seconds from the kill until A's view shows the home dead (polled every 20 ms)
    claimed    seconds from the kill until the adopter's claim on the shared root (its time stamp)
    answered   seconds from the kill until the forward_backward sent before it has its result

against the gossip detection bound (`membership.config.detection_bound` for the preset and
three members: the time within which every survivor knows of a crash, with a miss probability
of 1e-6). What `answered` adds to the detection time is the adopter's work: the claim, its
group's start (the base model's load), loading the auto-save, the payload gossiped, and the
replay of the kept requests.

Run: `.venv/bin/python bench/adoption_time.py` (`--rounds N`, `--timing local|lan`, `--steps N`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import clean_env

from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.gpu.tiny_models import build_tiny_model
from openrld.store.job_claims import latest_claim

SECRET = "bench-adoption-secret"
KEY = "tml-bench"
HEADERS = {"X-API-Key": KEY}
RELAYED = {**HEADERS, "x-openrl-relayed-by": "bench"}  # a node answers about itself only


class Node:
    def __init__(self, root: Path, name: str, model: Path, shared: Path, timing: str, seeds: list[str], extra: str) -> None:
        self.name = name
        joined = ", ".join(f'"{seed}"' for seed in seeds)
        config = root / f"{name}.toml"
        config.write_text(
            f'data_dir = "{root / name}"\ndevice = "cpu"\nnode_name = "{name}"\ncluster_secret = "{SECRET}"\n'
            f'gossip_port = 0\ngossip_timing = "{timing}"\njoin = [{joined}]\ncheckpoint_root = "{shared}"\n'
            f'longpoll_s = 3.0\n{extra}\n[models]\n"tiny-llama" = "{model}"\n'
        )
        self.log = open(root / f"{name}.log", "w")  # noqa: SIM115  # the daemon writes it for its whole life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=dict(clean_env(os.environ), PYTHONUNBUFFERED="1"),
        )
        self.url = ""

    def ready(self) -> Node:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = re.match(r"openrld listening on (\S+)", line)
            if match:
                self.url = match.group(1)
                return self
        raise RuntimeError(f"{self.name} did not start; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@contextlib.contextmanager
def cluster(root: Path, model: Path, timing: str) -> Iterator[tuple[dict[str, Node], Path]]:
    shared = root / "checkpoints"
    shared.mkdir()
    nodes: dict[str, Node] = {}
    try:
        nodes["a"] = Node(root, "a", model, shared, timing, [], "accept_jobs = false").ready()
        seed = nodes["a"].url.removeprefix("http://")
        for name in ("b", "c"):
            nodes[name] = Node(root, name, model, shared, timing, [seed], "")
        for name in ("b", "c"):
            nodes[name].ready()
        deadline = time.monotonic() + 60
        while not all(state(nodes["a"].url, n) == "alive" for n in ("b", "c")):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not form")
            time.sleep(0.1)
        yield nodes, shared
    finally:
        for node in nodes.values():
            node.stop()


def members(url: str) -> dict[str, dict]:
    body = httpx.get(f"{url}/openrl/v1/cluster", headers=HEADERS, timeout=10).json()
    return {m["name"]: m for m in body["members"]}


def state(url: str, name: str) -> str | None:
    member = members(url).get(name)
    return member["state"] if member is not None and member["devices"] else None


def one_round(root: Path, model: Path, timing: str, steps: int) -> dict[str, float]:
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-3)
    batch = [
        types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 69))), loss_fn_inputs={"target_tokens": list(range(6, 70))})
    ] * 4
    with cluster(root, model, timing) as (nodes, shared):
        a = nodes["a"].url
        service = tinker.ServiceClient(base_url=a, api_key=KEY)
        training = service.create_lora_training_client(
            base_model="tiny-llama", rank=8, seed=0, user_metadata={"openrl.autosave_steps": "1"}
        ).result()
        model_id = training.model_id
        victim = next(
            name for name in ("b", "c")
            if httpx.get(f"{nodes[name].url}/openrl/v1/models/{model_id}/status", headers=RELAYED, timeout=10).status_code == 200
        )
        for _ in range(steps):
            training.forward_backward(batch, "cross_entropy").result()
            training.optim_step(adam).result()
        time.sleep(0.5)  # the last step's auto-save commits
        while model_id not in members(a)[victim]["jobs"]:  # the victim gossips its jobs as it creates them
            time.sleep(0.05)
        detected: list[float] = []

        def watch(killed: float) -> None:
            while state(a, nodes[victim].name) != "dead":
                time.sleep(0.02)
            detected.append(time.monotonic() - killed)

        forward_backward = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(adam)
        time.sleep(0.01)  # the step is on its way to the home, or running there
        nodes[victim].proc.kill()
        killed, killed_at = time.monotonic(), time.time()
        watcher = threading.Thread(target=watch, args=(killed,))
        watcher.start()
        forward_backward.result()
        answered = time.monotonic() - killed
        optim.result()
        watcher.join(120)
        claim = latest_claim(shared, model_id)
        return {
            "detected": detected[0] if detected else float("nan"),
            "claimed": claim.claimed_at - killed_at if claim is not None else float("nan"),
            "answered": answered,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps before the kill")
    parser.add_argument("--timing", choices=("local", "lan"), default="local", help="the gossip timing preset")
    args = parser.parse_args()
    config = MembershipConfig.local() if args.timing == "local" else MembershipConfig.lan()
    bound = detection_bound(config, 3)
    print(f"gossip_timing={args.timing}: detection bound {bound.total_s:.2f} s for 3 members "
          f"(first probe {bound.first_probe_s:.2f}, probe {bound.probe_s:.2f}, suspicion {bound.suspicion_s:.2f}, "
          f"dissemination {bound.dissemination_s:.2f})", flush=True)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="openrld-bench-adoption-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama", "llama", seed=0)
        for round_ in range(args.rounds):
            root = Path(tmp) / f"round-{round_}"
            root.mkdir()
            result = one_round(root, model, args.timing, args.steps)
            results.append(result)
            print(
                f"round {round_}: detected {result['detected']:.2f} s, claimed {result['claimed']:.2f} s, "
                f"answered {result['answered']:.2f} s after the kill ({result['answered'] / bound.total_s:.2f}x the bound)",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for key in ("detected", "claimed", "answered"):
        print(f"median {key}: {statistics.median(r[key] for r in results):.2f} s")
    print(f"median answered / detection bound: {statistics.median(r['answered'] for r in results) / bound.total_s:.2f}x")


if __name__ == "__main__":
    main()
