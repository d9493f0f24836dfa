"""Request counters and the Prometheus text exposition of a node's statistics.

This module owns `RequestMetrics` (requests by endpoint, method and status,
and a latency histogram per endpoint and method) and `render_prometheus`,
which turns that plus the actors' and the store's `statistics()` into the
Prometheus text format, version 0.0.4. It guarantees bounded label sets:
endpoints are route templates (never raw paths, which carry ids), unknown
methods collapse to "other", and statistics are labelled by base model only,
never by a client's model id. It never imports the HTTP framework or torch,
never calls into trio, and never reads a clock: callers pass the seconds
they measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from openrld.actors.futures import FutureStatistics
from openrld.actors.groups import GroupStatistics
from openrld.actors.host_memory import NO_HOST_MEMORY, HostMemoryStatistics
from openrld.actors.stability import StabilityStatistics
from openrld.api.sdk_versions import SdkVersionStatistics
from openrld.cluster.membership.codec import DropReason
from openrld.cluster.membership.node import MembershipStatistics
from openrld.cluster.peer_client import RelayStatistics
from openrld.loop_watch import LoopWatchStatistics
from openrld.store import StoreStatistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Upper bounds in seconds. Submits answer in milliseconds; retrieve_future long-polls
# hold up to longpoll_s (30 s by default, always under the SDK's 45 s), so the top
# buckets separate a held poll from a stuck one.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0)

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

UNMATCHED_ENDPOINT = "unmatched"  # any path no route serves: one label, however many paths are probed


class EndpointStatistics(msgspec.Struct, frozen=True):
    endpoint: str
    method: str
    by_status: dict[int, int]
    bucket_counts: tuple[int, ...]  # per LATENCY_BUCKETS_S bound, not cumulative; the last is over the top bound
    seconds_sum: float


class _Endpoint:
    __slots__ = ("by_status", "bucket_counts", "seconds_sum")

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.bucket_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.seconds_sum = 0.0


class RequestMetrics:
    """Counts every answered request. Not thread-safe: used from the event loop only."""

    def __init__(self) -> None:
        self._endpoints: dict[tuple[str, str], _Endpoint] = {}

    def observe(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        """Record one answered request.

        Args:
            endpoint: the route template ("/api/v1/training_runs/<run_id>"), or UNMATCHED_ENDPOINT.
            method: the HTTP method; anything non-standard is counted as "other".
            status: the HTTP status answered.
            seconds: from the request's arrival to its answer.
        """
        method = method if method in _METHODS else "other"
        entry = self._endpoints.get((endpoint, method))
        if entry is None:
            entry = self._endpoints[(endpoint, method)] = _Endpoint()
        entry.by_status[status] = entry.by_status.get(status, 0) + 1
        seconds = max(seconds, 0.0)
        index = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if seconds <= bound), len(LATENCY_BUCKETS_S))
        entry.bucket_counts[index] += 1
        entry.seconds_sum += seconds

    def statistics(self) -> list[EndpointStatistics]:
        return [
            EndpointStatistics(
                endpoint=endpoint, method=method, by_status=dict(entry.by_status),
                bucket_counts=tuple(entry.bucket_counts), seconds_sum=entry.seconds_sum,
            )
            for (endpoint, method), entry in sorted(self._endpoints.items())
        ]


# Why the HTTP server closed a connection on a deadline (api/http1.py; [http] in the config).
HTTP_TIMEOUT_PHASES: tuple[str, ...] = ("head", "body", "keep_alive", "discard", "write")


class HttpStatistics(msgspec.Struct, frozen=True):
    open_connections: int
    refused_connections: int  # closed at once: max_connections were open
    timeouts: dict[str, int]  # connections closed on a deadline, by HTTP_TIMEOUT_PHASES


class HttpCounters:
    """Counted by the HTTP server (api/http1.py), read by /metrics."""

    def __init__(self) -> None:
        self.open_connections = self.refused_connections = 0
        self.timeouts = dict.fromkeys(HTTP_TIMEOUT_PHASES, 0)

    def statistics(self) -> HttpStatistics:
        return HttpStatistics(self.open_connections, self.refused_connections, dict(self.timeouts))


class NodeStatistics(msgspec.Struct, frozen=True):
    """Everything one scrape reports; gathered by the API from the actors and the store."""

    version: str
    requests: list[EndpointStatistics]
    futures: FutureStatistics
    groups: list[GroupStatistics]
    store: StoreStatistics
    stability: StabilityStatistics | None = None  # stable_reinforce's sampling records (actors/stability.py)
    membership: MembershipStatistics | None = None  # gossip; None on a node outside any cluster
    # Any-node-answers relaying. Zero on a node outside any cluster (it relays and places nothing), and
    # rendered there too, so that a dashboard's lost-answers panel reads 0, not "No data".
    relay: RelayStatistics = RelayStatistics(relayed=0, unreachable=0, lost=0, placed=0, refused=0)
    http: HttpStatistics | None = None  # the HTTP server's connections; None when no server counts them
    loop: LoopWatchStatistics | None = None  # slow event-loop steps; None unless loop_watch_ms is set
    sdk_versions: SdkVersionStatistics | None = None  # requests per tinker SDK release (api/sdk_versions.py)
    # The node's host-memory budget and what holds it (actors/host_memory.py); zero where no ledger keeps it.
    host_memory: HostMemoryStatistics = NO_HOST_MEMORY


# ---------------------------------------------------------------- text format

Labels = Sequence[tuple[str, str]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _sample(name: str, labels: Labels, value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}"
    text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
    return f"{name}{{{text}}} {_number(value)}"


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines.extend(_sample(name, labels, value) for labels, value in samples)
    return lines


def _request_lines(requests: list[EndpointStatistics]) -> list[str]:
    lines = _family(
        "openrld_http_requests_total", "counter", "HTTP requests answered, by endpoint, method and status.",
        (
            ((("endpoint", e.endpoint), ("method", e.method), ("status", str(status))), count)
            for e in requests
            for status, count in sorted(e.by_status.items())
        ),
    )
    name = "openrld_http_request_duration_seconds"
    lines += [f"# HELP {name} Time from a request's arrival to its answer.", f"# TYPE {name} histogram"]
    for e in requests:
        base = (("endpoint", e.endpoint), ("method", e.method))
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS_S, e.bucket_counts):
            cumulative += count
            lines.append(_sample(f"{name}_bucket", (*base, ("le", _number(bound))), cumulative))
        total = sum(e.bucket_counts)
        lines.append(_sample(f"{name}_bucket", (*base, ("le", "+Inf")), total))
        lines.append(_sample(f"{name}_sum", base, e.seconds_sum))
        lines.append(_sample(f"{name}_count", base, total))
    return lines


def _group_lines(groups: list[GroupStatistics]) -> list[str]:
    def per_group(value_of) -> list[tuple[Labels, float]]:
        return [((("base_model", g.base_model),), float(value_of(g))) for g in groups]

    def per_outcome(done_of, failed_of) -> list[tuple[Labels, float]]:
        return [
            ((("base_model", g.base_model), ("outcome", outcome)), float(value_of(g)))
            for g in groups
            for outcome, value_of in (("done", done_of), ("failed", failed_of))
        ]

    return [
        *_family("openrld_trainer_jobs", "gauge", "Training jobs (LoRA adapters) on the base model's trainer.",
                 per_group(lambda g: len(g.trainer.jobs))),
        *_family("openrld_trainer_adapters_loaded", "gauge",
                 "Jobs whose state (a LoRA adapter, its gradients and optimizer state) the trainer engine holds.",
                 per_group(lambda g: g.trainer.adapters_loaded)),
        *_family("openrld_trainer_queue_depth", "gauge", "Training operations waiting for their turn, over all jobs.",
                 per_group(lambda g: sum(j.waiting for j in g.trainer.jobs))),
        *_family("openrld_trainer_busy", "gauge", "1 while the trainer runs an operation.",
                 per_group(lambda g: g.trainer.busy)),
        *_family("openrld_trainer_operations_total", "counter", "Training operations finished, by outcome.",
                 per_outcome(lambda g: g.trainer.ops_done, lambda g: g.trainer.ops_failed)),
        *_family("openrld_sampler_queue_depth", "gauge", "Sample requests queued for the base model's sampler.",
                 per_group(lambda g: g.sampler.queue_depth)),
        *_family("openrld_sampler_busy", "gauge", "1 while the sampler runs a batch.",
                 per_group(lambda g: g.sampler.busy)),
        *_family("openrld_sampler_loaded_weight_versions", "gauge", "Weight versions resident in the sampler engine.",
                 per_group(lambda g: g.sampler.loaded_versions)),
        *_family("openrld_sampler_requests_total", "counter", "Sample requests finished, by outcome.",
                 per_outcome(lambda g: g.sampler.samples_done, lambda g: g.sampler.samples_failed)),
        *_family("openrld_sampler_replicas", "gauge", "Sampler engines draining the base model's sampling queue.",
                 per_group(lambda g: g.sampler.replicas)),
        *_family("openrld_sampler_replica_requests_total", "counter", "Sample requests each sampler replica finished.",
                 [((("base_model", g.base_model), ("replica", str(i))), float(n))
                  for g in groups for i, n in enumerate(g.sampler.requests_by_replica)]),
        *_family("openrld_sampler_routed_requests_total", "counter",
                 "Sample requests routed to a replica that had served a prefix of their prompt (by prefix), "
                 "or not (by load).",
                 [((("base_model", g.base_model), ("by", by)), float(n))
                  for g in groups if g.sampler.replicas > 1
                  for by, n in (("prefix", g.sampler.routed_by_prefix), ("load", g.sampler.routed_by_load))]),
        *_family("openrld_sampler_prompt_tokens_total", "counter",
                 "Prompt tokens of the sample requests taken into engines.",
                 per_group(lambda g: g.sampler.prompt_tokens)),
        *_family("openrld_sampler_prompt_cache_hit_tokens_total", "counter",
                 "Prompt tokens the sampler engines reused from a cache instead of prefilling them.",
                 per_group(lambda g: g.sampler.prompt_cache_hit_tokens)),
        *_family("openrld_device_lease_seconds_total", "counter",
                 "Time each worker held its device under the time-slicer's lease.",
                 [((("base_model", g.base_model), ("worker", role), ("device", lease_of.device)), lease_of.lease.lease_s)
                  for g in groups for role, lease_of in (("trainer", g.trainer), ("sampler", g.sampler))
                  if lease_of.lease is not None]),
        *_family("openrld_weight_syncs_total", "counter", "Weight syncs from trainer to sampler that landed.",
                 per_group(lambda g: g.sampler.syncs)),
        *_family("openrld_weight_sync_bytes_total", "counter",
                 "Bytes those syncs moved: changed elements and their indices (delta) or whole tensors (full).",
                 per_group(lambda g: g.sampler.sync_bytes)),
        *_family("openrld_weight_sync_changed_fraction", "gauge",
                 "Fraction of the weights' elements the last sync changed (0 before the first).",
                 # At 0 before the first sync, like the counters beside it: a group's panel has a series at once.
                 per_group(lambda g: g.sampler.last_sync.changed_fraction if g.sampler.last_sync is not None else 0)),
        *_family("openrld_device_parks_total", "counter",
                 "Times the time-slicer parked each worker to give its device to another.",
                 [((("base_model", g.base_model), ("worker", role), ("device", lease_of.device)), lease_of.lease.parks)
                  for g in groups for role, lease_of in (("trainer", g.trainer), ("sampler", g.sampler))
                  if lease_of.lease is not None]),
    ]


def render_prometheus(stats: NodeStatistics) -> str:
    """The Prometheus text exposition (format 0.0.4) of one node's statistics."""
    futures, store = stats.futures, stats.store
    lines = [
        *_family("openrld_build_info", "gauge", "Always 1; the label carries the server version.",
                 [((("version", stats.version),), 1)]),
        *_request_lines(stats.requests),
        *_family("openrld_futures_pending", "gauge", "Requests accepted whose result is not ready yet.",
                 [((), futures.pending)]),
        *_family("openrld_futures_held", "gauge", "Results held for retrieve_future, pending or done.",
                 [((), futures.held)]),
        *_family("openrld_futures_completed_total", "counter", "Requests that completed.", [((), futures.completed)]),
        *_family("openrld_futures_failed_total", "counter", "Requests that failed.", [((), futures.failed)]),
        *_group_lines(stats.groups),
        *_family("openrld_store_sessions", "gauge", "Sessions in the store.", [((), store.sessions)]),
        *_family("openrld_store_training_runs", "gauge", "Training runs in the store.", [((), store.runs)]),
        *_family("openrld_store_samplers", "gauge", "Sampling sessions in the store.", [((), store.samplers)]),
        *_family("openrld_store_checkpoints", "gauge", "Checkpoints in the store.", [((), store.checkpoints)]),
        *_family("openrld_store_checkpoint_bytes", "gauge", "Bytes of checkpoint files.", [((), store.checkpoint_bytes)]),
        *_family("openrld_store_pending_requests", "gauge", "Requests logged as pending in the store.",
                 [((), store.pending_requests)]),
        *_host_memory_lines(stats.host_memory, stats.groups),
        *(_stability_lines(stats.stability) if stats.stability is not None else []),
        *(_gossip_lines(stats.membership) if stats.membership is not None else []),
        *_relay_lines(stats.relay),
        *(_http_lines(stats.http) if stats.http is not None else []),
        *(_loop_lines(stats.loop) if stats.loop is not None else []),
        *(_sdk_lines(stats.sdk_versions) if stats.sdk_versions is not None else []),
    ]
    return "\n".join(lines) + "\n"


