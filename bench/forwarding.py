"""Forwarding overhead: a request through a non-home node, as a ratio of the same request sent to the home node.

Two real daemons on loopback form a cluster: A is a front node
(`accept_jobs = false`), B takes the jobs. Two LoRA jobs live on B, in its one
group: one created through A, one created through B. Each is driven through
the node its client talks to, so the only difference is A's relay.

Measured, in alternating blocks so that drift in this machine's speed hits
both sides alike:

- lean client (http.client, one keep-alive connection): a no-work future,
  `optim_step` with no gradient then `retrieve_future` (two HTTP calls, both
  relayed through A): per-round median through A / through B;
- the real SDK: a training step, `forward_backward` on 4 sequences of 32 tokens
  and `optim_step`, each `.result()`: median through A / through B.

Run: `.venv/bin/python bench/forwarding.py [--blocks 10] [--per-block 30]`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import tiny_daemon
from future_latency import Lean, lean_model

SECRET = "bench-cluster-secret"


def cluster_config(name: str, join: str | None, accept_jobs: bool) -> str:
    seeds = f'["{join}"]' if join else "[]"
    return (
        f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"\n'
        f"join = {seeds}\naccept_jobs = {str(accept_jobs).lower()}\n"
    )


def wait_until_a_sees_b(url: str) -> None:
    lean = Lean(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        members = lean.call("GET", "/openrl/v1/cluster")["members"]
        if any(m["name"] == "bench-b" and m["devices"] for m in members):
            return
        time.sleep(0.1)
    raise RuntimeError("node A never saw node B's devices")


def no_work_rounds(lean: Lean, model_id: str, first_seq: int, rounds: int) -> list[float]:
    times = []
    for seq in range(first_seq, first_seq + rounds):
        start = time.perf_counter()
        submitted = lean.call("POST", "/api/v1/optim_step", {"model_id": model_id, "seq_id": seq, "adam_params": {}})
        result = lean.call("POST", "/api/v1/retrieve_future", {"request_id": submitted["request_id"]})
        times.append(time.perf_counter() - start)
        assert "metrics" in result, result
    return times


def sdk_steps(training, rounds: int) -> list[float]:
    from tinker import types

    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(1 + i, 33 + i))),
            loss_fn_inputs={"target_tokens": list(range(2 + i, 34 + i)), "weights": [1.0] * 32},
        )
        for i in range(4)
    ]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times.append(time.perf_counter() - start)
    return times


def alternate(blocks: int, measure_a, measure_b) -> tuple[list[float], list[float]]:
    via_a, via_b = [], []
    for block in range(blocks):
        order = [(via_a, measure_a), (via_b, measure_b)]
        for sink, measure in order if block % 2 == 0 else reversed(order):
            sink.extend(measure())
    return via_a, via_b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--per-block", type=int, default=30)
    args = parser.parse_args()
    import tinker

    with contextlib.ExitStack() as stack:
        url_a, _ = stack.enter_context(tiny_daemon(cluster_config("bench-a", None, accept_jobs=False)))
        url_b, _ = stack.enter_context(
            tiny_daemon(cluster_config("bench-b", url_a.removeprefix("http://"), accept_jobs=True))
        )
        wait_until_a_sees_b(url_a)

        (lean_a, model_a), (lean_b, model_b) = lean_model(url_a), lean_model(url_b)
        seqs = {"a": 1, "b": 1}

        def rounds(which: str) -> list[float]:
            lean, model_id = (lean_a, model_a) if which == "a" else (lean_b, model_b)
            times = no_work_rounds(lean, model_id, seqs[which], args.per_block)
            seqs[which] += args.per_block
            return times

        rounds("a"), rounds("b")  # warm both paths (connections, code); seq ids run on without a gap
        lean_via_a, lean_via_b = alternate(args.blocks, lambda: rounds("a"), lambda: rounds("b"))

        service_a = tinker.ServiceClient(base_url=url_a, api_key="tml-bench")
        service_b = tinker.ServiceClient(base_url=url_b, api_key="tml-bench")
        training_a = service_a.create_lora_training_client(base_model="tiny-llama", rank=4).result()
        training_b = service_b.create_lora_training_client(base_model="tiny-llama", rank=4).result()
        sdk_steps(training_a, 3)
        sdk_steps(training_b, 3)
        steps = max(2, args.per_block // 6)
        sdk_via_a, sdk_via_b = alternate(
            args.blocks, lambda: sdk_steps(training_a, steps), lambda: sdk_steps(training_b, steps)
        )
        service_a.close("success").result()
        service_b.close("success").result()

    def line(what: str, a: list[float], b: list[float]) -> None:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{what}: through A {ma * 1e3:.2f} ms, at home B {mb * 1e3:.2f} ms, ratio {ma / mb:.2f} ({len(a)} rounds each)")

    print("forwarding overhead: a request through a non-home node / the same request sent to the home node")
    line("lean no-work future (optim_step + retrieve_future, 2 relayed calls)", lean_via_a, lean_via_b)
    line("SDK training step (forward_backward 4x32 tokens + optim_step)", sdk_via_a, sdk_via_b)


if __name__ == "__main__":
    main()
