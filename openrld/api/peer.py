"""The peer API and the cluster view: `POST /openrl/peer/v1/pushpull` and `GET /openrl/v1/cluster`.

Push-pull is for other openrld nodes only. It is authenticated by the cluster
secret, not by API keys: the body must carry a tag made with the secret
(`X-Openrl-Cluster-Tag`); without the header the answer is 401, with a wrong
tag 403, and either is counted as dropped in the membership statistics. A
node without a cluster secret has no peer API (404).

`GET /openrl/v1/cluster` lists the members this node knows, with their state
and resources, for any client with an API key; on a node that is not in a
cluster it lists the node alone. These routes only decode and route; the
membership actor owns the state.
"""

from __future__ import annotations

from functools import partial

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio

from openrld.actors.membership.codec import MAX_PUSH_PULL_BYTES, BadFrame, DropReason
from openrld.actors.membership.node import MembershipStatistics, NotRunning
from openrld.actors.membership.peer_client import CONTENT_TYPE, PUSH_PULL_PATH, TAG_HEADER
from openrld.api.app import Services, add_route, caller, json_response
from openrld.errors import BadRequest, Forbidden, NotFound, ServiceUnavailable, Unauthorized, UnsupportedMediaType


class DeviceView(msgspec.Struct, frozen=True):
    name: str
    kind: str
    memory_bytes: int
    free_bytes: int
    groups: int  # worker groups placed on it
    is_exclusive: bool  # held by an exclusive job


class GroupView(msgspec.Struct, frozen=True):
    base_model: str
    adapters: int
    queue_depth: int


class ClusterMember(msgspec.Struct, frozen=True):
    """One member as GET /openrl/v1/cluster shows it (the gossip payload, with field names)."""

    name: str
    state: str  # "alive", "suspect", "dead", "left"
    incarnation: int
    gossip_addr: str
    peer_url: str
    devices: tuple[DeviceView, ...]
    groups: tuple[GroupView, ...]
    jobs: tuple[str, ...]
    state_age_s: float  # how long ago this node saw the state begin


class ClusterView(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/cluster."""

    node: str  # the node that answered
    is_clustered: bool
    members: tuple[ClusterMember, ...]
    statistics: MembershipStatistics | None


def register(app: QuartTrio, services: Services) -> None:
    route = partial(add_route, app, services)
    route("POST", PUSH_PULL_PATH, push_pull)
    route("GET", "/openrl/v1/cluster", cluster)


# ---------------------------------------------------------------- routes


async def push_pull(services: Services) -> Response:
    """A peer's push-pull frame in, this node's frame out (the membership codec's bytes, not JSON)."""
    node = services.cluster
    if node is None:
        raise NotFound("this node has no cluster_secret, so it is in no cluster and has no peer API")
    declared = request.headers.get("Content-Type")
    if declared is not None and declared.split(";", 1)[0].strip().lower() != CONTENT_TYPE:
        raise UnsupportedMediaType(f"push-pull takes {CONTENT_TYPE}, got Content-Type {declared!r}")
    tag = request.headers.get(TAG_HEADER)
    if not tag:
        node.count_dropped(DropReason.BAD_TAG)
        raise Unauthorized(f"push-pull needs the {TAG_HEADER} header, made with the cluster secret")
    body = await request.get_data(cache=False)
    if len(body) > MAX_PUSH_PULL_BYTES:
        raise BadRequest(f"push-pull body of {len(body)} bytes is over {MAX_PUSH_PULL_BYTES}")
    try:
        answer, answer_tag = node.handle_push_pull(body, tag)
    except BadFrame as exc:
        raise Forbidden(f"push-pull refused: {exc}") from exc
    except NotRunning as exc:
        raise ServiceUnavailable(f"{exc}; try another member") from exc
    return Response(answer, status=200, content_type=CONTENT_TYPE, headers={TAG_HEADER: answer_tag})


async def cluster(services: Services) -> Response:
    caller(services)
    return json_response(cluster_view(services))


# ---------------------------------------------------------------- wire forms


def cluster_view(services: Services) -> ClusterView:
    node = services.cluster
    if node is None:
        return ClusterView(node=services.config.node_name or "", is_clustered=False, members=(), statistics=None)
    now = trio.current_time()
    members = tuple(
        ClusterMember(
            name=m.name, state=m.state.name.lower(), incarnation=m.incarnation, gossip_addr=m.addr,
            peer_url=m.peer_url,
            devices=tuple(
                DeviceView(d.name, d.kind, d.memory_bytes, d.free_bytes, d.groups, d.is_exclusive)
                for d in m.payload.devices
            ),
            groups=tuple(GroupView(g.base_model, g.adapters, g.queue_depth) for g in m.payload.groups),
            jobs=m.payload.jobs,
            state_age_s=round(now - m.state_since_s, 3),
        )
        for m in node.members()
    )
    return ClusterView(node=node.name, is_clustered=True, members=members, statistics=node.statistics())
