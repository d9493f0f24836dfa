"""The node daemon: one trio root nursery holding the store, the actors and the HTTP front.

`serve(config)` opens the store, starts the future table, the group and job
tables and the HTTP server (`api/http1.py`), and reports the bound address
through `task_status` only once the server accepts connections. Shutdown is a cancel of that
nursery: the server stops taking requests, pending long-polls answer 503, and
the store is closed after every actor has stopped, so no half-written
checkpoint is ever visible (checkpoints are written to a staging directory
and renamed into place).
"""

from __future__ import annotations

import gc
import logging
import ssl
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import httpx
import trio

from openrld import ids
from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.console_views import ConsoleViews
from openrld.actors.device_pool import NodeDevices
from openrld.actors.durable_commits import DurableCommits
from openrld.actors.futures import FutureTable
from openrld.actors.groups import GroupTable
from openrld.actors.host_memory import HostMemory, fresh_spill_dir, read_machine_memory_bytes, resolve_budget
from openrld.actors.job_registry import JobRegistry
from openrld.actors.jobs import JobTable
from openrld.actors.maintenance import run_maintenance
from openrld.actors.model_prep import prepare_models
from openrld.actors.records import Records
from openrld.actors.run_history import (
    MAX_POINTS_PER_RUN,
    MAX_SAMPLING_BUCKETS,
    SAMPLING_BUCKET_S,
    HistoryRecorder,
)
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.span_members import SpanMembers, SpanOrder
from openrld.actors.usage import UsageMeter
from openrld.api.app import Services, build_app
from openrld.api.auth import Authenticator
from openrld.api.capabilities import DeviceSummary
from openrld.api.http1 import Server
from openrld.api.signing import Signer
from openrld.cluster.adoption import AdoptionWatcher
from openrld.cluster.membership.messages import DeviceSlot, NodePayload
from openrld.cluster.membership.service import ClusterMembership, ClusterSettings, node_payload
from openrld.cluster.node import ClusterNode
from openrld.cluster.peer_client import RelayCounters, relay_key
from openrld.cluster.placement.span_peers import SpanPeers
from openrld.config import ConfigError, NodeConfig, load_api_keys
from openrld.loop_watch import LoopWatch
from openrld.model_catalog import ModelCatalog
from openrld.model_families import Engine
from openrld.store import Store
from openrld.tls import peer_context, server_context
from openrld.worker.client import WorkerTimeouts
from openrld.worker.hosting import WorkerHosting
from openrld.worker.launchers import Launcher, Mount
from openrld.worker.launchers.torchrun import SpanRendezvous, TorchrunGroup

if TYPE_CHECKING:
    from openrld.gpu.vllm_sampler import VllmSamplerConfig

logger = logging.getLogger(__name__)

MODEL_CACHE_DIR = "models"  # under the data dir: GGUF conversions (see model_catalog)
PARKED_SPILL_DIR = "parked"  # under the data dir: parked state written to disk past the host-memory budget
# Beyond max_connections: the store, checkpoint and model files, gossip, and relays to peers.
SPARE_FILE_DESCRIPTORS = 1024


def _vllm_config(config: NodeConfig) -> VllmSamplerConfig | None:
    """The vLLM engine's knobs when `sampler_backend = "vllm"`; vLLM is imported only then."""
    if config.sampler_backend != "vllm":
        return None
    from openrld.gpu.vllm_sampler import VllmSamplerConfig

    return VllmSamplerConfig(
        gpu_memory_utilization=config.vllm_gpu_memory_utilization, max_lora_rank=config.max_lora_rank
    )


def _worker_hosting(config: NodeConfig, store: Store) -> WorkerHosting:
    """Where engines run, as `[workers]` says: inproc, processes, the vLLM environment, images."""
    from openrld.cluster.membership.service import node_name_or_host_name
    from openrld.worker.launchers.process import ProcessLauncher

    workers = config.workers
    builtin = ProcessLauncher(workers.python) if workers.launcher == "process" else None
    vllm = ProcessLauncher(workers.vllm_python) if config.sampler_backend == "vllm" and workers.vllm_python else None
    images: Launcher | None = None
    node = node_name_or_host_name(config.node_name)
    if workers.allowed_images and workers.container_runtime == "kubernetes":
        from openrld.worker.launchers.pod import in_cluster

        images = in_cluster(node, workers.pod_name)
    elif workers.allowed_images:
        from openrld.worker.launchers.container import ContainerLauncher

        images = ContainerLauncher(
            cast('Literal["podman", "docker"]', workers.container_runtime), node, workers.container_run_args,
            global_args=workers.container_global_args,
        )
    checkpoints, staging = store.files.checkpoint_files
    return WorkerHosting(
        builtin=builtin, vllm=vllm, images=images, automodel_python=workers.automodel_python,
        socket_root=workers.socket_dir,
        timeouts=WorkerTimeouts(
            hello_s=workers.hello_timeout_s, heartbeat_s=workers.heartbeat_s,
            deadline_s=workers.heartbeat_timeout_s, stop_s=workers.stop_timeout_s,
        ),
        # A worker reads checkpoints (load_state) and writes them into staging, at the daemon's paths.
        mounts=(Mount(str(checkpoints), str(checkpoints), read_only=True), Mount(str(staging), str(staging), read_only=False)),
    )


