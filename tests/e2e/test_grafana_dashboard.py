"""config/grafana/openrld-dashboard.json: it loads as Grafana reads it, and every series it names exists.

The series are checked against a real scrape: one clustered node (so that its
gossip and relay series exist) on which the real SDK has trained a LoRA job
and a full fine-tuning job (whose weight sync the dashboard plots) and
sampled from both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_config
from tests.e2e.console_support import datum

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana" / "openrld-dashboard.json"
SERIES = re.compile(r"\bopenrld_[a-z0-9_]+")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_every_panel_queries_the_chosen_prometheus_data_source():
    dashboard = load()
    [source] = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]


def test_panels_have_unique_ids_and_fit_the_24_column_grid():
    panels = load()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)


def test_every_query_is_filtered_by_the_node_variable():
    for expr in exprs(load()):
        for name in SERIES.findall(expr):
            assert re.search(re.escape(name) + r'\{instance=~"\$instance"', expr), expr


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> str:
    root = tmp_path_factory.mktemp("grafana")
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama},
        'node_name = "node-a"\ncluster_secret = "test-cluster-secret"\ngossip_port = 0\ngossip_timing = "local"\n'
        "longpoll_s = 3.0\n",
    )
    node = Daemon(root / "data", config, root / "daemon.log").start()
    try:
        service = tinker.ServiceClient(base_url=node.url, api_key="tml-test")
        for metadata in ({}, {"openrl.fine_tuning_type": "full"}):
            training = service.create_lora_training_client(base_model="tiny-llama", rank=4, user_metadata=metadata).result()
            training.forward_backward([datum(list(range(5, 17)))], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            sampler = training.save_weights_and_get_sampling_client().result()
            sampler.sample(types.ModelInput.from_ints([7, 8, 9]), 1, types.SamplingParams(max_tokens=2, stop=[])).result()
        scraped = httpx.get(node.url + "/metrics", timeout=30).text  # before the close ends the full job's group
        service.close("success").result()
        return scraped
    finally:
        node.stop()


def test_every_series_the_dashboard_names_is_in_a_scrape_of_a_node_that_trained_and_sampled(scrape: str):
    scraped = {line.split("{", 1)[0].split(" ", 1)[0] for line in scrape.splitlines() if line and not line.startswith("#")}
    named = {name for expr in exprs(load()) for name in SERIES.findall(expr)}
    assert len(named) == 20
    assert sorted(named - scraped) == []