# The parts of openrld_host_memory_bytes, always all three (at 0 until something is held).
HOST_MEMORY_PARTS = ("prefix_cache", "parked_state", "engine_state")


def _host_memory_lines(memory: HostMemoryStatistics, groups: list[GroupStatistics]) -> list[str]:
    per_part = {
        "prefix_cache": memory.prefix_cache_bytes, "parked_state": memory.parked_bytes, "engine_state": memory.state_bytes,
    }
    return [
        *_family("openrld_host_memory_budget_bytes", "gauge",
                 "The node's host-memory budget (host_memory_budget_bytes; with 0 there, half the machine's memory).",
                 [((), memory.budget_bytes)]),
        *_family("openrld_host_memory_rss_bytes", "gauge",
                 "The daemon process's resident set at this scrape (/proc/self/statm): everything it holds, "
                 "counted by the budget or not (Python, tokenizers, request bodies, allocator slack); "
                 "worker processes are not in it.",
                 [((), memory.rss_bytes)]),
        *_family("openrld_host_memory_bytes", "gauge",
                 "Host memory the budget counts, by part: prefix_cache (KV the torch samplers' prefix caches hold), "
                 "parked_state (device state a park copied into host memory; 0 on a CPU device, where nothing moves), "
                 "engine_state (weights, adapters, grads and optimizer state of engines on a CPU device: a trainer's "
                 "measured at its build and after each job's first optim_step, a sampler's at its build and when it "
                 "makes an adapter for a version). Not counted: engines in worker processes, activations and the KV "
                 "of running requests (in openrld_host_memory_rss_bytes only).",
                 [((("part", part),), per_part[part]) for part in HOST_MEMORY_PARTS]),
        *_family("openrld_host_memory_prefix_cache_share_bytes", "gauge",
                 "The most one torch sampler engine's prefix cache may hold now: an equal share of the budget "
                 "left after parked_state and engine_state, at most sampler_prefix_cache_bytes.",
                 [((), memory.prefix_cache_share_bytes)]),
        *_family("openrld_host_memory_spilled_bytes", "gauge",
                 "Parked device state written to disk (the data dir's parked/) because the budget had no room "
                 "for it in host memory; read back when its worker resumes.",
                 [((), memory.spilled_bytes)]),
        *_family("openrld_host_memory_over_budget_parks_total", "counter",
                 "Parks that left parked_state and engine_state past the budget: what could not be spilled to disk "
                 "(parking is never refused).",
                 [((), memory.over_budget_parks)]),
        *_family("openrld_engine_host_memory_bytes", "gauge",
                 "Host memory of each base model's workers, by worker (trainer, sampler) and part "
                 "(prefix_cache, parked_state, engine_state, as openrld_host_memory_bytes).",
                 [((("base_model", g.base_model), ("worker", worker), ("part", part)), value)
                  for g in groups
                  for worker, of in (("trainer", g.trainer.memory), ("sampler", g.sampler.memory))
                  for part, value in (("prefix_cache", of.prefix_cache_bytes), ("parked_state", of.parked_bytes),
                                      ("engine_state", of.state_bytes))
                  if worker == "sampler" or part != "prefix_cache"]),
    ]


