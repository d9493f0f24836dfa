"""Request counting and the Prometheus text exposition, as pure functions."""

from __future__ import annotations

import textwrap

import msgspec

from openrld.actors.futures import FutureStatistics
from openrld.actors.groups import GroupStatistics
from openrld.actors.sampler import SamplerStatistics
from openrld.actors.stability import StabilityStatistics
from openrld.actors.trainer import JobQueueStats, TrainerStatistics
from openrld.api.metrics import LATENCY_BUCKETS_S, HttpCounters, NodeStatistics, RequestMetrics, render_prometheus
from openrld.api.sdk_versions import SdkVersionCounter, SdkVersionStatistics
from openrld.batches import SyncStats
from openrld.cluster.membership.node import MembershipStatistics
from openrld.cluster.peer_client import RelayCounters, RelayStatistics
from openrld.loop_watch import LoopWatchStatistics
from openrld.store import StoreStatistics


def test_observe_counts_by_status_and_buckets_latency():
    metrics = RequestMetrics()
    metrics.observe("/api/v1/healthz", "GET", 200, 0.004)  # first bucket (<= 0.005)
    metrics.observe("/api/v1/healthz", "GET", 200, 0.005)  # a bound is inclusive: still the first
    metrics.observe("/api/v1/healthz", "GET", 503, 60.0)  # over the top bound: the overflow slot
    [stats] = metrics.statistics()
    assert (stats.endpoint, stats.method, stats.by_status) == ("/api/v1/healthz", "GET", {200: 2, 503: 1})
    assert stats.bucket_counts == (2,) + (0,) * (len(LATENCY_BUCKETS_S) - 1) + (1,)
    assert stats.seconds_sum == 0.004 + 0.005 + 60.0


def test_unknown_methods_collapse_to_one_label():
    metrics = RequestMetrics()
    metrics.observe("unmatched", "BREW", 405, 0.0)
    metrics.observe("unmatched", "PROPFIND", 405, 0.0)
    assert [(s.method, s.by_status) for s in metrics.statistics()] == [("other", {405: 2})]


def _node(requests: RequestMetrics) -> NodeStatistics:
    trainer = TrainerStatistics(
        jobs=[
            JobQueueStats(model_id="s:train:0", next_seq_id=4, waiting=2),
            JobQueueStats(model_id="s:train:1", next_seq_id=1, waiting=1),
        ],
        ops_done=7, ops_failed=1, ops_combined=0, busy=True, adapters_loaded=2,
    )
    sampler = SamplerStatistics(
        queue_depth=5, waiting=4, running=1, replicas=1, loaded_versions=2, host_versions=0,
        samples_done=9, samples_failed=0, samples_cancelled=0, samples_refused=0, busy=False,
        requests_by_replica=(9,),
    )
    return NodeStatistics(
        version="0.1.0",
        requests=requests.statistics(),
        futures=FutureStatistics(pending=3, completed=10, failed=2, held=15),
        groups=[GroupStatistics(base_model='we"ird\\name', trainer=trainer, sampler=sampler)],
        store=StoreStatistics(sessions=1, runs=2, samplers=3, checkpoints=4, checkpoint_bytes=5000, pending_requests=6),
    )


def test_render_is_the_prometheus_text_format():
    requests = RequestMetrics()
    requests.observe("/api/v1/asample", "POST", 429, 0.02)
    text = render_prometheus(_node(requests))
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[:4] == [
        "# HELP openrld_build_info Always 1; the label carries the server version.",
        "# TYPE openrld_build_info gauge",
        'openrld_build_info{version="0.1.0"} 1',
        "# HELP openrld_http_requests_total HTTP requests answered, by endpoint, method and status.",
    ]
    assert 'openrld_http_requests_total{endpoint="/api/v1/asample",method="POST",status="429"} 1' in lines
    base = 'endpoint="/api/v1/asample",method="POST"'
    # 0.02 s falls in the 0.025 bucket; buckets are cumulative.
    assert f'openrld_http_request_duration_seconds_bucket{{{base},le="0.01"}} 0' in lines
    assert f'openrld_http_request_duration_seconds_bucket{{{base},le="0.025"}} 1' in lines
    assert f'openrld_http_request_duration_seconds_bucket{{{base},le="+Inf"}} 1' in lines
    assert f"openrld_http_request_duration_seconds_sum{{{base}}} 0.02" in lines
    assert f"openrld_http_request_duration_seconds_count{{{base}}} 1" in lines


