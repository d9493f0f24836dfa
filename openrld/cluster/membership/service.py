"""Membership as a daemon runs it: UDP gossip, push-pull over the peer HTTP API, seeds, payload, leave.

`ClusterMembership.open` binds the gossip socket and builds the node before
the HTTP front exists (the peer routes need the node); `run` starts the
protocol once the node's own URL is known, joins the seeds (resolving DNS
names, so one headless-service name stands for every pod), republishes this
node's payload every `PAYLOAD_REFRESH_S`, and on cancellation leaves the
cluster gracefully within `LEAVE_DEADLINE_S` and closes its socket and HTTP
client. It owns those two resources and nothing else; the payload comes from
a function the daemon passes in.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import cast

import httpx
import msgspec
import trio

from openrld.actors.device_pool import DeviceUse
from openrld.actors.groups import GroupStatistics
from openrld.actors.jobs import HomeJob
from openrld.cluster.membership.codec import secret_key
from openrld.cluster.membership.config import MembershipConfig
from openrld.cluster.membership.messages import DeviceSlot, GroupLoad, JobNote, NodePayload
from openrld.cluster.membership.node import MembershipNode
from openrld.cluster.membership.peer_client import HttpPushPull
from openrld.cluster.membership.transport import UdpTransport, format_addr, parse_addr

logger = logging.getLogger(__name__)

# Resources change slowly next to the gossip rounds; a changed payload costs one
# gossiped update, so once every few seconds keeps the view fresh and cheap.
PAYLOAD_REFRESH_S = 2.0
# A leaving node sends its farewell and stops; it does not wait for answers.
LEAVE_DEADLINE_S = 1.0
SEED_LOOKUP_S = 5.0  # one resolution of the seed names; the push-pull loop tries again next round


class ClusterSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What `ClusterMembership` needs from the node config."""

    node_name: str
    cluster_secret: str
    seeds: tuple[str, ...]
    bind_host: str
    gossip_port: int
    advertise_host: str
    http_port: int  # the port a seed without one is assumed to listen on
    timing: str  # "lan" or "local"
    scheme: str = "http"  # "https" when the node's API speaks TLS: peers are reached the same way


def node_name_or_host_name(node_name: str) -> str:
    return node_name or socket.gethostname()


def advertised_host(bind_host: str, advertise_host: str) -> str:
    """The address peers should use: the configured one, else the bind address unless it is a wildcard."""
    if advertise_host:
        return advertise_host
    try:
        is_wildcard = ipaddress.ip_address(bind_host).is_unspecified
    except ValueError:
        is_wildcard = False
    return socket.gethostbyname(socket.gethostname()) if is_wildcard else bind_host


async def seed_urls(seeds: Sequence[str], default_port: int, scheme: str = "http") -> list[str]:
    """Peer API URLs for the seeds: one per address each name resolves to; unresolvable ones are logged and skipped."""
    urls: list[str] = []
    for seed in seeds:
        try:
            host, port = parse_addr(seed)
        except ValueError:
            host, port = seed.removeprefix("[").removesuffix("]"), default_port
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            logger.warning("cannot resolve seed=%s: %s", seed, exc)
            continue
        for address in dict.fromkeys(info[4][0] for info in infos):
            urls.append(f"{scheme}://{format_addr(cast(str, address), port)}")
    return urls


