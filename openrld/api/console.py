"""The console: one static page (`GET /console`) and the read-only routes it polls.

The page is three files shipped in the package (`console_assets/`): plain
HTML, CSS and a small script, read once at startup and served with a
Content-Security-Policy that allows scripts and styles from this origin only,
so no inline script runs, whatever a run name, a metadata value or a
checkpoint name holds (the script also writes every such value as text,
never as markup). The page itself needs no key; it asks for one and sends it
as `X-API-Key` on every call, as the SDK does (open mode needs none).

Its routes answer what the console shows (actors/console_views.py):
- `GET /openrl/v1/runs`: the runs the caller may see, with their model status;
- `GET /openrl/v1/runs/{run_id}`: one run and its checkpoints;
- `GET /openrl/v1/runs/{run_id}/curves?after=<seq>`: its training points newer
  than `after`, and its sampling throughput;
- `GET /openrl/v1/node`: this node's devices, time-slicer turns, worker groups and host memory.
A caller sees their own runs; the operator's key (api/auth.py) sees all. In a
cluster the relay sends a run's routes to its home node, merges the run list
from every live member, and sends `/openrl/v1/node?node=<name>` to that member.
These routes decode, authenticate and route; they change nothing.
"""

from __future__ import annotations

import functools
from importlib import resources

from quart import request

from openrld.actors.console_views import ConsoleViews, node_view
from openrld.api.app import Services, caller
from openrld.api.asgi import Reply, json_reply
from openrld.api.rest import int_arg
from openrld.errors import NotFound

ASSETS = "console_assets"
# Each file the page is made of, with its type; nothing else under /console is served.
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# Scripts, styles and calls from this origin only: no inline script or style, no other host.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
)


@functools.cache
def load_assets() -> dict[str, bytes]:
    """The page's files, read from the package once (`app.build_app` reads them as it binds the routes)."""
    folder = resources.files("openrld.api").joinpath(ASSETS)
    return {name: folder.joinpath(name).read_bytes() for name in _FILES}


# ---------------------------------------------------------------- the page (it needs no key and no state)


async def console_page(services: Services) -> Reply:
    return _asset("index.html")


async def console_file(services: Services, name: str) -> Reply:
    if name not in _FILES or name == "index.html":
        return Reply(b"not found", content_type="text/plain", status=404, headers=_SECURITY_HEADERS)
    return _asset(name)


def _asset(name: str) -> Reply:
    return Reply(load_assets()[name], content_type=_FILES[name], headers=_SECURITY_HEADERS)


# ---------------------------------------------------------------- the routes it polls


async def console_runs(services: Services) -> Reply:
    user = caller(services)
    limit = int_arg("limit", 20, 1, 1000)
    offset = int_arg("offset", 0, 0, 10**9)
    return json_reply(_views(services).runs(user, sees_all=services.auth.sees_all(user), limit=limit, offset=offset))


async def console_run(services: Services, run_id: str) -> Reply:
    user = caller(services)
    return json_reply(_views(services).run(user, run_id, sees_all=services.auth.sees_all(user)))


async def console_curves(services: Services, run_id: str) -> Reply:
    user = caller(services)
    after = int_arg("after", -1, -1, 2**62)
    return json_reply(
        await _views(services).curves(user, run_id, sees_all=services.auth.sees_all(user), after_seq=after)
    )


async def console_node(services: Services) -> Reply:
    caller(services)
    here = services.cluster.name if services.cluster is not None else services.config.node_name
    name = request.args.get("node")
    if name not in (None, "", here):  # the relay has sent a living member's name on to it
        raise NotFound(f"no cluster member {name!r} known to this node")
    devices = services.node_devices
    return json_reply(
        node_view(
            here or "",
            {d.name: (d.kind, d.memory_bytes) for d in services.devices},
            devices.pool.statistics() if devices is not None else [],
            devices.statistics() if devices is not None else [],
            services.groups.statistics(),
            services.groups.host_memory.statistics() if services.groups.host_memory is not None else None,
        )
    )


def _views(services: Services) -> ConsoleViews:
    # Its routes are bound only on a node that has console views (routes.py: is_console).
    assert services.console is not None
    return services.console
