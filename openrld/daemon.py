"""The node daemon: one trio root nursery holding the store, the actors and the HTTP front.

`serve(config)` opens the store, starts the future table, the group and job
tables and hypercorn, and reports the bound address through `task_status`
only once the server accepts connections. Shutdown is a cancel of that
nursery: the server stops taking requests, pending long-polls answer 503, and
the store is closed after every actor has stopped, so no half-written
checkpoint is ever visible (checkpoints are written to a staging directory
and renamed into place).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import hypercorn.config
import hypercorn.trio
import msgspec
import trio

from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.futures import FutureTable
from openrld.actors.groups import GroupTable
from openrld.actors.jobs import JobTable
from openrld.actors.maintenance import run_maintenance
from openrld.actors.usage import UsageMeter
from openrld.api.app import Services, build_app
from openrld.api.auth import Authenticator
from openrld.api.signing import Signer
from openrld.capabilities import DeviceSummary
from openrld.config import NodeConfig, load_api_keys
from openrld.model_catalog import ModelCatalog
from openrld.store import Store

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3.0  # in-flight requests get this long to answer; pending long-polls answer 503 at once


def _hypercorn_config(config: NodeConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = GRACEFUL_SHUTDOWN_S
    hc.keep_alive_timeout = 75.0  # longer than the SDK's 45 s long-poll, so polls reuse connections
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def serve(
    config: NodeConfig,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one node until `shutdown` is set (or the caller cancels); report the bound URL when ready."""
    from openrld.gpu.devices import describe, resolve_device
    from openrld.gpu.engines import TorchEngineFactory

    device = resolve_device(config.device)
    keys = load_api_keys(config.api_keys_file) if config.api_keys_file is not None else None
    store = Store.open(Path(config.data_dir))
    try:
        async with trio.open_nursery() as nursery:
            futures = FutureTable(store)
            groups = GroupTable(
                nursery=nursery,
                engines=TorchEngineFactory(device, max_batch_tokens=config.max_batch_tokens),
                limiter=trio.CapacityLimiter(1),
                futures=futures,
                checkpoints=CheckpointWriter(store),
                sample_queue_limit=config.sample_queue_limit,
            )
            catalog = ModelCatalog({name: str(path) for name, path in config.models.items()})
            usage = UsageMeter()
            signer = Signer()
            jobs = JobTable(
                nursery=nursery, store=store, catalog=catalog, groups=groups, futures=futures,
                max_lora_rank=config.max_lora_rank, usage=usage,
            )
            # TTL expiry and usage flushes; cancelled with the nursery at shutdown (it flushes once more).
            await nursery.start(partial(run_maintenance, store, usage, interval_s=config.maintenance_interval_s))
            services = Services(
                config=config, auth=Authenticator(keys, jwt_signer=signer if config.jwt_auth else None),
                store=store, catalog=catalog, futures=futures, jobs=jobs, groups=groups, usage=usage, signer=signer,
                devices=(DeviceSummary(**msgspec.structs.asdict(describe(device))),),
            )
            stop = shutdown if shutdown is not None else trio.Event()
            async with trio.open_nursery() as front:
                binds = await front.start(
                    partial(hypercorn.trio.serve, build_app(services), _hypercorn_config(config), shutdown_trigger=stop.wait)
                )
                logger.info(
                    "openrld serving url=%s data_dir=%s device=%s open_mode=%s",
                    binds[0], config.data_dir, device, keys is None,
                )
                task_status.started(binds[0])
                await stop.wait()
                futures.close()  # pending long-polls answer 503 now, within hypercorn's graceful drain
            nursery.cancel_scope.cancel()
    finally:
        store.close()