def node_payload(
    peer_url: str,
    devices: Sequence[DeviceSlot],
    groups: Sequence[GroupStatistics],
    device_use: Sequence[DeviceUse] = (),
    home_jobs: Sequence[HomeJob] = (),
    segment: str = "",
) -> NodePayload:
    """This node's payload from its devices, their placements, its groups' statistics and its jobs.

    A node given no devices (`accept_jobs = false`) is published without any,
    so placement never picks it.
    """
    use = {u.device: u for u in device_use}
    return NodePayload(
        segment=segment,
        peer_url=peer_url,
        devices=tuple(
            msgspec.structs.replace(
                d, groups=len(use[d.name].groups), is_exclusive=use[d.name].is_exclusive
            ) if d.name in use else d
            for d in devices
        ),
        groups=tuple(
            GroupLoad(
                base_model=g.base_model,
                adapters=len(g.trainer.jobs),
                queue_depth=sum(j.waiting for j in g.trainer.jobs) + g.sampler.queue_depth,
            )
            for g in groups
        ),
        jobs=tuple(sorted({j.model_id for g in groups for j in g.trainer.jobs} | {h.model_id for h in home_jobs})),
        job_notes={
            h.model_id: JobNote(
                h.owner, h.base_model, h.fine_tuning_type, h.is_exclusive, h.last_checkpoint or "", h.autosave_steps
            )
            for h in home_jobs
        },
    )


class ClusterMembership:
    def __init__(self, node: MembershipNode, transport: UdpTransport, client: httpx.AsyncClient, settings: ClusterSettings) -> None:
        self.node = node
        self._transport = transport
        self._client = client
        self._settings = settings

    @classmethod
    async def open(cls, settings: ClusterSettings, *, verify: ssl.SSLContext | bool = True) -> ClusterMembership:
        """Bind the gossip socket and build the node (not yet running); `verify` checks peers' certificates.

        Raises:
            OSError: the gossip port cannot be bound.
        """
        config = MembershipConfig.local() if settings.timing == "local" else MembershipConfig.lan()
        advertise = advertised_host(settings.bind_host, settings.advertise_host)
        transport = await UdpTransport.open(settings.bind_host, settings.gossip_port, advertise)
        # trust_env=False: peers talk directly; an HTTP_PROXY meant for the outside must not carry gossip.
        client = httpx.AsyncClient(timeout=httpx.Timeout(config.push_pull_timeout_s), trust_env=False, verify=verify)
        node = MembershipNode(
            name=node_name_or_host_name(settings.node_name),
            config=config,
            key=secret_key(settings.cluster_secret),
            transport=transport,
            push_pull=HttpPushPull(client),
            payload=NodePayload(),
            rng=random.Random(),
        )
        return cls(node, transport, client, settings)

    def peer_url(self, bound_url: str) -> str:
        """The URL peers reach this node's API at, from the URL the HTTP server bound."""
        _, _, port = bound_url.rpartition(":")
        host = advertised_host(self._settings.bind_host, self._settings.advertise_host)
        return f"{self._settings.scheme}://{format_addr(host, int(port))}"

    async def run(
        self,
        payload_source: Callable[[], NodePayload],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Gossip until cancelled, then leave; started once the protocol answers pings."""
        try:
            async with trio.open_nursery() as nursery:
                self.node.set_payload(payload_source())  # before the first announcement
                await nursery.start(self.node.run)
                task_status.started()
                nursery.start_soon(self._join)
                while True:
                    await trio.sleep(PAYLOAD_REFRESH_S)
                    self.node.set_payload(payload_source())
        finally:
            with trio.move_on_after(LEAVE_DEADLINE_S, shield=True):
                await self.node.leave()
                await self._client.aclose()
            await self._transport.aclose()

    async def _join(self) -> None:
        if not self._settings.seeds:
            return
        joined, resolved = await self.node.join(self._seed_urls)
        logger.info(
            "joined node=%s seeds=%s answered=%d/%d", self.node.name, ",".join(self._settings.seeds), joined, resolved
        )

    async def _seed_urls(self) -> list[str]:
        """The seeds' peer URLs as DNS says now; a lookup that hangs counts as none."""
        with trio.move_on_after(SEED_LOOKUP_S):
            return await seed_urls(self._settings.seeds, self._settings.http_port, self._settings.scheme)
        logger.warning("resolving seeds=%s took over %s s", ",".join(self._settings.seeds), SEED_LOOKUP_S)
        return []
