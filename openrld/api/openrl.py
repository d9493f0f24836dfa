"""The openrl API: discovery (`GET /openrl/v1/info`) and metrics (`GET /metrics`).

`/openrl/v1/info` tells a person or an agent what this node is: its version,
the Tinker SDK version it speaks, its limits, the JSON Schema of the
`openrl.*` settings, the losses and backends it has, the models it serves
(the same list as `get_server_capabilities`) and its devices. It needs an API
key, like every Tinker route that lists models.

`/metrics` is the Prometheus text exposition of the node's counters and the
actors' and store's statistics. It needs no key, so that a scraper can read
it as Prometheus scrapes anything; it carries counts labelled by route and
base model, never a client's ids or data.

`/openrl/v1/models/{model_id}/status` is one training job's state, workers,
queues and progress (actors/model_status.py); like every model route, a
caller sees only their own models.

These routes only read statistics; they change nothing.
"""

from __future__ import annotations

from openrld import __version__
from openrld.actors.host_memory import NO_HOST_MEMORY
from openrld.api.app import Services, caller
from openrld.api.asgi import Reply, json_reply
from openrld.api.capabilities import Limits, ModelSummary, server_info
from openrld.api.metrics import CONTENT_TYPE, NodeStatistics, render_prometheus


def node_limits(services: Services) -> Limits:
    config = services.config
    return Limits(
        max_batch_tokens=config.max_batch_tokens,
        max_num_samples=config.max_num_samples,
        max_lora_rank=config.max_lora_rank,
        sample_queue_limit=config.sample_queue_limit,
        max_body_bytes=config.max_body_bytes,
        longpoll_s=config.longpoll_s,
    )


def served_models(services: Services) -> tuple[ModelSummary, ...]:
    """The models get_server_capabilities lists, in the same order."""
    return tuple(
        ModelSummary(
            model_name=m.entry.name, arch=m.entry.arch, max_context_length=m.entry.max_context,
            source=m.source, ready=m.is_ready, preparing=services.catalog.progress(m.entry.name),
        )
        for m in services.catalog.listed()
    )




async def info(services: Services) -> Reply:
    caller(services)
    return json_reply(
        server_info(
            limits=node_limits(services),
            models=served_models(services),
            devices=services.devices,
            is_open_mode=services.auth.is_open,
            has_automodel=bool(services.config.workers.automodel_python),
        )
    )


async def model_status(services: Services, model_id: str) -> Reply:
    return json_reply(services.jobs.model_status(caller(services), model_id))


async def metrics(services: Services) -> Reply:
    stats = NodeStatistics(
        version=__version__,
        requests=services.metrics.statistics(),
        futures=services.futures.statistics(),
        groups=services.groups.statistics(),
        store=services.records.statistics(),
        stability=services.groups.stability.statistics(),
        membership=services.cluster.membership.statistics() if services.cluster is not None else None,
        relay=services.relays.statistics(),  # zero outside a cluster, still rendered: see NodeStatistics.relay
        http=services.http.statistics(),
        loop=services.loop_watch.statistics() if services.loop_watch is not None else None,
        sdk_versions=services.sdk_versions.statistics(),
        host_memory=ledger.statistics() if (ledger := services.groups.host_memory) is not None else NO_HOST_MEMORY,
    )
    return Reply(render_prometheus(stats).encode(), content_type=CONTENT_TYPE)
