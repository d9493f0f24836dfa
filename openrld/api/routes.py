"""Every route of the node, declared once: its method, path, handler, body types, and how it is served.

One `Route` a line, and everything that serves a request reads it here:
- `app.build_app` binds the quart routes and gives the fast path its hot ones;
- `fastpath.FastPath` serves `is_hot` POSTs without quart and cancels an
  `is_longpoll` handler when its client goes away;
- `gate.Gate` lets an `is_keyless` path in without an `X-API-Key` (it carries
  its own proof, or holds nothing);
- `cluster/relay.py` finds the node a request belongs to by the route's
  `home` (`HomeBy`), merges the lists that have a `fan_out` from every member,
  and lets a long-poll relayed to another node end with its client.

`request` and `reply` name the JSON body Structs (`wire.py` and the views'),
None where the body is not a Struct (protobuf, a file, Prometheus text, bytes
of the membership codec) or there is none. The table is plain data: it holds
no state and is matched (`RouteTable.match`) without quart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import msgspec
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.routing.exceptions import RoutingException

from openrld.actors.console_views import NodeView, RunDetail, RunPage
from openrld.actors.model_status import ModelStatus
from openrld.api import admin, console, lifecycle, openrl, peer, rest, tinker, wire
from openrld.api.capabilities import ServerInfo
from openrld.cluster.list_fanout import FanOut
from openrld.cluster.membership.peer_client import PUSH_PULL_PATH
from openrld.cluster.peer_client import LOCATE_PATH
from openrld.cluster.placement.span_peers import SPAN_ENDED_PATH, SPAN_START_PATH, SPAN_STOP_PATH
from openrld.cluster.relay import HomeBy
from openrld.cluster.view import ClusterView

_CHECKPOINT = "/api/v1/training_runs/<run_id>/checkpoints/<kind>/<name>"


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """One route: what it is, and each property that decides how it is served (see the module docstring)."""

    method: str
    path: str  # a werkzeug rule: `<name>` is one segment, `<path:name>` the rest of the path
    # `async def (services, **path_params) -> asgi.Reply` (quart carries it), or for a hot route
    # `async def (services, fastpath.Call) -> asgi.Reply`; None: answered before the app (the relay's locate).
    handler: Callable[..., Any] | None
    request: type | None = None  # the JSON body's Struct
    reply: type | None = None  # the JSON reply's Struct (a 200's)
    is_hot: bool = False  # served by the fast path, without quart
    is_longpoll: bool = False  # holds the request open; stops waiting when the client goes away
    is_keyless: bool = False  # no X-API-Key needed: it carries its own proof, or holds nothing
    is_console: bool = False  # served only on a node that has the console
    home: HomeBy = HomeBy.HERE  # where a clustered node answers it
    fan_out: FanOut | None = None  # a list merged from every member's page


ROUTES: tuple[Route, ...] = (
    # ---------------------------------------------------------------- bootstrap (tinker.py)
    Route(method="POST", path="/api/v1/client/config", handler=tinker.client_config,
          request=wire.ClientConfigRequest, reply=wire.ClientConfigResponse),
    Route(method="POST", path="/api/v1/client/dynamic_config", handler=tinker.dynamic_config,
          reply=wire.ClientDynamicConfigResponse),
    Route(method="POST", path="/api/v1/create_session", handler=tinker.create_session,
          request=wire.CreateSessionRequest, reply=wire.CreateSessionResponse),
    Route(method="POST", path="/api/v1/session_heartbeat", handler=tinker.session_heartbeat,
          request=wire.SessionHeartbeatRequest, reply=wire.SessionHeartbeatResponse, home=HomeBy.MINTED_IN_BODY),
    Route(method="POST", path="/api/v1/sessions/<session_id>/finish", handler=tinker.finish_session,
          request=wire.SessionFinishRequest, reply=wire.EmptyResponse, home=HomeBy.SESSION_FINISH),
    Route(method="POST", path="/api/v1/telemetry", handler=tinker.telemetry,
          request=wire.TelemetryRequest, reply=wire.TelemetryResponse),
    Route(method="GET", path="/api/v1/healthz", handler=tinker.healthz, reply=wire.HealthResponse, is_keyless=True),
    Route(method="GET", path="/api/v1/get_server_capabilities", handler=tinker.get_server_capabilities,
          reply=wire.GetServerCapabilitiesResponse),
    # ---------------------------------------------------------------- training (tinker.py)
    Route(method="POST", path="/api/v1/create_model", handler=tinker.create_model,
          request=wire.CreateModelRequest, reply=wire.UntypedAPIFuture, home=HomeBy.PLACED),
    Route(method="POST", path="/api/v1/get_info", handler=tinker.get_info,
          request=wire.GetInfoRequest, reply=wire.GetInfoResponse, home=HomeBy.MODEL_IN_BODY),
    Route(method="POST", path="/api/v1/save_weights", handler=tinker.save_weights,
          request=wire.SaveWeightsRequest, reply=wire.UntypedAPIFuture, home=HomeBy.MODEL_IN_BODY),
    Route(method="POST", path="/api/v1/save_weights_for_sampler", handler=tinker.save_weights_for_sampler,
          request=wire.SaveWeightsForSamplerRequest, reply=wire.UntypedAPIFuture, home=HomeBy.SAVE_FOR_SAMPLER),
    Route(method="POST", path="/api/v1/save_weights_external", handler=tinker.save_weights_external,
          request=wire.SaveWeightsExternalRequest, reply=wire.UntypedAPIFuture, home=HomeBy.MODEL_IN_BODY),
    Route(method="POST", path="/api/v1/load_weights", handler=tinker.load_weights,
          request=wire.LoadWeightsRequest, reply=wire.UntypedAPIFuture, home=HomeBy.LOAD_WEIGHTS),
    # The loop's hot POSTs. forward_backward's body is protobuf (or JSON before SDK 0.25): no Struct.
    Route(method="POST", path="/api/v1/forward_backward", handler=tinker.forward_backward,
          reply=wire.UntypedAPIFuture, is_hot=True, home=HomeBy.MODEL_IN_BODY),
    Route(method="POST", path="/api/v1/forward", handler=tinker.forward,
          reply=wire.UntypedAPIFuture, is_hot=True, home=HomeBy.MODEL_IN_BODY),
    Route(method="POST", path="/api/v1/optim_step", handler=tinker.optim_step,
          request=wire.OptimStepRequest, reply=wire.UntypedAPIFuture, is_hot=True, home=HomeBy.MODEL_IN_BODY),
    # ---------------------------------------------------------------- sampling (tinker.py)
    Route(method="POST", path="/api/v1/create_sampling_session", handler=tinker.create_sampling_session,
          request=wire.CreateSamplingSessionRequest, reply=wire.CreateSamplingSessionResponse,
          home=HomeBy.CREATE_SAMPLER),
    Route(method="GET", path="/api/v1/samplers/<path:sampler_id>", handler=tinker.get_sampler,
          reply=wire.GetSamplerResponse, home=HomeBy.SAMPLER_IN_PATH),
    Route(method="POST", path="/api/v1/asample", handler=tinker.asample,
          request=wire.SampleRequest, reply=wire.UntypedAPIFuture, is_hot=True, home=HomeBy.SAMPLER_IN_BODY),
    # A result's reply is protobuf or JSON by its kind and the client's Accept: no one Struct.
    Route(method="POST", path="/api/v1/retrieve_future", handler=tinker.retrieve_future,
          request=wire.FutureRetrieveRequest, is_hot=True, is_longpoll=True, home=HomeBy.MINTED_IN_BODY),
    Route(method="POST", path="/api/v1/cancel_future", handler=tinker.cancel_future,
          request=wire.CancelFutureRequest, reply=wire.EmptyResponse, home=HomeBy.MINTED_IN_BODY),
    Route(method="POST", path="/api/v1/create_custom_loss", handler=tinker.create_custom_loss),
    # ---------------------------------------------------------------- runs, checkpoints, sessions (rest.py)
    Route(method="GET", path="/api/v1/training_runs", handler=rest.list_training_runs,
          reply=wire.TrainingRunsResponse, fan_out=FanOut("training_runs", "last_request_time", 20)),
    Route(method="GET", path="/api/v1/training_runs/<run_id>", handler=rest.get_training_run,
          reply=wire.TrainingRun, home=HomeBy.RUN_IN_PATH),
    Route(method="GET", path="/api/v1/training_runs/<run_id>/checkpoints", handler=rest.list_checkpoints,
          reply=wire.CheckpointsListResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="DELETE", path=_CHECKPOINT, handler=rest.delete_checkpoint,
          reply=wire.EmptyResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="GET", path="/api/v1/checkpoints", handler=rest.list_user_checkpoints,
          reply=wire.CheckpointsListResponse, fan_out=FanOut("checkpoints", "time", 100)),
    Route(method="POST", path="/api/v1/weights_info", handler=rest.weights_info,
          request=wire.WeightsInfoRequest, reply=wire.WeightsInfoResponse, home=HomeBy.CHECKPOINT_IN_BODY),
    Route(method="GET", path="/api/v1/sessions", handler=rest.list_sessions, reply=wire.ListSessionsResponse),
    Route(method="GET", path="/api/v1/sessions/<session_id>", handler=rest.get_session,
          reply=wire.GetSessionResponse, home=HomeBy.SESSION_IN_PATH),
    # ---------------------------------------------------------------- a checkpoint's life (lifecycle.py)
    Route(method="POST", path=f"{_CHECKPOINT}/publish", handler=lifecycle.publish,
          reply=wire.EmptyResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="DELETE", path=f"{_CHECKPOINT}/publish", handler=lifecycle.unpublish,
          reply=wire.EmptyResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="PUT", path=f"{_CHECKPOINT}/ttl", handler=lifecycle.set_ttl,
          request=wire.TtlRequest, reply=wire.EmptyResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="POST", path="/api/v1/copy_weights", handler=lifecycle.copy_weights,
          request=wire.CopyWeightsRequest, reply=wire.CopyWeightsResponse),
    Route(method="GET", path=f"{_CHECKPOINT}/external_weights_urls", handler=lifecycle.external_weights_urls,
          reply=wire.ExternalWeightsUrlsResponse, home=HomeBy.RUN_IN_PATH),
    Route(method="GET", path=f"{_CHECKPOINT}/archive", handler=lifecycle.checkpoint_archive, home=HomeBy.RUN_IN_PATH),
    # A signed URL: the signature is the proof, and the reply is the file.
    Route(method="GET", path="/api/v1/download/<run_id>/<kind>/<name>/<filename>", handler=lifecycle.download,
          is_keyless=True),
    Route(method="PUT", path="/api/v1/sessions/<session_id>/project", handler=lifecycle.assign_project,
          request=wire.ProjectRequest, reply=wire.EmptyResponse, home=HomeBy.SESSION_IN_PATH),
    Route(method="POST", path="/api/v1/sessions/search", handler=lifecycle.search_sessions,
          request=wire.SessionSearchRequest, reply=wire.SessionSearchResponse),
    Route(method="GET", path="/api/v1/sessions/<session_id>/trace_export", handler=lifecycle.trace_export,
          reply=wire.TraceExportResponse, home=HomeBy.SESSION_IN_PATH),
    Route(method="GET", path="/api/v1/trace/<session_id>/<filename>", handler=lifecycle.trace, is_keyless=True),
    # ---------------------------------------------------------------- audit, billing, keys (admin.py)
    Route(method="GET", path="/api/v1/audit", handler=admin.audit_log, reply=wire.AuditLogResponse),
    Route(method="GET", path="/api/v1/billing/usage/events", handler=admin.billing_usage,
          reply=wire.BillingUsageResponse),
    Route(method="GET", path="/api/v1/billing/usage/checkpoints/current", handler=admin.checkpoint_storage,
          reply=wire.CurrentCheckpointStorageUsageResponse),
    Route(method="POST", path="/api/v1/auth/token", handler=admin.auth_token, reply=wire.AuthTokenResponse),
    Route(method="GET", path="/api/v1/auth/apikey/me", handler=admin.apikey_me, reply=wire.SelfApiKeyResponse),
    Route(method="DELETE", path="/api/v1/auth/apikey/me", handler=admin.apikey_revoke),
    # ---------------------------------------------------------------- openrl's own (openrl.py)
    Route(method="GET", path="/openrl/v1/info", handler=openrl.info, reply=ServerInfo),
    Route(method="GET", path="/openrl/v1/models/<model_id>/status", handler=openrl.model_status,
          reply=ModelStatus, home=HomeBy.MODEL_STATUS),
    Route(method="GET", path="/metrics", handler=openrl.metrics, is_keyless=True),  # Prometheus text
    # ---------------------------------------------------------------- node to node (peer.py, cluster/)
    Route(method="POST", path=PUSH_PULL_PATH, handler=peer.push_pull, is_keyless=True),  # HMAC of the secret
    Route(method="POST", path=SPAN_START_PATH, handler=peer.span_start, is_keyless=True),  # HMAC of the relay key
    Route(method="POST", path=SPAN_STOP_PATH, handler=peer.span_stop, is_keyless=True),
    Route(method="POST", path=SPAN_ENDED_PATH, handler=peer.span_ended, is_keyless=True),
    Route(method="POST", path=LOCATE_PATH, handler=None, is_keyless=True, home=HomeBy.LOCATE),  # the relay's own
    Route(method="GET", path="/openrl/v1/cluster", handler=peer.cluster, reply=ClusterView),
    # ---------------------------------------------------------------- the console (console.py)
    Route(method="GET", path="/console", handler=console.console_page, is_keyless=True, is_console=True),
    Route(method="GET", path="/console/<name>", handler=console.console_file, is_keyless=True, is_console=True),
    Route(method="GET", path="/openrl/v1/runs", handler=console.console_runs, reply=RunPage, is_console=True,
          fan_out=FanOut("runs", "created", 20)),
    Route(method="GET", path="/openrl/v1/runs/<run_id>", handler=console.console_run, reply=RunDetail,
          is_console=True, home=HomeBy.MODEL_IN_PATH),
    Route(method="GET", path="/openrl/v1/runs/<run_id>/curves", handler=console.console_curves, is_console=True,
          home=HomeBy.MODEL_IN_PATH),
    # ?node=<name>: that member's own device view
    Route(method="GET", path="/openrl/v1/node", handler=console.console_node, reply=NodeView, is_console=True,
          home=HomeBy.NODE_QUERY),
)


class Matched(NamedTuple):
    route: Route
    params: dict[str, str]  # the path's `<name>` values


class RouteTable:
    """The routes, matched by method and path: a dict for the fixed paths, werkzeug's matcher for the rest."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        self.routes = routes
        self._fixed = {(r.method, r.path): r for r in routes if "<" not in r.path}
        self._patterned = [r for r in routes if "<" in r.path]
        rules = Map([Rule(r.path, endpoint=i, methods=[r.method]) for i, r in enumerate(self._patterned)])
        self._adapter = rules.bind("")
        # What the gate lets in without a key, by path alone, before any route is matched.
        self.keyless_paths = frozenset(r.path for r in routes if r.is_keyless and "<" not in r.path)
        self.keyless_prefixes = tuple(sorted({r.path.split("<", 1)[0] for r in routes if r.is_keyless and "<" in r.path}))

    def match(self, method: str, path: str) -> Matched | None:
        """The route for `method path` and its path parameters; None when no route has both."""
        route = self._fixed.get((method, path))
        if route is not None:
            return Matched(route, {})
        try:
            index, params = self._adapter.match(path, method)
        except (HTTPException, RoutingException):  # no such path, another method, a redirect werkzeug would make
            return None
        route = self._patterned[index]
        return Matched(route, cast("dict[str, str]", params)) if route.method == method else None  # werkzeug also lets HEAD match a GET

    def is_keyless(self, path: str) -> bool:
        return path in self.keyless_paths or path.startswith(self.keyless_prefixes)


TABLE = RouteTable(ROUTES)
