"""Any node answers: an ASGI layer that sends each request to the node its job lives on.

A clustered node puts this in front of its app. For every request it finds
the id the route is about (a model id in the body, a request id, a sampling
session, a run id in the path), asks the job directory where that lives, and:

- here: the request goes on to this node's app untouched;
- another live node: the raw request is relayed to that node's API with the
  caller's own headers (so the home node enforces the same auth), marked as
  relayed so it is never relayed twice, and its answer is passed back;
- a dead node: it is tried once with a short connect timeout (a loaded node
  can be declared dead and still be there); if it does not answer, the
  answer is a 410 naming the node and the last checkpoint to restore from
  (or, for the model status route, the job's `lost` status), never a hang;
- nowhere known: the other members are asked (`POST /openrl/peer/v1/locate`),
  and the id is answered here if none has it.

`create_model` is placed: the ranked nodes (`actors/placement`) are offered
the job in turn; one that has no room answers with the `x-openrl-no-capacity`
header and the next is tried. Listing training runs or checkpoints asks every
live member and merges the pages; a session's finish is told to every live
member, so that jobs placed elsewhere end too. A relayed request that may create something
at the home node carries the caller's session, signed with the cluster
secret, so the home node can record the session it belongs to.

This module decodes and routes only; the directory and the placer own the state.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import logging
import re
import urllib.parse
from typing import Any, Awaitable, Callable

import httpx
import msgspec
import trio

from openrld import ids, settings as job_settings
from openrld.actors.directory import Directory, Home, Where
from openrld.actors.jobs import SessionSnapshot
from openrld.actors.membership.messages import MemberState
from openrld.actors.membership.table import Member
from openrld.actors.model_status import GroupView, JobFacts, build_status
from openrld.actors.placement import ClusterPlacer, JobNeeds, Reply, needs_of_note, needs_of_settings
from openrld.api import wire
from openrld.api.fastpath import NO_CAPACITY_HEADER, error_headers, until_disconnect
from openrld.api.proto import forward_backward_model_id
from openrld.errors import OpenrldError, UserError
from openrld.metrics import RelayCounters

logger = logging.getLogger(__name__)

RELAYED_HEADER = "x-openrl-relayed-by"  # the node that relayed the request; the receiver never relays it again
SESSION_HEADER = "x-openrl-session"  # base64 JSON SessionSnapshot
SESSION_TAG_HEADER = "x-openrl-session-tag"  # HMAC of SESSION_HEADER's value with the cluster secret
LOCATE_PATH = "/openrl/peer/v1/locate"
LOCATE_TAG_HEADER = "x-openrl-locate-tag"
CONNECT_S = 5.0  # to connect to a live member
DEAD_CONNECT_S = 1.0  # to a member declared dead: a call to a lost job must fail at once, not hang
RELAY_FAILED = "did not answer"

# Not passed on: hop-by-hop headers, the length (recomputed), and compression
# negotiation (httpx hands us the decoded body).
_DROPPED_REQUEST_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding", b"accept-encoding"}
_DROPPED_RESPONSE_HEADERS = {"content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive"}

_MODEL_BODY_ROUTES = {
    "/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/save_weights", "/api/v1/save_weights_for_sampler",
    "/api/v1/save_weights_external", "/api/v1/get_info", "/api/v1/load_weights",
}
# Requests that create a job or a sampling session under the caller's session (which the home may lack).
_CREATING_ROUTES = {"/api/v1/create_model", "/api/v1/load_weights", "/api/v1/create_sampling_session"}
# Bodies naming a request id or a session id: their home is the node that minted the id.
_MINTED_ID_ROUTES = {"/api/v1/retrieve_future", "/api/v1/cancel_future", "/api/v1/session_heartbeat"}
# List routes merged from every member: (the list's key, the field it is ordered by, newest first).
_FANOUT_LISTS = {
    "/api/v1/training_runs": ("training_runs", "last_request_time"),
    "/api/v1/checkpoints": ("checkpoints", "time"),
    "/openrl/v1/runs": ("runs", "created"),  # the console's run list
}
_RUN_PATH = re.compile(r"^/api/v1/training_runs/([^/]+)(/.*)?$")
_STATUS_PATH = re.compile(r"^/openrl/v1/models/([^/]+)/status$")
_CONSOLE_RUN_PATH = re.compile(r"^/openrl/v1/runs/([^/]+)(/curves)?$")
NODE_PATH = "/openrl/v1/node"  # ?node=<name>: that member's own device view
_SAMPLER_PATH = re.compile(r"^/api/v1/samplers/(.+)$")
_SESSION_PATH = re.compile(r"^/api/v1/sessions/(s-[^/]+)(/finish|/project|/trace_export)?$")


class _Ids(msgspec.Struct):
    """The ids a body may name; everything else in it is the home node's to decode."""

    model_id: str | None = None
    request_id: str | None = None
    session_id: str | None = None
    sampling_session_id: str | None = None
    sampling_session_seq_id: int | None = None
    model_seq_id: int | None = None
    model_path: str | None = None
    path: str | None = None
    tinker_path: str | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None


