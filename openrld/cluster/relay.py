"""Any node answers: an ASGI layer that sends each request to the node its job lives on.

A clustered node puts this in front of its app. For every request it finds
the id the route is about (a model id in the body, a request id, a sampling
session, a run id in the path), asks the job directory where that lives, and:

- here: the request goes on to this node's app untouched;
- another live node: the raw request is relayed to that node's API with the
  caller's own headers (so the home node enforces the same auth), marked as
  relayed so it is never relayed twice, and its answer is passed back;
- a dead node: it is tried once with a short connect timeout (a loaded node
  can be declared dead and still be there); if it does not answer, a job
  that auto-saves waits for the survivor that adopts it (`adoption.py`),
  and the training requests and samples this node kept for the dead node
  are replayed there first (`replay.py`); otherwise the answer is a 410
  naming the node and the last checkpoint to restore from (or, for the
  model status route, the job's `lost` status), never a hang;
- nowhere known: the other members are asked (`POST /openrl/peer/v1/locate`),
  and the id is answered here if none has it.

Each route says how its home is found (`HomeBy`, named per route in
`api/routes.py`). Ids come from the path, or from the body, read only as far
as its ids (`body_ids.py`), so the body is decoded once, by the route of the
node that serves it.

What is not finding homes lives elsewhere in `cluster/`: going to a home and
back, and the 410 of a lost one, in `reach.py`; a job-creating request's
needs and its offers to the ranked nodes in `job_creation.py`, which node
a new job is offered to in `placement/`; calls to other members in
`peer_client.py`; the list routes' merge in `list_fanout.py`; the signed
session a creating request carries in `relayed_session.py`.
This module holds no state of its own; the directory and the placer own it.
"""

from __future__ import annotations

import enum
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import trio

from openrld import ids
from openrld.actors.model_status import lost_status
from openrld.api.asgi import Reply, Unread, detail_reply, json_reply, read_body, replay, send_whole
from openrld.api.auth import user_in
from openrld.api.fastpath import error_reply, until_disconnect
from openrld.cluster.body_ids import Call, Ids, body_ids, header as _header
from openrld.cluster.directory import Directory, Home, Where
from openrld.cluster.job_creation import JobCreation
from openrld.cluster.list_fanout import fan_out
from openrld.cluster.peer_client import (
    LOCATE_PATH as LOCATE_PATH,
    LOCATE_TAG_HEADER as LOCATE_TAG_HEADER,
    RELAYED_HEADER as RELAYED_HEADER,
    LocateQuery,
    PeerClient,
    RelayCounters,
    answer_locate,
)
from openrld.cluster.placement import ClusterPlacer
from openrld.cluster.reach import Reach, is_adoptable
from openrld.cluster.relayed_session import (
    SESSION_HEADER as SESSION_HEADER,
    SESSION_TAG_HEADER as SESSION_TAG_HEADER,
    session_of,
)
from openrld.cluster.replay import KEPT_PATHS, SAMPLE_PATH, Journal, Replay
from openrld.errors import OpenrldError, UserError

if TYPE_CHECKING:
    from openrld.api.routes import RouteTable
    from openrld.cluster.relayed_session import SessionSnapshot

logger = logging.getLogger(__name__)



class HomeBy(enum.Enum):
    """Where a route's request is answered, and how its home is found (each route names one: `api/routes.py`)."""

    HERE = "here"  # by the node that got it
    PLACED = "placed"  # create_model: offered to the ranked nodes until one takes it
    MODEL_IN_BODY = "model in body"  # the home of the body's model_id
    LOAD_WEIGHTS = "load weights"  # the body's model_id, or, creating a job, the home of its checkpoint's run
    SAVE_FOR_SAMPLER = "save for sampler"  # the body's model_id; the sampler it may create is recorded there
    MINTED_IN_BODY = "minted id in body"  # the node that minted the body's request_id or session_id
    SAMPLER_IN_BODY = "sampler in body"  # the home of the body's sampling_session_id
    CREATE_SAMPLER = "create sampler"  # the home of the body's model_path's run; a base model's: here or placed
    CHECKPOINT_IN_BODY = "checkpoint in body"  # the home of the body's tinker_path's run
    SESSION_IN_PATH = "session in path"  # the node that minted <session_id>
    SESSION_FINISH = "session finish"  # <session_id>'s home, then every member that holds jobs of it
    SAMPLER_IN_PATH = "sampler in path"  # the home of <sampler_id>
    MODEL_STATUS = "model status"  # the home of <model_id>; a lost one's status is answered here
    RUN_IN_PATH = "run in path"  # the home of <run_id>; a lost one's rows are read here
    MODEL_IN_PATH = "model in path"  # the home of <run_id>, a job's model id
    NODE_QUERY = "node query"  # the member `?node=` names
    LOCATE = "locate"  # a member asking where an id lives: the relay answers it itself



