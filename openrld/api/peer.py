"""The peer API and the cluster view: `POST /openrl/peer/v1/pushpull` and `GET /openrl/v1/cluster`.

Push-pull is for other openrld nodes only. It is authenticated by the cluster
secret, not by API keys: the body must carry a tag made with the secret
(`X-Openrl-Cluster-Tag`); without the header the answer is 401, with a wrong
tag 403, and either is counted as dropped in the membership statistics. A
node without a cluster secret has no peer API (404).

`GET /openrl/v1/cluster` lists the members this node knows, with their state
and resources (`cluster/view.py`), for any client with an API key; on a node
that is not in a cluster it lists the node alone. These routes only decode and
route; the membership actor owns the state.
"""

from __future__ import annotations

from typing import cast

from quart import Response, request

from openrld.api.app import Services, caller, json_response
from openrld.cluster.membership.codec import MAX_PUSH_PULL_BYTES, BadFrame, DropReason
from openrld.cluster.membership.node import NotRunning
from openrld.cluster.membership.peer_client import CONTENT_TYPE, TAG_HEADER
from openrld.cluster.view import cluster_view
from openrld.errors import BadRequest, Forbidden, NotFound, ServiceUnavailable, Unauthorized, UnsupportedMediaType


async def push_pull(services: Services) -> Response:
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
    return Response(answer, status=200, content_type=CONTENT_TYPE, headers={TAG_HEADER: answer_tag})


async def cluster(services: Services) -> Response:
    caller(services)
    membership = services.cluster.membership if services.cluster is not None else None
    return json_response(cluster_view(membership, services.config.node_name or ""))