class _Unread(enum.Enum):
    """Why a body was not read whole."""

    TOO_LARGE = "too large"
    DISCONNECTED = "disconnected"


_TOO_LARGE = _Unread.TOO_LARGE
_DISCONNECTED = _Unread.DISCONNECTED


class Located(msgspec.Struct, frozen=True):
    """The body of a locate answer."""

    here: bool


class LocateQuery(msgspec.Struct, frozen=True):
    kind: str  # "model" or "sampler"
    id: str


class Answer(msgspec.Struct, frozen=True):
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def relay_key(secret: str) -> bytes:
    """The key that signs relayed sessions and locate queries (not the gossip key: another purpose)."""
    return hashlib.sha256(b"openrl-relay\0" + secret.encode()).digest()


def sign(key: bytes, value: bytes) -> str:
    return hmac.new(key, value, hashlib.sha256).hexdigest()


def _json(status: int, value: object, headers: list[tuple[bytes, bytes]] | None = None) -> Answer:
    return Answer(status, [(b"content-type", b"application/json"), *(headers or [])], msgspec.json.encode(value))


def _detail(status: int, detail: str) -> Answer:
    return _json(status, {"detail": detail})


class Relay:
    """ASGI: routes each request to its home node; see the module docstring."""

    def __init__(
        self,
        inner: Callable[..., Awaitable[None]],
        *,
        directory: Directory,
        client: httpx.AsyncClient,
        counters: RelayCounters,
        secret: str,
        user_for: Callable[[str | None], str],
        session_snapshot: Callable[[str], SessionSnapshot | None],
        mirror_session: Callable[[SessionSnapshot], None],
        resolve_model: Callable[[str], str],
        accept_jobs: bool,
        max_body_bytes: int,
        relay_timeout_s: float,
        longpolls: frozenset[str] = frozenset(),
        tls: bool = False,
    ) -> None:
        self._inner = inner
        self._directory = directory
        self._client = client
        self._key = relay_key(secret)
        self._user_for = user_for
        self._session_snapshot = session_snapshot
        self._mirror_session = mirror_session
        self._resolve_model = resolve_model
        self._accept_jobs = accept_jobs
        self._max_body_bytes = max_body_bytes
        self._timeout_s = relay_timeout_s
        self._longpolls = longpolls  # relayed waits that end when their client goes away
        self._tls = tls  # this node speaks TLS: a caller's key never goes to a peer in plain HTTP
        self._counters = counters
        self._placement: ClusterPlacer[Answer] = ClusterPlacer(directory, counters)

    # ------------------------------------------------------------ ASGI

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if RELAYED_HEADER.encode() in headers:
            self._take_session(headers)
            await self._inner(scope, receive, send)
            return
        if scope["path"] == LOCATE_PATH:
            await self._send(send, await self._locate_here(scope, receive, headers))
            return
        body = await self._read(receive)
        if body is _DISCONNECTED:
            return  # the client went away mid-body: nothing is relayed, nobody is answered
        if body is _TOO_LARGE:
            await self._send(send, _detail(413, f"request body over {self._max_body_bytes} bytes"))
            return
        try:
            if scope["method"] == "GET" and scope["path"] in _FANOUT_LISTS:
                answer = await self._fan_out(scope, headers, *_FANOUT_LISTS[scope["path"]])
            elif scope["path"] in self._longpolls:
                routed = await until_disconnect(receive, self._route_boxed, scope, headers, body)
                if routed is None:
                    return  # the client went away while its poll waited at the home node
                answer = routed[0]
            else:
                answer = await self._route(scope, headers, body)
        except OpenrldError as error:
            answer = Answer(
                error.status, [(b"content-type", b"application/json"), *error_headers(error)],
                msgspec.json.encode({"detail": error.detail}),
            )
        except Exception as error:  # one request's failure is its own; the daemon keeps serving
            logger.exception("unhandled error in the relay path=%s", scope["path"])
            answer = _detail(500, f"internal error: {type(error).__name__}")
        if answer is None:
            await self._inner(scope, _replay(body, then=receive), send)
        else:
            await self._send(send, answer)

    async def _route_boxed(self, scope: dict, headers: dict[bytes, bytes], body: bytes) -> tuple[Answer | None]:
        """`_route`'s answer in a box, so that None (answer here) differs from no answer at all."""
        return (await self._route(scope, headers, body),)

    async def _route(self, scope: dict, headers: dict[bytes, bytes], body: bytes) -> Answer | None:
        """The answer from another node, or None: this node answers."""
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == "/api/v1/create_model":
            return await self._place(scope, headers, body)
        if method == "POST" and path in _MODEL_BODY_ROUTES:
            ref = _ids(path, body, headers, self._max_body_bytes)
            if ref is None:
                return None
            if ref.model_id is None and path == "/api/v1/load_weights" and ref.path:
                return await self._restore(scope, headers, body, ref)
            if ref.model_id is None:
                return None
            answer = await self._to_model(scope, headers, body, ref.model_id)
            if answer is not None and path == "/api/v1/save_weights_for_sampler" and answer.status == 200:
                if ref.sampling_session_seq_id is not None:
                    sampler_id = ids.sampling_session_id(ref.model_id.split(":", 1)[0], ref.sampling_session_seq_id)
                    self._directory.record(sampler_id, self._home_name(ref.model_id))
            return answer
        if method == "POST" and path in _MINTED_ID_ROUTES:
            ref = _ids(path, body, headers)
            minted = ref.request_id or ref.session_id if ref is not None else None
            return await self._to(scope, headers, body, self._directory.tagged(minted), minted) if minted else None
        if method == "POST" and path == "/api/v1/asample":
            ref = _ids(path, body, headers)
            sampler_id = ref.sampling_session_id if ref is not None else None
            return await self._to_sampler(scope, headers, body, sampler_id) if sampler_id else None
        if method == "POST" and path == "/api/v1/create_sampling_session":
            ref = _ids(path, body, headers)
            if ref is None or ref.session_id is None or ref.sampling_session_seq_id is None:
                return None
            sampler_id = ids.sampling_session_id(ref.session_id, ref.sampling_session_seq_id)
            if ref.model_path is None:
                return await self._base_model_sampler(scope, headers, body, ref, sampler_id)
            answer = await self._to_run_of(scope, headers, body, ref.model_path, lost_here=True)
            if answer is not None and answer.status == 200:
                self._directory.record(sampler_id, self._home_name(_run_of(ref.model_path) or ""))
            return answer
        if method == "POST" and path == "/api/v1/weights_info":
            ref = _ids(path, body, headers)
            tinker_path = ref.tinker_path if ref is not None else None
            return await self._to_run_of(scope, headers, body, tinker_path, lost_here=True) if tinker_path else None
        if (match := _SESSION_PATH.match(path)) is not None:
            if method == "POST" and match[2] == "/finish":
                return await self._finish_everywhere(scope, headers, body, match[1])
            return await self._to(scope, headers, body, self._directory.tagged(match[1]), match[1])
        if (match := _SAMPLER_PATH.match(path)) is not None:
            return await self._to_sampler(scope, headers, body, match[1])
        if (match := _STATUS_PATH.match(path)) is not None:
            home = await self._model_home(match[1])
            if home.where is Where.LOST:
                answer = await self._if_it_answers(scope, headers, body, home, match[1])
                return answer if answer is not None else self._lost_status(headers, match[1], home)
            return await self._to(scope, headers, body, home, match[1])
        if (match := _RUN_PATH.match(path)) is not None:
            home = await self._model_home(match[1])
            return None if home.where is Where.LOST else await self._to(scope, headers, body, home, match[1])
        if (match := _CONSOLE_RUN_PATH.match(path)) is not None:
            return await self._to_model(scope, headers, body, match[1])
        if method == "GET" and path == NODE_PATH:
            return await self._to_member(scope, headers, body)
        return None

    async def _to_member(self, scope: dict, headers: dict, body: bytes) -> Answer | None:
        """`/openrl/v1/node?node=<name>` goes to that member; without a name, or this node's, it is answered here."""
        name = urllib.parse.parse_qs(scope.get("query_string", b"").decode()).get("node", [""])[0]
        if name in ("", self._directory.local_name):
            return None
        self._user_for(_header(headers, b"x-api-key"))  # a bad key is refused here, not relayed
        member = next((m for m in self._directory.members() if m.name == name), None)
        if member is None:
            return _detail(404, f"no cluster member {name!r}")
        if not member.is_alive:
            return _detail(410, f"node {name} is {member.state.name.lower()}")
        return await self._forward(scope, headers, body, member, name)

    async def _finish_everywhere(self, scope: dict, headers: dict, body: bytes, session_id: str) -> Answer:
        """A session finishes at its home, and then on every member that holds jobs of it (placed there),
        so that their own groups end and free their devices too."""
        home = self._directory.tagged(session_id)
        answer = await self._to(scope, headers, body, home, session_id)
        if answer is None:
            answer = await self._local(scope, body)
        if answer.status != 200:
            return answer
        home_name = home.member.name if home.member is not None else self._directory.local_name

        async def tell(member: Member) -> None:
            if member.name == self._directory.local_name:
                await self._local(scope, body)
            else:
                await self._forward(scope, headers, body, member, session_id)

        async with trio.open_nursery() as nursery:
            for member in self._directory.members():
                if member.is_alive and member.name != home_name:
                    nursery.start_soon(tell, member)  # a member without the session answers 404: nothing to end
        return answer

    # ------------------------------------------------------------ homes

    async def _model_home(self, model_id: str) -> Home:
        return await self._home("model", model_id, self._directory.model)

    async def _home(self, kind: str, some_id: str, lookup: Callable[[str], Home]) -> Home:
        """The directory's answer, or, for an id it does not know, the member that says it has it."""
        home = lookup(some_id)
        if home.where is Where.UNKNOWN:
            name = await self._ask_members(kind, some_id)
            if name is not None:
                self._directory.record(some_id, name)
                home = lookup(some_id)
        return home

    def _home_name(self, model_id: str) -> str:
        home = self._directory.model(model_id)
        return home.member.name if home.member is not None else self._directory.local_name

    async def _to_model(self, scope: dict, headers: dict, body: bytes, model_id: str) -> Answer | None:
        return await self._to(scope, headers, body, await self._model_home(model_id), model_id)

    async def _to_run_of(self, scope: dict, headers: dict, body: bytes, path: str, *, lost_here: bool) -> Answer | None:
        """A request about a checkpoint goes to its run's home; a lost home's checkpoints may be read here
        (a shared checkpoint root), so with `lost_here` this node answers."""
        run_id = _run_of(path)
        if run_id is None:
            return None
        home = await self._model_home(run_id)
        if home.where is Where.LOST and lost_here:
            return None
        return await self._to(scope, headers, body, home, run_id)

    async def _to_sampler(self, scope: dict, headers: dict, body: bytes, sampler_id: str) -> Answer | None:
        home = await self._home("sampler", sampler_id, self._directory.sampler)
        return await self._to(scope, headers, body, home, sampler_id)

    async def _to(self, scope: dict, headers: dict, body: bytes, home: Home, what: str) -> Answer | None:
        if home.where in (Where.LOCAL, Where.UNKNOWN):
            return None
        assert home.member is not None
        if home.where is Where.LOST:
            answer = await self._if_it_answers(scope, headers, body, home, what)
            if answer is not None:
                return answer
            self._counters.lost += 1
            return _detail(410, _lost_detail(what, home))
        return await self._forward(scope, headers, body, home.member, what)

    async def _if_it_answers(self, scope: dict, headers: dict, body: bytes, home: Home, what: str) -> Answer | None:
        """A node declared dead may have been only slow (a loaded machine, a short partition): if it still
        answers at once, its answer stands and the job is not lost. A node that left is gone for good."""
        assert home.member is not None
        if home.member.state is not MemberState.DEAD:
            return None
        answer = await self._forward(scope, headers, body, home.member, what, connect_timeout_s=DEAD_CONNECT_S)
        return None if answer.status == 503 and RELAY_FAILED in answer.body.decode(errors="replace") else answer

    # ------------------------------------------------------------ placement

    async def _place(self, scope: dict, headers: dict, body: bytes) -> Answer | None:
        """create_model: offer the job to the ranked nodes until one takes it."""
        try:
            req = msgspec.json.decode(body, type=wire.CreateModelRequest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # this node's app says what is wrong with it
        session = self._session_snapshot(req.session_id)
        if session is None:
            home = self._directory.tagged(req.session_id)
            return await self._to(scope, headers, body, home, req.session_id)
        try:
            settings, _ = job_settings.parse_settings(
                session.tags, session.user_metadata, {str(k): str(v) for k, v in (req.user_metadata or {}).items()}
            )
            base_model = self._resolve_model(req.base_model)
        except UserError:
            return None  # this node's app refuses it with the same message, before placing anything
        needs = needs_of_settings(settings, base_model)
        return await self._offer(scope, headers, body, needs, ids.model_id(req.session_id, req.model_seq_id))

    async def _base_model_sampler(self, scope: dict, headers: dict, body: bytes, ref: _Ids, sampler_id: str) -> Answer | None:
        """A sampling session of a base model: here, unless this node takes no jobs; then placed like a LoRA job."""
        if self._accept_jobs or ref.base_model is None:
            return None
        try:
            base_model = self._resolve_model(ref.base_model)
        except UserError:
            return None
        needs = JobNeeds(base_model=base_model, own_group=False, is_exclusive=False)
        return await self._offer(scope, headers, body, needs, sampler_id)

    async def _restore(self, scope: dict, headers: dict, body: bytes, ref: _Ids) -> Answer | None:
        """create_training_client_from_state: where the checkpoint's run lives; if that node is lost,
        placed anew like create_model (the node that takes it reads the checkpoint from the shared root)."""
        run_id = _run_of(ref.path or "")
        if run_id is None or ref.session_id is None or ref.model_seq_id is None:
            return None
        home = await self._model_home(run_id)
        if home.where is not Where.LOST:
            return await self._to(scope, headers, body, home, run_id)
        if self._session_snapshot(ref.session_id) is None:
            return await self._to(scope, headers, body, self._directory.tagged(ref.session_id), ref.session_id)
        needs = needs_of_note(home.note)
        return await self._offer(scope, headers, body, needs, ids.model_id(ref.session_id, ref.model_seq_id))

    async def _offer(self, scope: dict, headers: dict, body: bytes, needs: JobNeeds, created_id: str) -> Answer | None:
        """Offer a job-creating request to the ranked nodes in turn (`actors/placement`); the first that has room answers."""

        async def ask(member: Member) -> tuple[Reply, Answer]:
            if member.name == self._directory.local_name:
                answer = await self._local(scope, body)
            else:
                answer = await self._forward(scope, headers, body, member, created_id)
            if any(k == NO_CAPACITY_HEADER for k, _ in answer.headers):
                return Reply.NO_ROOM, answer
            return (Reply.TAKEN if answer.status == 200 else Reply.FAILED), answer

        answer = await self._placement.offer(needs, created_id, ask)
        if answer is not None or self._accept_jobs:
            return answer
        return _detail(
            503, f"no node of the cluster can take {created_id} ({needs.base_model}) now: none has a free or shareable device"
        )

    async def _local(self, scope: dict, body: bytes) -> Answer:
        """Run a request through this node's own app and keep its answer."""
        answer: dict[str, Any] = {"headers": [], "body": b""}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")

        await self._inner(scope, _replay(body), capture)
        headers = [(k, v) for k, v in answer["headers"] if k != b"content-length"]
        return Answer(answer.get("status", 500), headers, answer["body"])

    # ------------------------------------------------------------ relaying

    async def _forward(
        self, scope: dict, headers: dict[bytes, bytes], body: bytes, member: Member, what: str,
        connect_timeout_s: float = CONNECT_S,
    ) -> Answer:
        if self._tls and not member.peer_url.startswith("https://"):
            # The caller's key crosses the network with the request; under TLS it never goes in plain text.
            self._counters.unreachable += 1
            return _detail(
                503, f"{what} lives on node {member.name}, which serves plain HTTP ({member.peer_url}) while this "
                "node uses TLS; give every node of the cluster tls_certfile and tls_keyfile"
            )
        out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _DROPPED_REQUEST_HEADERS]
        out.append((RELAYED_HEADER, self._directory.local_name))
        out.extend(self._session_headers(scope["path"], body))
        url = member.peer_url + scope["path"] + (("?" + scope["query_string"].decode()) if scope.get("query_string") else "")
        self._counters.relayed += 1
        try:
            response = await self._client.request(
                scope["method"], url, headers=out, content=body,
                timeout=httpx.Timeout(self._timeout_s, connect=connect_timeout_s),
            )
        except httpx.HTTPError as exc:
            self._counters.unreachable += 1
            logger.warning("relay failed node=%s id=%s: %s", member.name, what, exc)
            return _detail(
                503, f"{what} lives on node {member.name}, which {RELAY_FAILED} ({type(exc).__name__}); retry, or "
                "wait until the cluster declares it dead"
            )
        kept = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in response.headers.multi_items()
            if k.lower() not in _DROPPED_RESPONSE_HEADERS
        ]
        return Answer(response.status_code, kept, response.content)

    def _session_headers(self, path: str, body: bytes) -> list[tuple[str, str]]:
        """The caller's session, signed, for the requests that create a job or sampler at the home node.

        Only those: every later call for the job finds the session already there,
        so the training loop's hot calls pay no store read and no second decode.
        """
        if path not in _CREATING_ROUTES:
            return []
        ref = _ids(path, body, {})
        snapshot = self._session_snapshot(ref.session_id) if ref is not None and ref.session_id else None
        if snapshot is None:
            return []
        value = base64.urlsafe_b64encode(msgspec.json.encode(snapshot)).decode()
        return [(SESSION_HEADER, value), (SESSION_TAG_HEADER, sign(self._key, value.encode()))]

    def _take_session(self, headers: dict[bytes, bytes]) -> None:
        """Record the session a relayed request carries, if the cluster secret signed it."""
        value = headers.get(SESSION_HEADER.encode())
        tag = headers.get(SESSION_TAG_HEADER.encode())
        if value is None or tag is None:
            return
        if not hmac.compare_digest(sign(self._key, value), tag.decode("latin-1")):
            logger.warning("relayed session with a bad tag dropped")
            return
        try:
            snapshot = msgspec.json.decode(base64.urlsafe_b64decode(value), type=SessionSnapshot)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("relayed session that does not decode dropped")
            return
        self._mirror_session(snapshot)

    def _lost_status(self, headers: dict[bytes, bytes], model_id: str, home: Home) -> Answer:
        user = self._user_for(_header(headers, b"x-api-key"))
        note = home.note
        if note is None or note.owner != user:
            return _detail(404, f"no model {model_id!r}")
        facts = JobFacts(
            model_id=model_id, base_model=note.base_model, fine_tuning_type=note.fine_tuning_type,
            is_exclusive=note.is_exclusive, is_resident=False, last_checkpoint=note.last_checkpoint or None,
        )
        return _json(200, build_status(facts, GroupView(False, None, None, None, None)))

    # ------------------------------------------------------------ lists and locate

    async def _fan_out(self, scope: dict, headers: dict[bytes, bytes], key: str, order_by: str) -> Answer:
        """A list route's page, merged from every live member's."""
        self._user_for(_header(headers, b"x-api-key"))  # a bad key is refused here, once, not by every member
        query = dict(
            pair.split("=", 1) for pair in scope.get("query_string", b"").decode().split("&") if "=" in pair
        )
        try:
            limit = int(query.get("limit", "100" if key == "checkpoints" else "20"))
            offset = int(query.get("offset", "0"))
        except ValueError:
            return _detail(400, "limit and offset must be integers")
        if limit < 1 or offset < 0:
            return _detail(400, f"limit must be >= 1 and offset >= 0, got limit={limit} offset={offset}")
        sub_query = "&".join(f"{k}={v}" for k, v in {**query, "limit": str(offset + limit), "offset": "0"}.items())
        sub_scope = {**scope, "query_string": sub_query.encode()}
        pages: list[Answer] = []

        async def one(member: Member) -> None:
            if member.name == self._directory.local_name:
                pages.append(await self._local(sub_scope, b""))
            else:
                pages.append(await self._forward(sub_scope, headers, b"", member, scope["path"]))

        async with trio.open_nursery() as nursery:
            for member in self._directory.members():
                if member.is_alive:
                    nursery.start_soon(one, member)
        items: dict[str, dict] = {}
        total = 0
        for page in pages:
            if page.status != 200:
                if page.status < 500:
                    return page
                continue  # a member that cannot answer now is left out of the page
            body = msgspec.json.decode(page.body)
            total += body["cursor"]["total_count"]
            for item in body[key]:
                items.setdefault(item.get("training_run_id") or item.get("tinker_path"), item)
        merged = sorted(items.values(), key=lambda item: item.get(order_by, ""), reverse=True)
        return _json(200, {key: merged[offset : offset + limit], "cursor": {"offset": offset, "limit": limit, "total_count": total}})

    async def _ask_members(self, kind: str, some_id: str) -> str | None:
        """The first live member that says it is home to `some_id`."""
        body = msgspec.json.encode(LocateQuery(kind, some_id))
        tag = sign(self._key, body)
        found: list[str] = []

        async def ask(member: Member, cancel: trio.CancelScope) -> None:
            try:
                response = await self._client.post(
                    member.peer_url + LOCATE_PATH, content=body, headers={LOCATE_TAG_HEADER: tag}, timeout=5.0
                )
                if response.status_code == 200 and msgspec.json.decode(response.content, type=Located).here:
                    found.append(member.name)
                    cancel.cancel()
            except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
                return

        async with trio.open_nursery() as nursery:
            for member in self._directory.members():
                if member.is_alive and member.name != self._directory.local_name:
                    nursery.start_soon(ask, member, nursery.cancel_scope)
        return found[0] if found else None

    async def _locate_here(self, scope: dict, receive: Callable, headers: dict[bytes, bytes]) -> Answer:
        body = await self._read(receive)
        tag = headers.get(LOCATE_TAG_HEADER.encode(), b"").decode("latin-1")
        if not isinstance(body, bytes) or scope["method"] != "POST":
            return _detail(400, "locate takes a small POST body")
        if not hmac.compare_digest(sign(self._key, body), tag):
            return _detail(403, "locate needs a tag made with the cluster secret")
        try:
            query = msgspec.json.decode(body, type=LocateQuery)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _detail(400, f"invalid locate body: {exc}")
        home = self._directory.model(query.id) if query.kind == "model" else self._directory.sampler(query.id)
        return _json(200, Located(here=home.where is Where.LOCAL))

    # ------------------------------------------------------------ plumbing

    async def _read(self, receive: Callable) -> bytes | _Unread:
        """The whole body; _TOO_LARGE past max_body_bytes (no more is read), _DISCONNECTED if the client left mid-body."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _DISCONNECTED
            body += message.get("body", b"")
            if len(body) > self._max_body_bytes:
                return _TOO_LARGE
            if not message.get("more_body", False):
                return bytes(body)

    @staticmethod
    async def _send(send: Callable, answer: Answer) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [*answer.headers, (b"content-length", str(len(answer.body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer.body})


def _replay(body: bytes, then: Callable[[], Awaitable[dict]] | None = None) -> Callable[[], Awaitable[dict]]:
    """An ASGI receive that hands over `body` once, then passes on the connection's own
    messages (`then`: its disconnect), or waits like a connection that stays open."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if then is not None:
            return await then()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def _ids(path: str, body: bytes, headers: dict[bytes, bytes], max_body_bytes: int = 0) -> _Ids | None:
    """The ids a request body names; None if it does not decode (the home app explains why).

    A forward_backward body is read only as far as its model_id: the node that serves it decodes it whole.
    """
    if path == "/api/v1/forward_backward":
        model_id = forward_backward_model_id(body, _header(headers, b"content-encoding"), max_body_bytes=max_body_bytes)
        return _Ids(model_id=model_id) if model_id is not None else None
    try:
        return msgspec.json.decode(body, type=_Ids)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _run_of(path: str) -> str | None:
    try:
        return ids.parse_tinker_path(path).run_id
    except UserError:
        return None


def _lost_detail(what: str, home: Home) -> str:
    assert home.member is not None
    state = home.member.state.name.lower()
    restore = home.note.last_checkpoint if home.note is not None else ""
    hint = (
        f"its last checkpoint is {restore}: resume with create_training_client_from_state"
        if restore else "it saved no checkpoint this cluster knows of"
    )
    return f"{what} was lost with node {home.member.name} ({state}); {hint}"
