"""One hierarchy for every error openrld reports.

A `UserError` is the caller's fault and maps to a 4xx (or to a failed future
with category "user"); a `ServerError` is ours and maps to a 5xx (category
"server"). Each carries its HTTP status, a `detail` that says what was wrong and
what was received, and the offending settings `key` where there is one. The API
turns these into `{"detail": ...}` with `api.wire.error_body`, through
`api.fastpath.error_reply` (api/app.py says where each layer does); nothing else formats errors.
"""

from __future__ import annotations


class OpenrldError(Exception):
    status: int = 500
    category: str = "server"

    def __init__(self, detail: str, *, key: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.key = key


class UserError(OpenrldError):
    status = 400
    category = "user"


class BadRequest(UserError):
    status = 400


class Unauthorized(UserError):
    status = 401


class InvalidToken(Unauthorized):
    """A JWT that is malformed, expired or not ours; the SDK re-exchanges its key and replays once."""


class Forbidden(UserError):
    """Credentials were given and are wrong: a peer whose tag does not match the cluster secret."""

    status = 403


class NotFound(UserError):
    status = 404


class Conflict(UserError):
    status = 409


class Gone(UserError):
    """The thing existed but is no more: a future lost to a restart, a finished session."""

    status = 410


class UnsupportedMediaType(UserError):
    """A body whose Content-Type the route does not take."""

    status = 415


class TooManyRequests(UserError):
    status = 429


class NotSupportedYet(UserError):
    """A setting or option that openrld knows but has not built; never silently ignored."""

    status = 400


class ServerError(OpenrldError):
    status = 500
    category = "server"


class EngineLost(ServerError):
    """An engine's worker died (killed, out of memory), hung past its heartbeat deadline or
    broke the worker protocol, and the weights and optimizer state it held went with it
    (`openrld/worker/client.py`)."""


class ServiceUnavailable(ServerError):
    """The daemon is shutting down; the client retries against it or another node."""

    status = 503


class NoCapacity(BadRequest):
    """This node has no device for the job (openrl.exclusive and none free); another node may.

    A placer that offered the job here tries the next node (`cluster/placement/offers.py`);
    on a node alone it is the caller's 400, naming the key.
    """

    no_capacity = True


class NoSharedDevice(ServiceUnavailable):
    """Every device of this node is held by an exclusive job; another node may take the job."""

    no_capacity = True

