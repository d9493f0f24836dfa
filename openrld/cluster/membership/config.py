"""Membership protocol parameters and the failure-detection bound they imply.

This module owns `MembershipConfig` (the SWIM/Lifeguard timing knobs, with a
reason on every default) and the pure timer math derived from it: the
suspicion timeouts, the retransmit limit and `detection_bound`. Presets start
from one base and change a few fields. It does no I/O and keeps no state.

The figures follow the published SWIM and Lifeguard papers and the values
that production gossip systems settled on (probe every second, suspicion
multiplier 4, retransmit multiplier 4); only facts are taken from them.
"""

from __future__ import annotations

import math

import msgspec


class MembershipConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Timing and fan-out of the protocol; the same on every node of a cluster."""

    # One failure-detection round per member per second: a crash is noticed in
    # seconds while probes cost one small datagram pair per node per second.
    probe_interval_s: float = 1.0
    # A direct ping that is not acked in this time goes to indirect probes; well
    # above a LAN round trip, and it leaves half the round for the indirect ones.
    probe_timeout_s: float = 0.5
    # Members asked to ping a silent target for us: with 3, a lossy path between
    # two healthy nodes rarely makes one suspect the other (SWIM's k).
    indirect_checks: int = 3
    # Updates are gossiped in up to retransmit_mult * ceil(log10(n+1)) packets,
    # enough for an epidemic to reach every node with high probability.
    retransmit_mult: int = 4
    # The shortest suspicion lasts suspicion_mult * log10(n) probe intervals, so a
    # suspect has several rounds to hear of it and refute.
    suspicion_mult: float = 4.0
    # Without independent confirmations a suspicion lasts this many times longer
    # (Lifeguard): a lone, possibly unhealthy accuser cannot kill a node quickly.
    suspicion_max_timeout_mult: float = 6.0
    # Local health (Lifeguard awareness) stretches probe timeouts up to 8x when
    # this node itself is slow, so it stops accusing others of its own delays.
    awareness_max_multiplier: int = 8
    # Gossip of queued updates goes to this many random members this often; an
    # update reaches n nodes in about log(n)/log(gossip_nodes+1) rounds.
    gossip_interval_s: float = 0.2
    gossip_nodes: int = 3
    # Members declared dead are still gossiped to for this long, so a node that
    # was wrongly declared dead hears it and refutes.
    gossip_to_the_dead_s: float = 30.0
    # A full-state exchange with one random member this often repairs anything
    # gossip lost; it costs O(n) bytes, hence the long interval.
    push_pull_interval_s: float = 30.0
    # One push-pull that has not answered in this long has failed (a TCP exchange
    # of a few kilobytes takes milliseconds on a LAN).
    push_pull_timeout_s: float = 10.0
    # Dead members are forgotten after this long (their names may be reused).
    dead_reclaim_s: float = 600.0
    # Gossip packs updates into datagrams of at most this many bytes, under a
    # 1500-byte Ethernet MTU with IP/UDP headers; larger single updates go alone.
    max_packet_bytes: int = 1400

    @classmethod
    def lan(cls) -> MembershipConfig:
        """The defaults: a data-centre network."""
        return cls()

    @classmethod
    def local(cls) -> MembershipConfig:
        """Loopback and tests: round trips are microseconds, so every timer is 5x shorter."""
        return msgspec.structs.replace(
            cls(),
            probe_interval_s=0.2,
            probe_timeout_s=0.1,
            gossip_interval_s=0.05,
            gossip_to_the_dead_s=6.0,
            push_pull_interval_s=2.0,
            push_pull_timeout_s=2.0,
            dead_reclaim_s=120.0,
        )


def retransmit_limit(retransmit_mult: int, n: int) -> int:
    """How many packets carry one update before it is dropped: mult * ceil(log10(n+1))."""
    return retransmit_mult * math.ceil(math.log10(n + 1))


def push_pull_interval_s(config: MembershipConfig, n: int) -> float:
    """The push-pull interval among n members: stretched by log2(n/32)+1 beyond 32 members.

    Each exchange carries the whole table, so without the stretch the cluster's
    push-pull traffic would grow with n squared.
    """
    if n <= 32:
        return config.push_pull_interval_s
    return config.push_pull_interval_s * (math.ceil(math.log2(n) - math.log2(32)) + 1)


def suspicion_min_s(config: MembershipConfig, n: int) -> float:
    """The shortest a suspicion can last among n members: mult * max(1, log10(n)) * probe interval."""
    return config.suspicion_mult * max(1.0, math.log10(max(1, n))) * config.probe_interval_s


def suspicion_max_s(config: MembershipConfig, n: int) -> float:
    """The longest: a suspicion nobody else confirms."""
    return config.suspicion_max_timeout_mult * suspicion_min_s(config, n)


def expected_confirmations(config: MembershipConfig, n: int) -> int:
    """Independent confirmations that shrink a suspicion to its minimum (Lifeguard's K).

    Fewer than K other members exist in a small cluster, and then the minimum
    applies at once: waiting for confirmations that cannot come only delays.
    """
    k = int(config.suspicion_mult) - 2
    return k if n - 2 >= k else 0


def suspicion_timeout_s(minimum_s: float, maximum_s: float, confirmations: int, expected: int) -> float:
    """Lifeguard's decaying timeout: max - (max - min) * log(C+1) / log(K+1), never under min."""
    if expected < 1:
        return minimum_s
    fraction = math.log(confirmations + 1) / math.log(expected + 1)
    return max(minimum_s, maximum_s - (maximum_s - minimum_s) * fraction)


class DetectionBound(msgspec.Struct, frozen=True):
    """Time from a crash until every live member has declared the node dead, by term.

    `first_probe_s`: someone probes the dead node. Each live member walks a
    shuffled round-robin list of the others, so a given member reaches it
    within 2(n-1)-1 rounds; and as n-1 members walk independently,
    P(nobody within m rounds) <= (1 - m/(n-1))^(n-1) <= e^-m, so m =
    ceil(ln(1/miss_probability)) rounds suffice but for that probability.
    `probe_s`: the failed round itself (direct plus indirect probes).
    `suspicion_s`: the longest suspicion (no confirmations).
    `dissemination_s`: the Dead update spreading by gossip, bounded by the
    retransmit limit in gossip rounds.
    """

    n: int
    first_probe_s: float
    probe_s: float
    suspicion_s: float
    dissemination_s: float

    @property
    def total_s(self) -> float:
        return self.first_probe_s + self.probe_s + self.suspicion_s + self.dissemination_s


def detection_bound(config: MembershipConfig, n: int, *, miss_probability: float = 1e-6) -> DetectionBound:
    """The bound for a cluster of n members (the dead one included), for healthy survivors.

    Raises:
        ValueError: n < 2 (there is nobody to detect anything).
    """
    if n < 2:
        raise ValueError(f"a failure needs at least 2 members to be detected, got n={n}")
    round_robin_rounds = max(1, 2 * (n - 1) - 1)
    probabilistic_rounds = math.ceil(math.log(1.0 / miss_probability))
    return DetectionBound(
        n=n,
        first_probe_s=min(round_robin_rounds, probabilistic_rounds) * config.probe_interval_s,
        probe_s=config.probe_interval_s,
        suspicion_s=suspicion_max_s(config, n) if expected_confirmations(config, n) else suspicion_min_s(config, n),
        dissemination_s=retransmit_limit(config.retransmit_mult, n) * config.gossip_interval_s,
    )
