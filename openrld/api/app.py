"""The HTTP front: a quart-trio app with one error handler, bound from the route table (`routes.py`).

Everything here decodes, authenticates and routes; state lives in the actors.

Errors. Every `{"detail": ...}` body the node sends is `wire.error_body`'s, and an
OpenrldError's status, body and headers (`fastpath.error_headers`) are made in one place,
`fastpath.error_reply`, as an `asgi.Reply`. What each layer answers goes through it:
a quart route's errors here (`error_response`, `response_of`), the hot routes' and the
gate's in `fastpath.py` and `gate.py`, the relay's and the peer client's in `cluster/`
(a peer's reply is a `Reply` too). Only `http1.py` answers without a `Reply`, for a
request that never reached the app (unparsable, or its head too long or too slow), with
`wire.error_body` too. An unexpected exception answers 500 for its request alone, and
the daemon keeps serving everyone else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast

from quart import Response, g, request
from quart_trio import QuartTrio

from openrld.actors.checkpoints import CheckpointWriter
from openrld.actors.console_views import ConsoleViews
from openrld.actors.device_pool import NodeDevices
from openrld.actors.futures import FutureTable
from openrld.actors.groups import GroupTable
from openrld.actors.jobs import JobTable
from openrld.actors.records import Records
from openrld.actors.sampling_sessions import SamplingSessions
from openrld.actors.sessions import SessionTable
from openrld.actors.span_members import SpanMembers
from openrld.actors.usage import UsageMeter
from openrld.api import media, wire
from openrld.api.asgi import Reply, detail_reply
from openrld.api.auth import Authenticator, user_in
from openrld.api.capabilities import DeviceSummary
from openrld.api.fastpath import FastPath, Handler, error_reply
from openrld.api.gate import Gate
from openrld.api.http1 import ASGIApp
from openrld.api.metrics import UNMATCHED_ENDPOINT, HttpCounters, RequestMetrics
from openrld.api.sdk_versions import SdkVersionCounter, SdkVersionWatch
from openrld.api.signing import Signer
from openrld.cluster.peer_client import RelayCounters
from openrld.config import NodeConfig
from openrld.errors import OpenrldError
from openrld.loop_watch import LoopWatch
from openrld.model_catalog import ModelCatalog

if TYPE_CHECKING:
    from openrld.cluster.node import ClusterNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Services:
    """What the routes may talk to; built once by the daemon."""

    config: NodeConfig
    auth: Authenticator
    catalog: ModelCatalog
    futures: FutureTable
    jobs: JobTable
    sessions: SessionTable
    sampling: SamplingSessions  # sampling sessions and their samples
    groups: GroupTable
    checkpoints: CheckpointWriter  # checkpoints, their rows and files (files in its worker threads)
    records: Records  # sessions, runs, audit and usage rows, as the routes read them
    devices: tuple[DeviceSummary, ...] = ()  # what the daemon resolved at startup, for /openrl/v1/info
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    usage: UsageMeter = field(default_factory=UsageMeter)  # token counts per session, for billing usage
    signer: Signer = field(default_factory=Signer)  # signed download URLs and JWTs
    cluster: ClusterNode | None = None  # membership, directory, relay; None when the node has no cluster_secret
    relays: RelayCounters = field(default_factory=RelayCounters)  # what the relay did, for /metrics
    http: HttpCounters = field(default_factory=HttpCounters)  # the HTTP server's connections, for /metrics
    console: ConsoleViews | None = None  # the console's reads; None: the node serves no console routes
    node_devices: NodeDevices | None = None  # placement and time-slicers, for the console's device view
    loop_watch: LoopWatch | None = None  # slow event-loop steps, for /metrics; None unless loop_watch_ms is set
    sdk_versions: SdkVersionCounter = field(default_factory=SdkVersionCounter)  # requests per tinker SDK release
    spans: SpanMembers | None = None  # this node's ranks of other nodes' trainers; None: not in a cluster


def error_response(status: int, detail: str) -> Response:
    """`wire.ErrorResponse` with `status`: the FastAPI-style body the SDK and the CLI read `detail` from."""
    return response_of(detail_reply(status, detail))


def response_of(reply: Reply) -> Response:
    """`reply` as quart's response: every route's handler returns a Reply, and quart carries those of the
    routes it serves (`add_route`)."""
    response = Response(reply.body, status=reply.status, content_type=reply.content_type)
    for name, value in reply.headers:
        response.headers[name.decode("latin-1")] = value.decode("latin-1")
    return response


def caller(services: Services) -> str:
    return user_in(request.scope, request.headers.get("X-API-Key"), services.auth.user_for)


async def request_body(services: Services, type_: type[wire.T]) -> wire.T:
    """The quart request's body as `type_`, read by its Content-Type and Content-Encoding (api/media.py)."""
    return media.read_json(
        await request.get_data(cache=True, as_text=False, parse_form_data=False), type_, content_type=request.headers.get("Content-Type"),
        content_encoding=request.headers.get("Content-Encoding"), max_body_bytes=services.config.max_body_bytes,
    )