def test_render_reports_queue_depths_per_base_model_with_escaped_labels():
    text = render_prometheus(_node(RequestMetrics()))
    label = 'base_model="we\\"ird\\\\name"'
    expected = textwrap.dedent(
        f"""\
        openrld_trainer_jobs{{{label}}} 2
        openrld_trainer_adapters_loaded{{{label}}} 2
        openrld_trainer_queue_depth{{{label}}} 3
        openrld_trainer_busy{{{label}}} 1
        openrld_trainer_operations_total{{{label},outcome="done"}} 7
        openrld_trainer_operations_total{{{label},outcome="failed"}} 1
        openrld_sampler_queue_depth{{{label}}} 5
        openrld_sampler_busy{{{label}}} 0
        openrld_sampler_loaded_weight_versions{{{label}}} 2
        openrld_sampler_requests_total{{{label},outcome="done"}} 9
        openrld_sampler_requests_total{{{label},outcome="failed"}} 0
        openrld_sampler_replicas{{{label}}} 1
        openrld_sampler_replica_requests_total{{{label},replica="0"}} 9
        openrld_sampler_prompt_tokens_total{{{label}}} 0
        openrld_sampler_prompt_cache_hit_tokens_total{{{label}}} 0
        openrld_weight_syncs_total{{{label}}} 0
        openrld_weight_sync_bytes_total{{{label}}} 0
        openrld_weight_sync_changed_fraction{{{label}}} 0
        openrld_engine_host_memory_bytes{{{label},worker="trainer",part="parked_state"}} 0
        openrld_engine_host_memory_bytes{{{label},worker="trainer",part="engine_state"}} 0
        openrld_engine_host_memory_bytes{{{label},worker="sampler",part="prefix_cache"}} 0
        openrld_engine_host_memory_bytes{{{label},worker="sampler",part="parked_state"}} 0
        openrld_engine_host_memory_bytes{{{label},worker="sampler",part="engine_state"}} 0
        """
    ).splitlines()
    assert [line for line in text.splitlines() if "base_model=" in line] == expected


def test_render_reports_futures_and_store():
    samples = {
        line.split(" ")[0]: line.split(" ")[1]
        for line in render_prometheus(_node(RequestMetrics())).splitlines()
        if line.startswith(("openrld_futures_", "openrld_store_"))
    }
    assert samples == {
        "openrld_futures_pending": "3",
        "openrld_futures_held": "15",
        "openrld_futures_completed_total": "10",
        "openrld_futures_failed_total": "2",
        "openrld_store_sessions": "1",
        "openrld_store_training_runs": "2",
        "openrld_store_samplers": "3",
        "openrld_store_checkpoints": "4",
        "openrld_store_checkpoint_bytes": "5000",
        "openrld_store_pending_requests": "6",
    }


def test_render_counts_routed_requests_only_where_a_sampler_has_replicas_to_route_between():
    node = _node(RequestMetrics())
    [group] = node.groups
    sampler = msgspec.structs.replace(group.sampler, replicas=2, routed_by_prefix=6, routed_by_load=2)
    two = msgspec.structs.replace(node, groups=[msgspec.structs.replace(group, base_model="m", sampler=sampler)])
    assert [line for line in render_prometheus(two).splitlines() if line.startswith("openrld_sampler_routed")] == [
        'openrld_sampler_routed_requests_total{base_model="m",by="prefix"} 6',
        'openrld_sampler_routed_requests_total{base_model="m",by="load"} 2',
    ]
    # One replica: nothing to route, so no sample (the family's HELP and TYPE lines stay).
    assert not [line for line in render_prometheus(node).splitlines() if line.startswith("openrld_sampler_routed")]


def test_render_counts_weight_syncs_and_their_bytes_with_the_last_changed_fraction():
    node = _node(RequestMetrics())
    [group] = node.groups
    last = SyncStats(mode="delta", changed_fraction=0.125, bytes_moved=600, full_bytes=4000, dense_tensors=0,
                     compute_s=0.01)
    sampler = msgspec.structs.replace(group.sampler, syncs=3, sync_bytes=1800, last_sync=last)
    node = msgspec.structs.replace(node, groups=[msgspec.structs.replace(group, base_model="m", sampler=sampler)])
    lines = render_prometheus(node).splitlines()
    assert [line for line in lines if line.startswith("openrld_weight_sync")] == [
        'openrld_weight_syncs_total{base_model="m"} 3',
        'openrld_weight_sync_bytes_total{base_model="m"} 1800',
        'openrld_weight_sync_changed_fraction{base_model="m"} 0.125',
    ]


