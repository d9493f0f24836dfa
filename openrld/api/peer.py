"""The peer API and the cluster view: `POST /openrl/peer/v1/pushpull` and `GET /openrl/v1/cluster`.

Push-pull is for other openrld nodes only. It is authenticated by the cluster
secret, not by API keys: the body must carry a tag made with the secret
(`X-Openrl-Cluster-Tag`); without the header the answer is 401, with a wrong
tag 403, and either is counted as dropped in the membership statistics. A
node without a cluster secret has no peer API (404).

The span routes (`POST /openrl/peer/v1/spans/start|stop|ended`) carry a trainer
that spans nodes (`cluster/placement/span_peers.py`): a home asks a member to run
or stop its ranks of a job, a member tells the home its ranks ended. Their bodies
are signed with the cluster secret's relay key (403 otherwise); the member's
`actors/span_members.py` and the home's group table own what they change.

`GET /openrl/v1/cluster` lists the members this node knows, with their state
and resources (`cluster/view.py`), for any client with an API key; on a node
that is not in a cluster it lists the node alone. These routes only decode and
route; the membership actor owns the state.
"""

from __future__ import annotations

from typing import TypeVar, cast

import msgspec
from quart import request

from openrld.actors.span_members import SpanEnded, SpanMembers, SpanOrder, SpanStop
from openrld.api.app import Services, caller
from openrld.api.asgi import Reply, json_reply
from openrld.cluster.membership.codec import MAX_PUSH_PULL_BYTES, BadFrame, DropReason
from openrld.cluster.membership.node import NotRunning
from openrld.cluster.membership.peer_client import CONTENT_TYPE, TAG_HEADER
from openrld.cluster.peer_client import relay_key
from openrld.cluster.placement.span_peers import SPAN_TAG_HEADER, check_tag
from openrld.cluster.view import cluster_view
from openrld.errors import BadRequest, Forbidden, NotFound, ServiceUnavailable, Unauthorized, UnsupportedMediaType


async def push_pull(services: Services) -> Reply:
    """A peer's push-pull frame in, this node's frame out (the membership codec's bytes, not JSON)."""
    if services.cluster is None:
        raise NotFound("this node has no cluster_secret, so it is in no cluster and has no peer API")
    node = services.cluster.membership
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
        answer, answer_tag = node.handle_push_pull(cast(bytes, body), tag)
    except BadFrame as exc:
        raise Forbidden(f"push-pull refused: {exc}") from exc
    except NotRunning as exc:
        raise ServiceUnavailable(f"{exc}; try another member") from exc
    return Reply(answer, content_type=CONTENT_TYPE, headers=((TAG_HEADER.lower().encode(), answer_tag.encode()),))


async def cluster(services: Services) -> Reply:
    caller(services)
    membership = services.cluster.membership if services.cluster is not None else None
    return json_reply(cluster_view(membership, services.config.node_name or ""))


T = TypeVar("T")


async def _span_body(services: Services, kind: type[T]) -> T:
    """A span call's body, its tag checked and decoded. Raises NotFound, Forbidden or BadRequest."""
    if services.cluster is None:
        raise NotFound("this node has no cluster_secret, so it is in no cluster and has no peer API")
    body = cast(bytes, await request.get_data(cache=False))
    check_tag(relay_key(services.config.cluster_secret), body, request.headers.get(SPAN_TAG_HEADER))
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"invalid span body: {exc}") from exc


def _members(services: Services) -> SpanMembers:
    if services.spans is None:
        raise NotFound("this node runs no ranks for other nodes (it has no device pool)")
    return services.spans


async def span_start(services: Services) -> Reply:
    """A home asks this node to hold its devices and start its ranks of a job's trainer."""
    order = await _span_body(services, SpanOrder)
    return json_reply(_members(services).start(order))


async def span_stop(services: Services) -> Reply:
    """A home ended a job: this node's ranks of it stop, and its devices are freed."""
    stop = await _span_body(services, SpanStop)
    await _members(services).stop(stop.job)
    return json_reply({})


async def span_ended(services: Services) -> Reply:
    """A member's ranks of a job this node is home to ended: the job is lost."""
    ended = await _span_body(services, SpanEnded)
    if not services.groups.span_ended(ended.job, ended.node, ended.detail):
        raise NotFound(f"no job {ended.job} spans node {ended.node} from here")
    return json_reply({})
