"""What a request is refused for from its head alone, before any byte of its body is read.

The outermost ASGI layer of the daemon's app. Two refusals need nothing but the head:
- a `Content-Length` over `max_body_bytes`: 413 (a chunked body is still
  counted as it arrives, by whichever layer reads it);
- with a key file, a missing or unknown `X-API-Key` (or a bad JWT): 401,
  with the same headers the routes send.
So a client without a key cannot make the node read, buffer or relay a
body, and the HTTP server only drops what is already on its way (up to
its unread-body limit, within `discard_timeout`). Paths that carry their
own proof instead of a key pass through (`routes.py` marks them `is_keyless`):
health and metrics, the peer API (cluster-secret HMAC) and signed download
URLs; and the console's static page, which holds nothing and asks for the key
it then sends with each call.

This module decodes and refuses only; who a key belongs to is the
Authenticator's to say. The user it finds is left in the scope
(`auth.SCOPE_USER`), so the key is looked up once per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from openrld.api.asgi import Reply, detail_reply, send_whole
from openrld.api.auth import SCOPE_USER, Authenticator
from openrld.api.fastpath import error_reply
from openrld.api.http1 import ASGIApp
from openrld.api.metrics import RequestMetrics
from openrld.errors import OpenrldError

if TYPE_CHECKING:
    from openrld.api.routes import RouteTable

REFUSED_ENDPOINT = "refused_from_head"  # the metrics label of what the gate answers


class Gate:
    """ASGI: refuses from the head what must not get as far as reading a body; passes the rest on."""

    def __init__(
        self, inner: ASGIApp, *, auth: Authenticator, routes: RouteTable, max_body_bytes: int, metrics: RequestMetrics
    ) -> None:
        self._inner = inner
        self._auth = auth
        self._routes = routes  # which paths need no key
        self._max_body_bytes = max_body_bytes
        self._metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        arrived_s = time.perf_counter()
        refusal = self._refusal(scope)
        if refusal is None:
            await self._inner(scope, receive, send)
            return
        self._metrics.observe(REFUSED_ENDPOINT, scope["method"], refusal.status, time.perf_counter() - arrived_s)
        await send_whole(send, refusal)

    def _refusal(self, scope: dict) -> Reply | None:
        length = key = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"x-api-key":
                key = value
        # h11 has refused a Content-Length that is not a number before the app sees the request.
        if length is not None and int(length) > self._max_body_bytes:
            return detail_reply(413, f"request body over {self._max_body_bytes} bytes")
        path = scope["path"]
        if self._auth.is_open or self._routes.is_keyless(path):
            return None
        try:
            scope[SCOPE_USER] = self._auth.user_for(key.decode("latin-1") if key is not None else None)
        except OpenrldError as error:
            return error_reply(error)
        return None