def _sdk_lines(sdk: SdkVersionStatistics) -> list[str]:
    return _family(
        "openrld_sdk_requests_total", "counter",
        "HTTP requests by the tinker SDK release they name ('none': no SDK header; 'other': past the label cap).",
        [((("sdk_version", version),), count) for version, count in sdk.requests_by_version.items()],
    )


def _loop_lines(loop: LoopWatchStatistics) -> list[str]:
    return [
        *_family("openrld_loop_slow_steps_total", "counter",
                 f"Event-loop task steps longer than {loop.threshold_s * 1000:g} ms (loop_watch_ms).",
                 [((), loop.slow_steps)]),
        *_family("openrld_loop_longest_step_seconds", "gauge", "The longest event-loop task step seen.",
                 [((), loop.longest_step_s)]),
    ]


def _http_lines(http: HttpStatistics) -> list[str]:
    return [
        *_family("openrld_http_connections_open", "gauge", "HTTP connections open now.", [((), http.open_connections)]),
        *_family("openrld_http_connections_refused_total", "counter",
                 "Connections closed at once because max_connections were open.", [((), http.refused_connections)]),
        *_family("openrld_http_connection_timeouts_total", "counter",
                 "Connections closed on a deadline, by the phase it ran out in.",
                 [((("phase", phase),), http.timeouts.get(phase, 0)) for phase in HTTP_TIMEOUT_PHASES]),
    ]