def test_render_reports_gossip_health_only_on_a_clustered_node():
    assert "openrld_gossip" not in render_prometheus(_node(RequestMetrics()))
    gossip = MembershipStatistics(
        name="a", incarnation=2, alive=3, suspect=1, dead=1, left=0, awareness_score=2, packets_sent=100,
        bytes_sent=9000, packets_received=90, bytes_received=8000, dropped={"bad_tag": 4}, push_pulls_ok=5,
        push_pulls_failed=1, refutations=1, stale_accusations_answered=2, queued_broadcasts=0,
    )
    node = msgspec.structs.replace(_node(RequestMetrics()), membership=gossip)
    lines = [line for line in render_prometheus(node).splitlines() if line.startswith("openrld_gossip")]
    assert lines == [
        'openrld_gossip_members{state="alive"} 3',
        'openrld_gossip_members{state="suspect"} 1',
        'openrld_gossip_members{state="dead"} 1',
        'openrld_gossip_members{state="left"} 0',
        "openrld_gossip_awareness_score 2",
        'openrld_gossip_packets_total{direction="sent"} 100',
        'openrld_gossip_packets_total{direction="received"} 90',
        'openrld_gossip_bytes_total{direction="sent"} 9000',
        'openrld_gossip_bytes_total{direction="received"} 8000',
        # Every reason the codec names is there at 0 before its first drop, sorted by name.
        'openrld_gossip_dropped_total{reason="bad_tag"} 4',
        'openrld_gossip_dropped_total{reason="bad_version"} 0',
        'openrld_gossip_dropped_total{reason="too_large"} 0',
        'openrld_gossip_dropped_total{reason="too_short"} 0',
        'openrld_gossip_dropped_total{reason="undecodable"} 0',
        'openrld_gossip_push_pulls_total{outcome="ok"} 5',
        'openrld_gossip_push_pulls_total{outcome="failed"} 1',
        "openrld_gossip_refutations_total 1",
        "openrld_gossip_stale_accusations_answered_total 2",
    ]


def test_render_reports_relaying_and_placement():
    node = msgspec.structs.replace(_node(RequestMetrics()), relay=RelayStatistics(10, 2, 1, 4, 3))
    names = ("openrld_relayed", "openrld_lost", "openrld_placements")
    lines = [line for line in render_prometheus(node).splitlines() if line.startswith(names)]
    assert lines == [
        'openrld_relayed_requests_total{outcome="answered"} 8',
        'openrld_relayed_requests_total{outcome="unreachable"} 2',
        "openrld_lost_answers_total 1",
        'openrld_placements_total{outcome="placed"} 4',
        'openrld_placements_total{outcome="refused"} 3',
    ]


def test_render_reports_open_refused_and_timed_out_http_connections():
    counters = HttpCounters()
    counters.open_connections, counters.refused_connections = 7, 3
    counters.timeouts["head"], counters.timeouts["write"] = 5, 1
    node = msgspec.structs.replace(_node(RequestMetrics()), http=counters.statistics())
    lines = [line for line in render_prometheus(node).splitlines() if line.startswith("openrld_http_")]
    assert lines == [
        "openrld_http_connections_open 7",
        "openrld_http_connections_refused_total 3",
        'openrld_http_connection_timeouts_total{phase="head"} 5',
        'openrld_http_connection_timeouts_total{phase="body"} 0',
        'openrld_http_connection_timeouts_total{phase="keep_alive"} 0',
        'openrld_http_connection_timeouts_total{phase="discard"} 0',
        'openrld_http_connection_timeouts_total{phase="write"} 1',
    ]


def test_render_reports_slow_event_loop_steps_only_when_the_watch_is_on():
    assert "openrld_loop_" not in render_prometheus(_node(RequestMetrics()))
    node = msgspec.structs.replace(
        _node(RequestMetrics()), loop=LoopWatchStatistics(threshold_s=0.05, slow_steps=2, longest_step_s=0.25)
    )
    lines = [line for line in render_prometheus(node).splitlines() if "openrld_loop_" in line]
    assert lines == [
        "# HELP openrld_loop_slow_steps_total Event-loop task steps longer than 50 ms (loop_watch_ms).",
        "# TYPE openrld_loop_slow_steps_total counter",
        "openrld_loop_slow_steps_total 2",
        "# HELP openrld_loop_longest_step_seconds The longest event-loop task step seen.",
        "# TYPE openrld_loop_longest_step_seconds gauge",
        "openrld_loop_longest_step_seconds 0.25",
    ]