class Relay:
    """ASGI: routes each request to its home node; see the module docstring."""

    def __init__(
        self,
        inner: Callable[..., Awaitable[None]],
        *,
        directory: Directory,
        peers: PeerClient,
        placement: ClusterPlacer[Reply],
        key: bytes,
        counters: RelayCounters,
        user_for: Callable[[str | None], str],
        session_snapshot: Callable[[str], SessionSnapshot | None],
        mirror_session: Callable[[SessionSnapshot], None],
        resolve_model: Callable[[str], str],
        accept_jobs: bool,
        max_body_bytes: int,
        routes: RouteTable,
        journal: Journal | None = None,
        checkpoint_root: Path | None = None,
        spawn: Callable[..., None] | None = None,
    ) -> None:
        self._inner = inner
        self._routes = routes  # each route's HomeBy, fan-out and long-poll
        self._directory = directory
        self._peers = peers  # locate queries to other members
        self._reach = Reach(
            inner, directory=directory, peers=peers, key=key, counters=counters, session_snapshot=session_snapshot
        )  # to a home and back
        # Training requests kept until an auto-save covers them, replayed on an adopter (replay.py)
        self._replay = Replay(
            reach=self._reach, directory=directory, counters=counters, root=checkpoint_root, spawn=spawn, journal=journal,
            recreate=self._recreate_sampler,
        )
        # Job-creating requests offered to the ranked nodes (job_creation.py)
        self._creation = JobCreation(
            reach=self._reach, directory=directory, placement=placement, session_snapshot=session_snapshot,
            resolve_model=resolve_model, accept_jobs=accept_jobs,
        )
        self._key = key  # relay_key(cluster secret): checks relayed sessions and locate queries
        self._user_for = user_for
        self._mirror_session = mirror_session
        self._max_body_bytes = max_body_bytes

    # ------------------------------------------------------------ ASGI

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if RELAYED_HEADER.encode() in headers:
            snapshot = session_of(headers, self._key)
            if snapshot is not None:
                self._mirror_session(snapshot)
            await self._inner(scope, receive, send)
            return
        matched = self._routes.match(scope["method"], scope["path"])
        if matched is None or (matched.route.home is HomeBy.HERE and matched.route.fan_out is None):
            await self._inner(scope, receive, send)  # nothing to find: no body is read or buffered here
            return
        route, params = matched
        if route.home is HomeBy.LOCATE:
            body = await read_body(receive, self._max_body_bytes)
            tag = _header(headers, LOCATE_TAG_HEADER.encode()) or ""
            readable = body if isinstance(body, bytes) else None
            await send_whole(send, answer_locate(scope["method"], readable, tag, self._key, self._is_here))
            return
        body = await read_body(receive, self._max_body_bytes)
        if body is Unread.DISCONNECTED:
            return  # the client went away mid-body: nothing is relayed, nobody is answered
        if body is Unread.TOO_LARGE:
            await send_whole(send, detail_reply(413, f"request body over {self._max_body_bytes} bytes"))
            return
        call = Call(scope, headers, body, params)
        answer: Reply | None
        try:
            if route.fan_out is not None:
                user_in(scope, _header(headers, b"x-api-key"), self._user_for)  # a bad key is refused here, once, not by every member
                ask = self._reach.asker(replace(call, body=b""), scope["path"])
                answer = await fan_out(scope, route.fan_out, self._directory.members(), ask)
            elif route.is_longpoll:
                routed = await until_disconnect(receive, self._route_boxed, route.home, call)
                if routed is None:
                    return  # the client went away while its poll waited at the home node
                answer = routed[0]
            else:
                answer = await self._route(route.home, call)
        except OpenrldError as error:
            answer = error_reply(error)
        except Exception as error:  # one request's failure is its own; the daemon keeps serving
            logger.exception("unhandled error in the relay path=%s", scope["path"])
            answer = detail_reply(500, f"internal error: {type(error).__name__}")
        if answer is None:
            await self._inner(scope, replay(body, then=receive), send)
        else:
            await send_whole(send, answer)

    async def _route_boxed(self, home_by: HomeBy, call: Call) -> tuple[Reply | None]:
        """`_route`'s answer in a box, so that None (answer here) differs from no answer at all."""
        return (await self._route(home_by, call),)

    async def _route(self, home_by: HomeBy, call: Call) -> Reply | None:
        """The answer from another node, or None: this node answers."""
        return await self._routers[home_by](self, call)

    async def _to_body_model(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        return await self._to_model(call, ref.model_id, ref) if ref is not None and ref.model_id is not None else None

    async def _load_weights(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        if ref is None:
            return None
        call = replace(call, session_id=ref.session_id)  # it may create a job under the caller's session
        if ref.model_id is None and ref.path:
            return await self._restore(call, ref)
        return await self._to_model(call, ref.model_id, ref) if ref.model_id is not None else None

    async def _save_for_sampler(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        if ref is None or ref.model_id is None:
            return None
        answer = await self._to_model(call, ref.model_id, ref)
        if answer is not None and answer.status == 200 and ref.sampling_session_seq_id is not None:
            sampler_id = ids.sampling_session_id(ref.model_id.split(":", 1)[0], ref.sampling_session_seq_id)
            self._directory.record(sampler_id, self._home_name(ref.model_id))
        return answer

    async def _to_minter(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        kept = self._replay.kept(call, ref)
        if kept is not None and ref is not None and ref.request_id is not None:
            return await self._replay.retrieve(call, kept, ref.request_id)  # its home may have died since
        minted = ref.request_id or ref.session_id if ref is not None else None
        return await self._reach.to(call, self._directory.tagged(minted), minted) if minted else None

    async def _to_body_sampler(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        sampler_id = ref.sampling_session_id if ref is not None else None
        if not sampler_id:
            return None
        if call.scope["path"] != SAMPLE_PATH:
            return await self._to_sampler(call, sampler_id)
        # A sample (replay.py): kept until read; a sampler whose home died is made again where its weights are.
        home = await self._home("sampler", sampler_id, self._directory.sampler)
        if home.where is Where.LOST and home.member is not None:
            moved = await self._replay.sampler_home(sampler_id, home.member.name)
            if moved is None:
                return detail_reply(503, f"sampling session {sampler_id} waits for its job's adopter: retry")
            if isinstance(moved, str):
                return detail_reply(410, moved)
            home = moved
        if home.where is Where.REMOTE:
            return await self._replay.send_sample(call, sampler_id, home)
        return await self._reach.to(call, home, sampler_id)

    async def _create_sampler(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        if ref is None or ref.session_id is None or ref.sampling_session_seq_id is None:
            return None
        call = replace(call, session_id=ref.session_id)
        sampler_id = ids.sampling_session_id(ref.session_id, ref.sampling_session_seq_id)
        if ref.model_path is None:  # a base model's: here, or placed when this node takes no jobs
            answer = await self._creation.base_model_sampler(call, ref, sampler_id)
        else:
            answer = await self._to_run_of(call, ref.model_path, lost_here=True)
        if answer is not None and answer.status == 200:
            if ref.model_path is not None:
                self._directory.record(sampler_id, self._home_name(_run_of(ref.model_path) or ""))
            self._replay.created(sampler_id, call)  # made again elsewhere if that node dies (replay.py)
        return answer

    async def _recreate_sampler(self, call: Call) -> Reply | None:
        """A create_sampling_session routed again, its sampler's node having died (replay.py)."""
        return await self._create_sampler(call)

    async def _to_body_checkpoint(self, call: Call) -> Reply | None:
        ref = body_ids(call, self._max_body_bytes)
        tinker_path = ref.tinker_path if ref is not None else None
        return await self._to_run_of(call, tinker_path, lost_here=True) if tinker_path else None

    async def _to_session(self, call: Call) -> Reply | None:
        session_id = call.params["session_id"]
        if not session_id.startswith("s-"):
            return None  # not a session id this cluster minted: this node says what is wrong with it
        return await self._reach.to(call, self._directory.tagged(session_id), session_id)

    async def _finish_session(self, call: Call) -> Reply | None:
        session_id = call.params["session_id"]
        return await self._finish_everywhere(call, session_id) if session_id.startswith("s-") else None

    async def _to_path_sampler(self, call: Call) -> Reply | None:
        return await self._to_sampler(call, call.params["sampler_id"])

    async def _model_status(self, call: Call) -> Reply | None:
        model_id = call.params["model_id"]
        home = await self._model_home(model_id)
        if home.where is Where.LOST:
            answer = await self._reach.if_it_answers(call, home, model_id)
            return answer if answer is not None else self._lost_status(call, model_id, home)
        return await self._reach.to(call, home, model_id)

    async def _to_path_run(self, call: Call) -> Reply | None:
        run_id = call.params["run_id"]
        home = await self._model_home(run_id)
        return None if home.where is Where.LOST else await self._reach.to(call, home, run_id)

    async def _to_path_model(self, call: Call) -> Reply | None:
        return await self._to_model(call, call.params["run_id"])

    async def _here(self, call: Call) -> None:
        return None

    async def _to_member(self, call: Call) -> Reply | None:
        """`/openrl/v1/node?node=<name>` goes to that member; without a name, or this node's, it is answered here."""
        name = urllib.parse.parse_qs(call.scope.get("query_string", b"").decode()).get("node", [""])[0]
        if name in ("", self._directory.local_name):
            return None
        user_in(call.scope, _header(call.headers, b"x-api-key"), self._user_for)  # a bad key is refused here
        member = next((m for m in self._directory.members() if m.name == name), None)
        if member is None:
            return detail_reply(404, f"no cluster member {name!r}")
        if not member.is_alive:
            return detail_reply(410, f"node {name} is {member.state.name.lower()}")
        return await self._reach.forward(call, member, name)

    async def _finish_everywhere(self, call: Call, session_id: str) -> Reply:
        """A session finishes at its home, and then on every member that holds jobs of it (placed there),
        so that their own groups end and free their devices too."""
        home = self._directory.tagged(session_id)
        answer = await self._reach.to(call, home, session_id)
        if answer is None:
            answer = await self._reach.local(call.scope, call.body)
        if answer.status != 200:
            return answer
        home_name = home.member.name if home.member is not None else self._directory.local_name
        ask = self._reach.asker(call, session_id)

        async with trio.open_nursery() as nursery:
            for member in self._directory.members():
                if member.is_alive and member.name != home_name:
                    nursery.start_soon(ask, member, call.scope)  # a member without the session answers 404
        return answer

    # ------------------------------------------------------------ homes

    async def _model_home(self, model_id: str) -> Home:
        return await self._home("model", model_id, self._directory.model)

    async def _home(self, kind: str, some_id: str, lookup: Callable[[str], Home]) -> Home:
        """The directory's answer, or, for an id it does not know, the member that says it has it."""
        home = lookup(some_id)
        if home.where is Where.UNKNOWN:
            name = await self._peers.locate(self._directory.members(), kind, some_id)
            if name is not None:
                self._directory.record(some_id, name)
                home = lookup(some_id)
        return home

    def _home_name(self, model_id: str) -> str:
        home = self._directory.model(model_id)
        return home.member.name if home.member is not None else self._directory.local_name

    async def _to_model(self, call: Call, model_id: str, ref: Ids | None = None) -> Reply | None:
        home = await self._model_home(model_id)
        if ref is not None and ref.seq_id is not None and call.scope["path"] in KEPT_PATHS:
            # A training request (replay.py): what was kept for a dead home is replayed on the adopter
            # first; then this one is kept too, on its way to the home.
            if home.where is Where.LOST and is_adoptable(home) and home.member is not None:
                answer = await self._reach.if_it_answers(call, home, model_id)
                if answer is not None:
                    return answer  # it was only slow
                adopted = (
                    await self._reach.adopted_home(model_id, home)
                    if await self._replay.recover(model_id, home.member.name) else None
                )
                if adopted is None:
                    return self._reach.unadopted(model_id, home)
                home = adopted
            if self._replay.keeps(call.scope["path"], home, model_id):
                return await self._replay.send(call, ref, home)
        return await self._reach.to(call, home, model_id)

    async def _to_run_of(self, call: Call, path: str, *, lost_here: bool) -> Reply | None:
        """A request about a checkpoint goes to its run's home; a lost home's checkpoints may be read here
        (a shared checkpoint root), so with `lost_here` this node answers."""
        run_id = _run_of(path)
        if run_id is None:
            return None
        home = await self._model_home(run_id)
        if home.where is Where.LOST and lost_here:
            return None
        return await self._reach.to(call, home, run_id)

    async def _to_sampler(self, call: Call, sampler_id: str) -> Reply | None:
        home = await self._home("sampler", sampler_id, self._directory.sampler)
        return await self._reach.to(call, home, sampler_id)

    # ------------------------------------------------------------ creating requests: placed (job_creation.py)

    async def _restore(self, call: Call, ref: Ids) -> Reply | None:
        """create_training_client_from_state: where the checkpoint's run lives; if that node is lost, placed anew."""
        run_id = _run_of(ref.path or "")
        if run_id is None or ref.session_id is None or ref.model_seq_id is None:
            return None
        home = await self._model_home(run_id)
        if home.where is not Where.LOST:
            return await self._reach.to(call, home, run_id)
        return await self._creation.restore(call, ref.session_id, ref.model_seq_id, home.note)

    async def _place(self, call: Call) -> Reply | None:
        return await self._creation.create_model(call)

    def _lost_status(self, call: Call, model_id: str, home: Home) -> Reply:
        user = user_in(call.scope, _header(call.headers, b"x-api-key"), self._user_for)
        note = home.note
        if note is None or note.owner != user:
            return detail_reply(404, f"no model {model_id!r}")
        return json_reply(lost_status(model_id, note))

    _routers: ClassVar[dict[HomeBy, Callable[[Relay, Call], Awaitable[Reply | None]]]] = {
        HomeBy.HERE: _here,
        HomeBy.LOCATE: _here,  # answered before a route is looked for (see __call__)
        HomeBy.PLACED: _place,
        HomeBy.MODEL_IN_BODY: _to_body_model,
        HomeBy.LOAD_WEIGHTS: _load_weights,
        HomeBy.SAVE_FOR_SAMPLER: _save_for_sampler,
        HomeBy.MINTED_IN_BODY: _to_minter,
        HomeBy.SAMPLER_IN_BODY: _to_body_sampler,
        HomeBy.CREATE_SAMPLER: _create_sampler,
        HomeBy.CHECKPOINT_IN_BODY: _to_body_checkpoint,
        HomeBy.SESSION_IN_PATH: _to_session,
        HomeBy.SESSION_FINISH: _finish_session,
        HomeBy.SAMPLER_IN_PATH: _to_path_sampler,
        HomeBy.MODEL_STATUS: _model_status,
        HomeBy.RUN_IN_PATH: _to_path_run,
        HomeBy.MODEL_IN_PATH: _to_path_model,
        HomeBy.NODE_QUERY: _to_member,
    }

    def _is_here(self, query: LocateQuery) -> bool:
        """Whether this node is home to the id a member asks about (`PeerClient.locate`)."""
        home = self._directory.model(query.id) if query.kind == "model" else self._directory.sampler(query.id)
        return home.where is Where.LOCAL



def _run_of(path: str) -> str | None:
    try:
        return ids.parse_tinker_path(path).run_id
    except UserError:
        return None