def _raise_file_limit(config: NodeConfig) -> None:
    """Lift the soft limit on open files to what max_connections needs, as far as the hard limit allows.

    The usual soft limit (1024) is far under the default max_connections; past it, accept()
    fails and trio waits, so new clients hang instead of being served or refused.
    """
    import resource

    want = config.http.max_connections + SPARE_FILE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        if new_soft < want:
            logger.warning(
                "open-file limit %d is under max_connections=%d plus %d spare; raise LimitNOFILE (or ulimit -n) "
                "or lower [http] max_connections", new_soft, config.http.max_connections, SPARE_FILE_DESCRIPTORS,
            )


async def _open_membership(config: NodeConfig, verify: ssl.SSLContext | bool) -> ClusterMembership | None:
    """The node's cluster membership, its gossip port bound; None without a cluster secret."""
    if not config.cluster_secret:
        return None
    settings = ClusterSettings(
        node_name=config.node_name, cluster_secret=config.cluster_secret, seeds=config.join,
        bind_host=config.host, gossip_port=config.gossip_port, advertise_host=config.advertise_host,
        http_port=config.port, timing=config.gossip_timing, scheme="https" if config.is_tls else "http",
    )
    return await ClusterMembership.open(settings, verify=verify)


def _watch_loop(watch: LoopWatch) -> None:
    """Time every step of this trio run from now on, and report slow ones (loop_watch.py).

    Armed once the node is ready: no client can be waiting on it before, and startup
    (store recovery, building the routes) runs in order by design.
    """
    trio.lowlevel.add_instrument(watch)
    watch.start_sampler()
    logger.info("loop_watch: reporting event-loop steps over %g ms", watch.threshold_s * 1000)