def _relay_lines(relay: RelayStatistics) -> list[str]:
    return [
        *_family("openrld_relayed_requests_total", "counter", "Requests relayed to their home node, by outcome.",
                 [((("outcome", "answered"),), relay.relayed - relay.unreachable),
                  ((("outcome", "unreachable"),), relay.unreachable)]),
        *_family("openrld_lost_answers_total", "counter", "Requests answered 410: their home node is dead or gone.",
                 [((), relay.lost)]),
        *_family("openrld_placements_total", "counter", "Placement offers, by outcome (refused: no room there).",
                 [((("outcome", "placed"),), relay.placed), ((("outcome", "refused"),), relay.refused)]),
        *_family("openrld_adoptions_total", "counter",
                 "Jobs this node took over from their dead home node, from its auto-save on the shared root.",
                 [((), relay.adopted)]),
        *_family("openrld_replayed_requests_total", "counter",
                 "Requests kept for a dead home node and replayed on its job's adopter, by outcome "
                 "(lost: unsound to replay; the client was told what was lost).",
                 [((("outcome", "replayed"),), relay.replayed), ((("outcome", "lost"),), relay.unreplayable)]),
    ]


def _gossip_lines(gossip: MembershipStatistics) -> list[str]:
    return [
        *_family("openrld_gossip_members", "gauge", "Cluster members as this node sees them, by state.",
                 [((("state", state),), count) for state, count in
                  (("alive", gossip.alive), ("suspect", gossip.suspect), ("dead", gossip.dead), ("left", gossip.left))]),
        *_family("openrld_gossip_awareness_score", "gauge",
                 "Lifeguard local health: 0 is healthy; higher stretches this node's probe timeouts.",
                 [((), gossip.awareness_score)]),
        *_family("openrld_gossip_packets_total", "counter", "Gossip datagrams, by direction.",
                 [((("direction", "sent"),), gossip.packets_sent), ((("direction", "received"),), gossip.packets_received)]),
        *_family("openrld_gossip_bytes_total", "counter", "Gossip datagram bytes, by direction.",
                 [((("direction", "sent"),), gossip.bytes_sent), ((("direction", "received"),), gossip.bytes_received)]),
        *_family("openrld_gossip_dropped_total", "counter",
                 "Datagrams and push-pull bodies dropped, by reason (a bad or missing cluster tag among them).",
                 [((("reason", reason),), count) for reason, count in sorted(_every_drop_reason(gossip.dropped).items())]),
        *_family("openrld_gossip_push_pulls_total", "counter", "Full-state push-pull exchanges, by outcome.",
                 [((("outcome", "ok"),), gossip.push_pulls_ok), ((("outcome", "failed"),), gossip.push_pulls_failed)]),
        *_family("openrld_gossip_refutations_total", "counter",
                 "Times this node refuted a suspicion of itself (a sign of its own packet loss or slowness).",
                 [((), gossip.refutations)]),
        *_family("openrld_gossip_stale_accusations_answered_total", "counter",
                 "Times this node sent a member's newer Alive back to a node that still accused it.",
                 [((), gossip.stale_accusations_answered)]),
    ]


def _every_drop_reason(dropped: dict[str, int]) -> dict[str, int]:
    """Every reason the codec names, at 0 until counted: a counter's series exists before its first
    increment, so that rate() and alerts on it work from the start (and a dashboard finds it)."""
    return {**{reason.value: 0 for reason in DropReason}, **dropped}


def _stability_lines(stability: StabilityStatistics) -> list[str]:
    return [
        *_family("openrld_stability_records", "gauge", "Sampled sequences recorded for stable_reinforce.",
                 [((), stability.records)]),
        *_family("openrld_stability_recorded_tokens", "gauge", "Prompt and sampled tokens those records hold.",
                 [((), stability.recorded_tokens)]),
        *_family("openrld_stability_records_dropped_total", "counter",
                 "Records dropped, by why: a day unused (expired) or past the memory bound (evicted).",
                 [((("reason", "expired"),), stability.expired), ((("reason", "evicted"),), stability.evicted)]),
    ]