def test_render_counts_requests_by_the_sdk_release_they_name():
    node = msgspec.structs.replace(
        _node(RequestMetrics()), sdk_versions=SdkVersionStatistics({"0.16.1": 4, "0.38.0": 9, "none": 2})
    )
    lines = [line for line in render_prometheus(node).splitlines() if line.startswith("openrld_sdk_")]
    assert lines == [
        'openrld_sdk_requests_total{sdk_version="0.16.1"} 4',
        'openrld_sdk_requests_total{sdk_version="0.38.0"} 9',
        'openrld_sdk_requests_total{sdk_version="none"} 2',
    ]


def test_a_fresh_node_outside_a_cluster_exports_every_counter_and_its_fixed_labels_at_zero():
    # As api/openrl.py gathers it on a node that has answered nothing and started no group yet.
    fresh = NodeStatistics(
        version="0.1.0",
        requests=RequestMetrics().statistics(),
        futures=FutureStatistics(pending=0, completed=0, failed=0, held=0),
        groups=[],
        store=StoreStatistics(sessions=0, runs=0, samplers=0, checkpoints=0, checkpoint_bytes=0, pending_requests=0),
        stability=StabilityStatistics(records=0, recorded_tokens=0, recorded_total=0, expired=0, evicted=0,
                                      resolved_sequences=0),
        relay=RelayCounters().statistics(),
        http=HttpCounters().statistics(),
        sdk_versions=SdkVersionCounter().statistics(),
    )
    samples = [line for line in render_prometheus(fresh).splitlines() if not line.startswith("#")]
    assert samples == [
        'openrld_build_info{version="0.1.0"} 1',
        "openrld_futures_pending 0",
        "openrld_futures_held 0",
        "openrld_futures_completed_total 0",
        "openrld_futures_failed_total 0",
        "openrld_store_sessions 0",
        "openrld_store_training_runs 0",
        "openrld_store_samplers 0",
        "openrld_store_checkpoints 0",
        "openrld_store_checkpoint_bytes 0",
        "openrld_store_pending_requests 0",
        "openrld_host_memory_budget_bytes 0",
        "openrld_host_memory_rss_bytes 0",
        'openrld_host_memory_bytes{part="prefix_cache"} 0',
        'openrld_host_memory_bytes{part="parked_state"} 0',
        'openrld_host_memory_bytes{part="engine_state"} 0',
        "openrld_host_memory_prefix_cache_share_bytes 0",
        "openrld_host_memory_spilled_bytes 0",
        "openrld_host_memory_over_budget_parks_total 0",
        "openrld_stability_records 0",
        "openrld_stability_recorded_tokens 0",
        'openrld_stability_records_dropped_total{reason="expired"} 0',
        'openrld_stability_records_dropped_total{reason="evicted"} 0',
        'openrld_relayed_requests_total{outcome="answered"} 0',
        'openrld_relayed_requests_total{outcome="unreachable"} 0',
        "openrld_lost_answers_total 0",
        'openrld_placements_total{outcome="placed"} 0',
        'openrld_placements_total{outcome="refused"} 0',
        "openrld_adoptions_total 0",
        'openrld_replayed_requests_total{outcome="replayed"} 0',
        'openrld_replayed_requests_total{outcome="lost"} 0',
        "openrld_http_connections_open 0",
        "openrld_http_connections_refused_total 0",
        'openrld_http_connection_timeouts_total{phase="head"} 0',
        'openrld_http_connection_timeouts_total{phase="body"} 0',
        'openrld_http_connection_timeouts_total{phase="keep_alive"} 0',
        'openrld_http_connection_timeouts_total{phase="discard"} 0',
        'openrld_http_connection_timeouts_total{phase="write"} 0',
    ]


def test_a_group_reports_a_weight_sync_changed_fraction_of_zero_before_its_first_sync():
    node = _node(RequestMetrics())
    assert node.groups[0].sampler.last_sync is None
    lines = render_prometheus(node).splitlines()
    assert 'openrld_weight_sync_changed_fraction{base_model="we\\"ird\\\\name"} 0' in lines