async def serve(
    config: NodeConfig,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one node until `shutdown` is set (or the caller cancels); report the bound URL when ready."""
    from openrld.gpu.devices import apply_cpu_threads, cpu_threads, inventory, resolve_device
    from openrld.gpu.gguf_convert import GgufConverter
    from openrld.worker.engines import TorchEngineFactory

    try:
        device = resolve_device(config.device)
        device_records = inventory(config.devices, config.device)
    except ValueError as exc:  # a node told to use a GPU it does not have refuses to start, saying why
        raise ConfigError(str(exc)) from exc
    threads = cpu_threads(config.cpu_threads, device_records)
    apply_cpu_threads(threads)
    keys = load_api_keys(config.api_keys_file) if config.api_keys_file is not None else None
    tls = server_context(config)
    verify_peers = peer_context(config)
    _raise_file_limit(config)
    loop_watch = LoopWatch(config.loop_watch_ms / 1000) if config.loop_watch_ms else None
    store = Store.open(Path(config.data_dir), checkpoint_root=config.checkpoint_root)
    hosting = _worker_hosting(config, store)
    try:
        # What an earlier daemon of this node left running (a container, a Pod) goes first.
        await trio.to_thread.run_sync(hosting.reap)
        async with trio.open_nursery() as nursery:
            # Each run's curves for the console, fed by every settled request and written in a thread.
            history = HistoryRecorder(
                store.history_table(
                    max_points=MAX_POINTS_PER_RUN, max_buckets=MAX_SAMPLING_BUCKETS, bucket_s=SAMPLING_BUCKET_S
                ),
                sampler_run=partial(_sampler_run, store),
            )
            await nursery.start(history.run)
            futures = FutureTable(store.requests, observer=history.observe)
            await nursery.start(futures.run_log)
            lora_sampler = Engine.VLLM_SAMPLER if config.sampler_backend == "vllm" else Engine.TORCH_SAMPLER
            catalog = ModelCatalog(
                {name: str(path) for name, path in config.models.items()},
                cache_dir=Path(config.data_dir) / MODEL_CACHE_DIR,
                engines=(Engine.LORA_TRAINER, lora_sampler),  # never list a model a LoRA create would refuse
            )
            converter = GgufConverter(catalog.progress_board)
            # One time-slicer per device: groups sharing a device take turns on it.
            node_devices = await nursery.start(
                NodeDevices([d.name for d in device_records], quantum_s=config.timeslice_quantum_s).run
            )
            # The one group commit of the node's rows (store/database.py syncs in a thread, not per commit).
            commits = DurableCommits(store.database.sync)
            checkpoints = CheckpointWriter(store, commits)  # publishing, deleting, adopting: files in its threads
            groups = GroupTable(
                nursery=nursery,
                engines=TorchEngineFactory(
                    device, max_batch_tokens=config.max_batch_tokens,
                    activation_budget_bytes=config.activation_budget_bytes, converter=converter, vllm=_vllm_config(config),
                    cpu_threads=threads, hosting=hosting, prefix_cache_bytes=config.sampler_prefix_cache_bytes,
                    packed_weights=config.sampler_packed_weights,
                ),
                limiter=trio.CapacityLimiter(1),
                futures=futures,
                checkpoints=checkpoints,
                sample_queue_limit=config.sample_queue_limit,
                sampler_routing=config.sampler_routing,
                devices=node_devices,
                rendezvous_port=config.workers.rendezvous_port,
                # The budget the samplers' prefix caches keep within, and /metrics shows by part.
                host_memory=HostMemory(
                    resolve_budget(config.host_memory_budget_bytes, read_machine_memory_bytes()),
                    prefix_cache_cap=config.sampler_prefix_cache_bytes,
                    spill_dir=fresh_spill_dir(Path(config.data_dir) / PARKED_SPILL_DIR),
                ),
            )
            usage = UsageMeter()
            signer = Signer()
            membership = await _open_membership(config, verify_peers)
            id_tag = ids.node_tag(membership.node.name) if membership is not None else ""
            # What clients used before a restart is still served without a download: list it.
            catalog.remember(store.runs.base_models())
            sessions = SessionTable(store=store, commits=commits, id_tag=id_tag)
            job_registry = JobRegistry()
            sampling = SamplingSessions(
                nursery=nursery, store=store, catalog=catalog, groups=groups, futures=futures, sessions=sessions,
                jobs=job_registry, usage=usage, id_tag=id_tag, lora_sampler=lora_sampler,
            )
            jobs = JobTable(
                nursery=nursery, store=store, catalog=catalog, groups=groups, futures=futures, sessions=sessions,
                registry=job_registry, sampling=sampling, max_lora_rank=config.max_lora_rank, usage=usage,
                allowed_images=config.workers.allowed_images, has_automodel=bool(config.workers.automodel_python),
                commits=commits, id_tag=id_tag, lora_sampler=lora_sampler, checkpoints=checkpoints,
                on_adopted=history.resume,
            )
            # TTL expiry and usage flushes; cancelled with the nursery at shutdown (it flushes once more).
            await nursery.start(partial(run_maintenance, store, usage, checkpoints, interval_s=config.maintenance_interval_s))
            # Configured GGUF models convert in the background; progress is in /openrl/v1/info.
            await nursery.start(prepare_models, catalog, converter.ensure)
            auth = Authenticator(keys, jwt_signer=signer if config.jwt_auth else None)
            relays = RelayCounters()
            peers = cluster = spans = None
            if membership is not None:
                # Relayed calls to other members, never through an HTTP_PROXY; closed with the daemon.
                peers = httpx.AsyncClient(
                    limits=httpx.Limits(max_keepalive_connections=64), trust_env=False, verify=verify_peers
                )
                cluster = ClusterNode(
                    membership.node, client=peers, config=config, jobs=jobs, sampling=sampling, sessions=sessions,
                    resolve_model=lambda name: catalog.resolve(name).name, user_for=auth.user_for, counters=relays,
                    checkpoint_root=store.files.root if store.files.is_shared else None, spawn=nursery.start_soon,
                )
                spans = _spans(cluster, peers, config, hosting, catalog, node_devices, groups, nursery)
            services = Services(
                records=Records(store, usage),  # the rows the routes read
                config=config, auth=auth,
                catalog=catalog, futures=futures, jobs=jobs, sessions=sessions, sampling=sampling,
                groups=groups, usage=usage, signer=signer,
                devices=tuple(DeviceSummary(name=d.name, kind=d.kind, memory_bytes=d.memory_bytes) for d in device_records),
                cluster=cluster,
                relays=relays,
                console=ConsoleViews(
                    store=store, jobs=jobs, history=history,
                    node=membership.node.name if membership is not None else config.node_name,
                ),
                node_devices=node_devices,
                loop_watch=loop_watch,
                checkpoints=checkpoints,
                spans=spans,
            )
            stop = shutdown if shutdown is not None else trio.Event()
            async with trio.open_nursery() as front:
                http = Server(build_app(services), config.http, ssl_context=tls, counters=services.http)
                binds = await front.start(http.serve, config.host, config.port, stop)
                logger.info(
                    "openrld serving url=%s data_dir=%s devices=%s cpu_threads=%s open_mode=%s",
                    binds[0], config.data_dir, ",".join(d.name for d in device_records), threads or "default",
                    keys is None,
                )
                if membership is not None:
                    # Gossip starts once the peer API answers; it leaves the cluster when cancelled.
                    peer_url = membership.peer_url(binds[0])
                    # A node that takes no jobs publishes no devices, so placement never picks it.
                    slots = [DeviceSlot(d.name, d.kind, d.memory_bytes, d.free_bytes) for d in device_records]
                    slots = slots if config.accept_jobs else []
                    def payload() -> NodePayload:
                        return node_payload(
                            peer_url, slots, groups.statistics(), node_devices.pool.statistics(), jobs.home_jobs(),
                            config.network_segment,
                        )

                    await nursery.start(membership.run, payload)
                    jobs.changed = lambda: membership.node.set_payload(payload())  # a new job is gossiped at once
                    if store.files.is_shared:
                        # A survivor takes over the auto-saved jobs of a dead member (cluster/adoption.py).
                        adoption = AdoptionWatcher(
                            local_name=membership.node.name, root=store.files.root, members=membership.node.members,
                            host=jobs.adoption, published=lambda: membership.node.set_payload(payload()), counters=relays,
                        )
                        await nursery.start(adoption.run)
                # What exists now (imported modules, the config, the store) lives as long as the
                # node. Frozen, the collector never rescans it: with ~400k such objects each full
                # collection stopped every thread for ~0.4 s (the first came ~65 requests in).
                gc.freeze()
                if loop_watch is not None:
                    _watch_loop(loop_watch)
                task_status.started(binds[0])
                await stop.wait()
                futures.close()  # pending long-polls answer 503 now, within the server's graceful drain
            nursery.cancel_scope.cancel()
            if peers is not None:
                with trio.CancelScope(shield=True):
                    await peers.aclose()
    finally:
        hosting.close()
        store.close()
        if loop_watch is not None and loop_watch.is_sampling:
            loop_watch.stop_sampler()
            trio.lowlevel.remove_instrument(loop_watch)


def _spans(
    cluster: ClusterNode, client: httpx.AsyncClient, config: NodeConfig, hosting: WorkerHosting, catalog: ModelCatalog,
    node_devices: NodeDevices, groups: GroupTable, nursery: trio.Nursery,
) -> SpanMembers:
    """Trainers that span nodes: this node as a home (its group table plans and starts them) and as a member
    (its ranks of other nodes' jobs, started through the peer API)."""
    peers = SpanPeers(cluster.directory, client, relay_key(config.cluster_secret))
    groups.attach_spans(peers)

    def launch(order: SpanOrder, devices: tuple[str, ...]) -> TorchrunGroup:
        here = peers.host(cluster.name)
        span = SpanRendezvous(order.nodes, order.endpoint, order.job, is_home=False, local_addr=here)
        return hosting.member_ranks(span, devices, catalog.resolve(order.base_model).directory)

    return SpanMembers(
        name=cluster.name, pool=node_devices.pool, nursery=nursery, launch=launch, is_alive=peers.is_alive,
        tell_home=peers.tell_home,
    )


def _sampler_run(store: Store, sampler_id: str) -> str | None:
    """The training run a sampling session samples, when its owner owns that run (for the run's curves)."""
    sampler = store.samplers.get(sampler_id)
    if sampler is None or sampler.run_id is None:
        return None
    run = store.runs.get(sampler.run_id)
    return run.run_id if run is not None and run.owner == sampler.owner else None
