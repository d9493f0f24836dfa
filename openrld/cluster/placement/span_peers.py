"""The peer calls of a trainer that spans nodes: the home plans it and asks its members, a member tells the home.

`SpanPeers` is what the group table (home side) and `actors/span_members.py`
(member side) are given to reach the rest of the cluster:
- `plan`: the span from this node's cluster view, this node the home (`spanning.py`);
- `start` / `stop`: ask a member to run or stop its ranks of a job (POST
  `SPAN_START_PATH`, `SPAN_STOP_PATH`);
- `tell_home`: a member's ranks ended (POST `SPAN_ENDED_PATH`);
- `is_alive`, `host`: a member's liveness and the address it is reached at.

Every body is signed with the relay key (the cluster secret's), as a locate
query is, and checked by `check_tag` in the peer routes (`api/peer.py`).
"""

from __future__ import annotations

import hmac
import logging
import urllib.parse

import httpx
import msgspec

from openrld.actors.span_members import SpanEnded, SpanOrder, SpanStarted, SpanStop
from openrld.cluster.directory import Directory
from openrld.cluster.peer_client import sign
from openrld.cluster.placement.spanning import SpanPlan, plan_span, span_nodes, span_refusal
from openrld.errors import BadRequest, Forbidden, ServerError

logger = logging.getLogger(__name__)

SPAN_START_PATH = "/openrl/peer/v1/spans/start"
SPAN_STOP_PATH = "/openrl/peer/v1/spans/stop"
SPAN_ENDED_PATH = "/openrl/peer/v1/spans/ended"
SPAN_TAG_HEADER = "x-openrl-span-tag"  # HMAC of the body with the relay key
START_S = 30.0  # a member answers once its torchrun is started, not once it has joined
STOP_S = 30.0  # a member answers once its ranks have stopped (launchers/torchrun.py: 10 s, then SIGKILL)


def check_tag(key: bytes, body: bytes, tag: str | None) -> None:
    """Raises Forbidden unless `tag` is the body's HMAC with the relay key."""
    if not tag or not hmac.compare_digest(sign(key, body), tag):
        raise Forbidden("span calls need a tag made with the cluster secret")


class SpanPeers:
    def __init__(self, directory: Directory, client: httpx.AsyncClient, key: bytes) -> None:
        self._directory = directory
        self._client = client  # the daemon's peer client (no HTTP_PROXY)
        self._key = key  # relay_key(cluster secret)

    @property
    def local_name(self) -> str:
        return self._directory.local_name

    def plan(self, devices: int) -> SpanPlan:
        """The span of a trainer of `devices` ranks, this node its home.

        Raises:
            BadRequest: the cluster's free devices are too few (key openrl.trainer_gpus).
        """
        nodes = span_nodes(self._directory.members())
        plan = plan_span(nodes, devices, home=self.local_name)
        if plan is None:
            raise BadRequest(span_refusal(nodes, devices), key="openrl.trainer_gpus")
        return plan

    def is_alive(self, name: str) -> bool:
        member = self._directory.member(name)
        return member is not None and member.is_alive

    def host(self, name: str) -> str:
        """The address `name` is reached at (its peer API's host): where a rendezvous is, or a rank listens."""
        member = self._directory.member(name)
        if member is None:
            raise ServerError(f"node {name} is not a member of the cluster")
        return urllib.parse.urlsplit(member.peer_url).hostname or ""

    async def start(self, node: str, order: SpanOrder) -> SpanStarted:
        """Ask `node` to hold its devices and start its ranks of `order.job`.

        Raises:
            ServerError: it refused or could not be reached (the message says which, and why).
        """
        response = await self._post(node, SPAN_START_PATH, msgspec.json.encode(order), START_S)
        if response.status_code != 200:
            raise ServerError(f"node {node} did not start its ranks of job {order.job}: {_detail(response)}")
        return msgspec.json.decode(response.content, type=SpanStarted)

    async def stop(self, node: str, job: str) -> None:
        """Ask `node` to stop its ranks of `job`; a node that cannot be reached stops them itself (its home is gone
        from its view, or its ranks lose theirs), so a failure is logged, not raised."""
        try:
            response = await self._post(node, SPAN_STOP_PATH, msgspec.json.encode(SpanStop(job)), STOP_S)
            if response.status_code != 200:
                logger.warning("span stop job=%s node=%s: %s", job, node, _detail(response))
        except ServerError as error:
            logger.warning("span stop job=%s node=%s: %s", job, node, error.detail)

    async def tell_home(self, home: str, ended: SpanEnded) -> None:
        """A member's ranks of a job ended: its home ends the job (logged, not raised, if it cannot be told)."""
        try:
            await self._post(home, SPAN_ENDED_PATH, msgspec.json.encode(ended), START_S)
        except ServerError as error:
            logger.warning("span ended job=%s home=%s: %s", ended.job, home, error.detail)

    async def _post(self, node: str, path: str, body: bytes, timeout_s: float) -> httpx.Response:
        member = self._directory.member(node)
        if member is None or not member.is_alive:
            raise ServerError(f"node {node} is not a live member of the cluster")
        try:
            return await self._client.post(
                member.peer_url + path, content=body, headers={SPAN_TAG_HEADER: sign(self._key, body)},
                timeout=httpx.Timeout(timeout_s, connect=5.0),
            )
        except httpx.HTTPError as error:
            raise ServerError(f"node {node} could not be reached ({type(error).__name__})") from error


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text
