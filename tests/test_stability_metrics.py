"""/metrics reports the stable_reinforce stability records (actors/stability.py)."""

from __future__ import annotations

import msgspec

from openrld.actors.stability import StabilityStatistics
from openrld.api.metrics import RequestMetrics, render_prometheus
from tests.test_metrics import _node


def test_render_reports_stability_records_and_why_they_were_dropped():
    stability = StabilityStatistics(
        records=4, recorded_tokens=40, recorded_total=7, expired=2, evicted=1, resolved_sequences=3
    )
    text = render_prometheus(msgspec.structs.replace(_node(RequestMetrics()), stability=stability))
    lines = [line for line in text.splitlines() if line.startswith("openrld_stability_")]
    assert lines == [
        "openrld_stability_records 4",
        "openrld_stability_recorded_tokens 40",
        'openrld_stability_records_dropped_total{reason="expired"} 2',
        'openrld_stability_records_dropped_total{reason="evicted"} 1',
    ]


def test_a_node_without_stability_statistics_renders_no_stability_lines():
    assert "openrld_stability_" not in render_prometheus(_node(RequestMetrics()))
