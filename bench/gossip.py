"""Gossip cost and failure-detection time of the membership protocol, on the in-memory network.

For each cluster size n (default 10, 100, 1000), under trio's fake clock and
the LAN timing preset:

- gossip bytes per second per node, in a steady window after the cluster has
  converged: datagrams (probes, acks, piggybacked and gossiped updates) and
  push-pull bodies, counted by the network as sent. The baseline printed next
  to it is the bare probe traffic the protocol cannot do without (one ping and
  one ack of minimal size per node per probe interval), so the ratio is the
  overhead of dissemination and anti-entropy on top of failure detection.
- failure-detection time: one node is crashed, and the time until every other
  node holds it dead is printed as a ratio of the theoretical bound
  (`config.detection_bound`), with the bound's terms.

Times are simulated seconds (the fake clock), so the figures do not depend on
this machine's load; only the wall time to compute them does.

Run: `.venv/bin/python bench/gossip.py [--sizes 10,100,1000] [--loss 0.0] [--window-s 60]`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import trio
import trio.testing

from openrld.cluster.membership.codec import HEADER_BYTES, encode_messages
from openrld.cluster.membership.config import MembershipConfig, detection_bound
from openrld.cluster.membership.fake_network import FakeNetwork
from openrld.cluster.membership.messages import Ack, Ping
from openrld.cluster.membership.simulation import SimulatedCluster

JOINS_PER_S = 40.0


def probe_baseline_bytes_per_s(config: MembershipConfig, name_len: int) -> float:
    """One ping and one ack per node per probe interval, names of `name_len` characters."""
    name = "n" * name_len
    ping = HEADER_BYTES + len(encode_messages([Ping(1, name, name)]))
    ack = HEADER_BYTES + len(encode_messages([Ack(1)]))
    return (ping + ack) / config.probe_interval_s


async def measure(n: int, loss: float, window_s: float, seed: int) -> dict[str, float]:
    config = MembershipConfig.lan()
    rng = random.Random(seed)
    network = FakeNetwork(rng, loss=loss, min_delay_s=0.0, max_delay_s=0.0)
    cluster = SimulatedCluster(network, config, rng)
    result: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        for i in range(n):
            await cluster.add(nursery, f"n{i}", [] if i == 0 else [f"n{rng.randrange(i)}"])
            await trio.sleep(1.0 / JOINS_PER_S)
        joined_at = trio.current_time()
        while not cluster.is_converged():  # noqa: ASYNC110  # the simulated cluster offers no event to wait on
            await trio.sleep(1.0)
        result["converge_s"] = trio.current_time() - joined_at
        # Let the join traffic die down, then count a steady window.
        await trio.sleep(10.0)
        datagrams_before = sum(network.bytes_sent.values())
        push_pull_before = sum(network.push_pull_bytes.values())
        await trio.sleep(window_s)
        result["datagram_bps"] = (sum(network.bytes_sent.values()) - datagrams_before) / window_s / n
        result["push_pull_bps"] = (sum(network.push_pull_bytes.values()) - push_pull_before) / window_s / n
        victim = f"n{n // 2}"
        cluster.crash(victim)
        crashed_at = trio.current_time()
        while not cluster.declared_dead_by_all(victim):  # noqa: ASYNC110  # as above
            await trio.sleep(0.1)
        result["detect_s"] = trio.current_time() - crashed_at
        result["false_positives"] = float(len(cluster.false_positives()))
        nursery.cancel_scope.cancel()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    config = MembershipConfig.lan()
    print(f"LAN preset, loss {args.loss:.0%}, steady window {args.window_s:.0f} s (simulated)")
    for n in (int(size) for size in args.sizes.split(",")):
        wall_start = time.perf_counter()
        figures = trio.run(
            measure, n, args.loss, args.window_s, args.seed, clock=trio.testing.MockClock(autojump_threshold=0)
        )
        baseline = probe_baseline_bytes_per_s(config, len(f"n{n - 1}"))
        total = figures["datagram_bps"] + figures["push_pull_bps"]
        bound = detection_bound(config, n)
        print(
            f"n={n:5d}  gossip {total:8.0f} B/s/node (datagrams {figures['datagram_bps']:.0f}, "
            f"push-pull {figures['push_pull_bps']:.0f}) = {total / baseline:.2f}x bare probing ({baseline:.0f} B/s)  "
            f"converged {figures['converge_s']:.0f} s after the last join"
        )
        print(
            f"         detection {figures['detect_s']:.1f} s = {figures['detect_s'] / bound.total_s:.2f} of the bound "
            f"{bound.total_s:.1f} s (first probe {bound.first_probe_s:.0f} + probe {bound.probe_s:.0f} + "
            f"suspicion {bound.suspicion_s:.1f} + dissemination {bound.dissemination_s:.1f})  "
            f"false positives {figures['false_positives']:.0f}  [wall {time.perf_counter() - wall_start:.0f} s]",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