# A route handler: a module-level `async def name(services, **url_values) -> Reply`.
RouteHandler = Callable[..., Awaitable[Reply]]


def add_route(app: QuartTrio, services: Services, method: str, rule: str, handler: RouteHandler) -> None:
    """Serve `method rule` with `handler`, given `services` as its first argument.

    The endpoint is the handler's name, so a route is found by the name of its
    function (quart refuses two different handlers under one endpoint).
    """

    async def view(**url_values: str) -> Response:
        return response_of(await handler(services, **url_values))  # quart carries the handler's Reply

    app.add_url_rule(rule, handler.__name__, view, methods=[method])


def build_app(services: Services) -> SdkVersionWatch:
    """The node's ASGI app: the gate, the relay on a clustered node, the fast path, then quart, all bound
    from the one route table (`routes.py`)."""
    from openrld.api import console
    from openrld.api.routes import TABLE

    app = QuartTrio("openrld")
    app.config["MAX_CONTENT_LENGTH"] = services.config.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True

    @app.errorhandler(OpenrldError)
    async def _openrld_error(error: OpenrldError) -> Response:
        return response_of(error_reply(error))

    @app.errorhandler(404)
    async def _not_found(error: Exception) -> Response:
        return error_response(404, f"no route {request.method} {request.path}")

    @app.errorhandler(405)
    async def _bad_method(error: Exception) -> Response:
        return error_response(405, f"method {request.method} not allowed on {request.path}")

    @app.errorhandler(413)
    async def _too_large(error: Exception) -> Response:
        return error_response(413, f"request body over {services.config.max_body_bytes} bytes")

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        if isinstance(error, OpenrldError):
            return await _openrld_error(error)
        code = getattr(error, "code", None)
        if isinstance(code, int) and 400 <= code < 500:
            return error_response(code, str(getattr(error, "description", error)))
        logger.exception("unhandled error path=%s", request.path)
        return error_response(500, f"internal error: {type(error).__name__}")

    @app.before_request
    async def _start_clock() -> None:
        g.arrived_s = time.perf_counter()

    @app.after_request
    async def _count_request(response: Response) -> Response:
        # The route template, not the path: paths carry ids, and a label per id grows without bound.
        endpoint = request.url_rule.rule if request.url_rule is not None else UNMATCHED_ENDPOINT
        arrived_s = getattr(g, "arrived_s", None)
        seconds = time.perf_counter() - arrived_s if arrived_s is not None else 0.0
        services.metrics.observe(endpoint, request.method, response.status_code, seconds)
        return response

    has_console = services.console is not None
    if has_console:
        console.load_assets()  # the page's files, read now rather than on the event loop at its first request
    for route in TABLE.routes:
        if route.handler is not None and not route.is_hot and (has_console or not route.is_console):
            add_route(app, services, route.method, route.path, route.handler)
    hot: dict[str, Handler] = {
        route.path: partial(route.handler, services) for route in TABLE.routes if route.is_hot and route.handler is not None
    }
    longpolls = frozenset(route.path for route in TABLE.routes if route.is_longpoll)
    # quart types ASGI's scope and messages as TypedDicts, the node's layers as plain dicts: the same at run time.
    front: ASGIApp = FastPath(
        cast(ASGIApp, app), hot, max_body_bytes=services.config.max_body_bytes, metrics=services.metrics, longpolls=longpolls
    )
    if services.cluster is not None:
        front = services.cluster.relay(front, routes=TABLE)
    gate = Gate(
        front, auth=services.auth, routes=TABLE, max_body_bytes=services.config.max_body_bytes, metrics=services.metrics
    )
    return SdkVersionWatch(gate, services.sdk_versions)
