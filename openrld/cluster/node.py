"""This node as a member of a cluster: the one object the daemon builds for it and the HTTP front calls.

`ClusterNode` holds what spans nodes, each built once here: the membership
node (gossip, `membership/`), the job directory (`directory.py`), the calls to
other members (`peer_client.py`), the placer of new jobs (`placement/`), and
the relay that sends each request to its home node (`relay.py`), which the
HTTP front puts in front of its own app. A node without a cluster secret has
no `ClusterNode` at all. It owns no task: the daemon runs the membership
service and closes the HTTP client it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from openrld.actors.jobs import JobTable
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.api.asgi import Reply
from openrld.api.http1 import ASGIApp
from openrld.cluster.directory import Directory
from openrld.cluster.membership.node import MembershipNode
from openrld.cluster.peer_client import PeerClient, RelayCounters, relay_key
from openrld.cluster.placement import ClusterPlacer
from openrld.cluster.relay import Relay
from openrld.cluster.replay import MAX_KEPT_PER_JOB, Journal
from openrld.config import NodeConfig

if TYPE_CHECKING:
    from openrld.api.routes import RouteTable

RELAY_MARGIN_S = 30.0  # what a relayed call may take beyond the home node's long-poll


class ClusterNode:
    """This node's membership, directory, peer client, placer and relay; see the module docstring."""

    def __init__(
        self,
        membership: MembershipNode,
        *,
        client: httpx.AsyncClient,
        config: NodeConfig,
        jobs: JobTable,
        sampling: SamplingSessions,
        sessions: SessionTable,
        resolve_model: Callable[[str], str],
        user_for: Callable[[str | None], str],
        counters: RelayCounters,
        checkpoint_root: Path | None = None,
        spawn: Callable[..., None] | None = None,
    ) -> None:
        self.membership = membership
        # The shared checkpoint root, where jobs auto-save (None: not shared): what replay knows is covered.
        self._checkpoint_root = checkpoint_root
        self._spawn = spawn  # the daemon's nursery's start_soon: replay's background reads
        # Requests relayed to jobs' homes, kept until covered by an auto-save, for replay (replay.py).
        self.journal = Journal(max_per_job=MAX_KEPT_PER_JOB if checkpoint_root is None else 1 << 30)
        self.directory = Directory(membership, jobs, sampling)
        self.counters = counters  # the relay's, the peer client's and the placer's, for /metrics
        self._key = relay_key(config.cluster_secret)
        self._peers = PeerClient(
            client, local_name=membership.name, key=self._key, tls=config.is_tls, counters=counters,
            # A relayed retrieve_future long-polls at the home node for up to longpoll_s.
            relay_timeout_s=config.longpoll_s + RELAY_MARGIN_S,
        )
        self._placer: ClusterPlacer[Reply] = ClusterPlacer(self.directory, counters, config.accept_jobs)
        self._config = config
        self._sessions = sessions
        self._resolve_model = resolve_model
        self._user_for = user_for

    @property
    def name(self) -> str:
        return self.membership.name

    def relay(self, inner: ASGIApp, *, routes: RouteTable) -> Relay:
        """The relay in front of this node's own app `inner`, finding each request's home by its route."""
        return Relay(
            inner,
            directory=self.directory,
            peers=self._peers,
            placement=self._placer,
            key=self._key,
            counters=self.counters,
            user_for=self._user_for,
            session_snapshot=self._sessions.snapshot,
            mirror_session=self._sessions.mirror,
            resolve_model=self._resolve_model,
            accept_jobs=self._config.accept_jobs,
            max_body_bytes=self._config.max_body_bytes,
            routes=routes,
            journal=self.journal,
            checkpoint_root=self._checkpoint_root,
            spawn=self._spawn,
        )
