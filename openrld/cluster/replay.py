"""Replay: the requests a node relayed to a job's home are kept, and replayed on the job's adopter if the home dies.

A node that relays a job's training requests to its home (a front node, or any
node a client's base URL reached) keeps each one, with its seq_id, from the
moment it is sent until it is both answered (its result read by the client)
and covered by an auto-save of the job (`openrld/autosave.py`: the auto-save
records the seq_id of the step it saved). When the home dies and a survivor
adopts the job from its newest auto-save (`adoption.py`), the adopter resumes
at that auto-save's seq_id; every request kept for the job is then sent to it
again, in seq_id order:

- one after the auto-save is applied anew (the steps after the last auto-save
  are recomputed); its client, polling `retrieve_future` for the request id
  the dead home gave, is answered from the adopter's future for it, the ids
  exchanged on the way in and out;
- one the auto-save already covers is refused by the adopter (its seq_id is
  behind the job's): if its result was read, nothing is lost; if not (the home
  died between computing it and the client reading it), its client is told,
  410, that this result was lost, and that the job goes on.

A request that was on its way to the home when it died (the relay to it
failed) is held until the adopter shows and answered from there.

Sampling follows its weights. An unnamed sampling session whose
`save_weights_for_sampler` is kept (after the auto-save) is made again on the
adopter by that request's replay, with the same weights, and a sample for it
is sent there only once that save has run (as the SDK samples only after a
save's result; sooner, the weights are not there yet); one made from a
checkpoint path or a base model (`create_sampling_session`, kept too) is made
again wherever its checkpoint's run lives now. A sample still unread when its
sampler's node died is sent again to the sampler's new home (it draws anew, as
a retried sample does); a sample whose result was read is never sent again. A
sampling session whose weights cannot be made again (saved before the job's
last auto-save, so they lived only in the dead node's memory) is lost: its
calls answer 410 naming it and what to do.

Kept requests live in this node's memory only, bounded (`MAX_KEPT_BYTES`): a
job whose requests had to be dropped before an auto-save covered them cannot
be replayed, and its clients are told so. `Journal` is the pure bookkeeping;
`Replay` sends and waits.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import trio

from openrld import ids
from openrld.api import media
from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.autosave import latest_autosave
from openrld.cluster.body_ids import Call, Ids
from openrld.cluster.directory import Directory, Home, Where
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import RELAY_FAILED, RelayCounters
from openrld.cluster.reach import ADOPTION_GIVE_UP_S, ADOPTION_HOLD_S, ADOPTION_POLL_S, Reach
from openrld.errors import BadRequest

logger = logging.getLogger(__name__)

# The routes whose requests take a seq_id in their job's order, and are kept for replay.
KEPT_PATHS = frozenset({
    "/api/v1/forward_backward", "/api/v1/forward", "/api/v1/optim_step", "/api/v1/save_weights",
    "/api/v1/save_weights_for_sampler", "/api/v1/save_weights_external", "/api/v1/load_weights",
})
RETRIEVE_PATH = "/api/v1/retrieve_future"
MAX_KEPT_BYTES = 256 << 20  # request bodies kept by this node for all jobs; the oldest go first past it
MAX_KEPT_PER_JOB = 1024  # per job, where no auto-save says what is covered (this node has no shared root)
MAX_RETRIEVE_BYTES = 1 << 16  # a retrieve_future body names one request id
MAX_CREATES_KEPT = 10_000  # create_sampling_session requests kept, to make their sessions again elsewhere
SAMPLE_PATH = "/api/v1/asample"


class Kept:
    """One request kept for replay, and where its live copy is now."""

    __slots__ = ("model_id", "seq_id", "call", "target", "target_id", "first_id", "read", "lost", "sampler_id", "is_sample")

    def __init__(
        self, model_id: str, seq_id: int, call: Call, target: str, sampler_id: str | None, *, is_sample: bool = False
    ) -> None:
        self.is_sample = is_sample  # a sample: `model_id` is its sampling session, and it is kept only until read
        self.model_id = model_id
        self.seq_id = seq_id
        self.call = call  # as the client sent it: scope, headers, body
        self.target = target  # the node whose future answers it now: the home, then its adopter
        self.target_id: str | None = None  # that future's request id; None until it answered the POST
        self.first_id: str | None = None  # the request id the client was given, which it polls
        self.read = False  # its result went back to the client
        self.lost: str | None = None  # why it cannot be answered any more
        self.sampler_id = sampler_id  # an unnamed save_weights_for_sampler: the sampling session it makes

    @property
    def size(self) -> int:
        return len(self.call.body) + 512


class Journal:
    """The kept requests of every job this node relays, by job and seq_id and by request id. Pure."""

    def __init__(self, *, max_bytes: int = MAX_KEPT_BYTES, max_per_job: int = MAX_KEPT_PER_JOB) -> None:
        self._max_bytes = max_bytes
        self._max_per_job = max_per_job
        self._jobs: dict[str, dict[int, Kept]] = {}
        self._order: dict[Kept, None] = {}  # every kept request, oldest first
        self._by_request: dict[str, Kept] = {}
        self._covered: dict[str, int] = {}  # model id -> the seq_id its newest auto-save covers
        self._incomplete: dict[str, int] = {}  # model id -> the highest seq_id dropped before it was covered
        self._samples: dict[Kept, None] = {}  # samples sent to another node, until their results are read
        self._created: dict[str, Call] = {}  # sampling session id -> the create_sampling_session that made it
        self.bytes = 0

    def keep(self, model_id: str, seq_id: int, call: Call, target: str, sampler_id: str | None = None) -> Kept:
        """Keep a request on its way to `target`; a retry of a kept seq_id keeps the first."""
        job = self._jobs.setdefault(model_id, {})
        kept = job.get(seq_id)
        if kept is None:
            kept = job[seq_id] = Kept(model_id, seq_id, call, target, sampler_id)
            self._order[kept] = None
            self.bytes += kept.size
            self._bound(model_id)
        return kept

    def keep_sample(self, sampler_id: str, call: Call, target: str, request_id: str) -> Kept:
        """A sample sent to `target`, answered with `request_id`, kept until its result is read."""
        kept = Kept(sampler_id, -1, call, target, sampler_id, is_sample=True)
        self._samples[kept] = None
        self.bytes += kept.size
        self.answered(kept, request_id)
        while self.bytes > self._max_bytes and self._samples:
            self.drop(next(iter(self._samples)))
        return kept

    def created(self, sampler_id: str, call: Call) -> None:
        """`sampler_id` was made on another node by `call` (a checkpoint path or a base model)."""
        self._created.pop(sampler_id, None)
        self._created[sampler_id] = call
        if len(self._created) > MAX_CREATES_KEPT:
            del self._created[next(iter(self._created))]

    def creation(self, sampler_id: str) -> Call | None:
        return self._created.get(sampler_id)

    def save_of(self, sampler_id: str) -> Kept | None:
        """The kept unnamed save_weights_for_sampler that made `sampler_id`, if it is still kept."""
        for job in self._jobs.values():
            for kept in job.values():
                if kept.sampler_id == sampler_id:
                    return kept
        return None

    def answered(self, kept: Kept, request_id: str) -> None:
        """The home gave `request_id` for it (the client polls that id)."""
        kept.target_id = request_id
        if kept.first_id is None:
            kept.first_id = request_id
        self._by_request[request_id] = kept

    def moved(self, kept: Kept, target: str, request_id: str) -> None:
        """It was replayed: `request_id` at `target` answers it now."""
        kept.target, kept.target_id = target, request_id
        self._by_request[request_id] = kept
        if kept.first_id is None:
            kept.first_id = request_id

    def lookup(self, request_id: str) -> Kept | None:
        return self._by_request.get(request_id)

    def lookup_kept(self, kept: Kept) -> bool:
        """Whether `kept` is still kept (not pruned)."""
        return self._jobs.get(kept.model_id, {}).get(kept.seq_id) is kept

    def read(self, kept: Kept) -> None:
        """Its result went back to the client."""
        kept.read = True
        if kept.is_sample:
            self.drop(kept)  # never sent again
        else:
            self._prune(kept.model_id)

    def cover(self, model_id: str, seq_id: int) -> None:
        """An auto-save of the job covers every request up to `seq_id`."""
        if seq_id > self._covered.get(model_id, -1):
            self._covered[model_id] = seq_id
            self._prune(model_id)

    def drop(self, kept: Kept) -> None:
        if kept.is_sample and kept in self._samples:
            del self._samples[kept]
            self.bytes -= kept.size
        job = None if kept.is_sample else self._jobs.get(kept.model_id)
        if job is not None and job.get(kept.seq_id) is kept:
            del job[kept.seq_id]
            del self._order[kept]
            self.bytes -= kept.size
            if not job:
                del self._jobs[kept.model_id]
        for request_id in (kept.first_id, kept.target_id):
            if request_id is not None and self._by_request.get(request_id) is kept:
                del self._by_request[request_id]

    def pending(self, model_id: str, target: str) -> list[Kept]:
        """The job's kept requests whose live copy is at `target`, in seq_id order, but those already lost."""
        job = self._jobs.get(model_id, {})
        return [job[seq] for seq in sorted(job) if job[seq].target == target and job[seq].lost is None]

    def incomplete_above(self, model_id: str) -> int | None:
        """The highest seq_id of the job dropped before an auto-save covered it; None if none was."""
        dropped = self._incomplete.get(model_id)
        covered = self._covered.get(model_id, -1)
        return dropped if dropped is not None and dropped > covered else None

    def covered(self, model_id: str) -> int:
        return self._covered.get(model_id, -1)

    def jobs(self) -> int:
        return len(self._jobs)

    def _prune(self, model_id: str) -> None:
        """Drop what is read and covered: no replay can need it."""
        covered = self._covered.get(model_id, -1)
        for kept in list(self._jobs.get(model_id, {}).values()):
            if kept.read and kept.seq_id <= covered:
                self.drop(kept)

    def _bound(self, model_id: str) -> None:
        """Past the per-job count (without a shared root) or this node's bytes, the oldest go first."""
        job = self._jobs.get(model_id, {})
        while len(job) > self._max_per_job:
            self._evict(job[min(job)])
        while self.bytes > self._max_bytes and self._order:
            self._evict(next(iter(self._order)))

    def _evict(self, kept: Kept) -> None:
        if not (kept.read and kept.seq_id <= self._covered.get(kept.model_id, -1)):
            self._incomplete[kept.model_id] = max(self._incomplete.get(kept.model_id, -1), kept.seq_id)
        self.drop(kept)


class Replay:
    """Keeps the requests this node relays to jobs' homes, and replays them on an adopter; see the module docstring."""

    def __init__(
        self,
        *,
        reach: Reach,
        directory: Directory,
        counters: RelayCounters,
        root: Path | None,
        spawn: Callable[..., None] | None = None,
        journal: Journal | None = None,
        recreate: Callable[[Call], Awaitable[Reply | None]] | None = None,
    ) -> None:
        self._recreate = recreate  # a create_sampling_session routed again (the relay's own routing)
        self._reach = reach
        self._directory = directory
        self._counters = counters  # replayed and unreplayable, for /metrics
        self._root = root  # the shared checkpoint root: what each job's newest auto-save covers
        self._spawn = spawn  # starts a background task (the daemon's nursery); None: checks run inline
        self.journal = journal if journal is not None else Journal(
            max_per_job=MAX_KEPT_PER_JOB if root is None else 1 << 30
        )
        self._locks: dict[str, trio.Lock] = {}
        self._checking: set[str] = set()

    # ------------------------------------------------------------ the requests kept

    def keeps(self, route_path: str, home: Home, model_id: str) -> bool:
        """Whether a request of `route_path` to `home` is kept: a training request relayed to another node,
        for a job that auto-saves (or whose home has not said yet)."""
        if route_path not in KEPT_PATHS or home.where is not Where.REMOTE or home.member is None:
            return False
        note = home.member.payload.job_notes.get(model_id)
        return note is None or note.autosave_steps > 0

    async def send(self, call: Call, ref: Ids, home: Home) -> Reply:
        """A training request relayed to `home`, kept until it is read and covered. If the home does not
        answer (it is dying), the request waits for the job's adopter and is answered from there."""
        assert home.member is not None and ref.model_id is not None and ref.seq_id is not None
        model_id, seq_id = ref.model_id, ref.seq_id
        sampler_id = None
        if call.scope["path"] == "/api/v1/save_weights_for_sampler" and ref.sampling_session_seq_id is not None:
            sampler_id = ids.sampling_session_id(model_id.split(":", 1)[0], ref.sampling_session_seq_id)
        kept = self.journal.keep(model_id, seq_id, call, home.member.name, sampler_id)
        if kept.target != home.member.name and kept.target_id is not None:
            return _future_answer(kept.target_id, model_id)  # a retry of one replayed already
        answer = await self._reach.forward(call, home.member, model_id)
        if _unreachable(answer):
            await self.recover(model_id, home.member.name)
            if kept.lost is not None:
                return detail_reply(410, kept.lost)
            if kept.target != home.member.name and kept.target_id is not None:
                return _future_answer(kept.target_id, model_id)
            return answer
        request_id = _request_id_of(answer) if answer.status == 200 else None
        if request_id is None:
            self.journal.drop(kept)  # refused: the client sees why, and nothing waits on it
            return answer
        self.journal.answered(kept, request_id)
        if sampler_id is not None:
            self._directory.record(sampler_id, kept.target)
        return answer

    def kept(self, call: Call, ref: Ids | None) -> Kept | None:
        """The kept request a retrieve_future polls, if it polls one."""
        if call.scope["path"] != RETRIEVE_PATH or ref is None or ref.request_id is None:
            return None
        return self.journal.lookup(ref.request_id)

    async def retrieve(self, call: Call, kept: Kept, polled_id: str) -> Reply:
        """retrieve_future of a kept request: from its live copy, wherever that is now."""
        deadline = trio.current_time() + ADOPTION_HOLD_S
        while True:
            if kept.lost is not None:
                return detail_reply(410, kept.lost)
            member = self._directory.member(kept.target)
            answer: Reply | None = None
            if kept.target_id is not None and member is not None and (member.is_alive or kept.target == self._local):
                live = call if kept.target_id == polled_id else _with_request_id(call, kept.target_id)
                answer = await self._send(member, live, kept.model_id)
                if not _unreachable(answer):
                    if _is_final(answer):
                        self.journal.read(kept)
                        self._check_covered(kept)
                    return _with_answer_id(answer, kept.target_id, polled_id)
            if trio.current_time() >= deadline:
                return answer if answer is not None else detail_reply(
                    503, f"request {polled_id} waits for model {kept.model_id}'s adopter: retry"
                )
            recovered = await (self._recover_sample(kept) if kept.is_sample else self.recover(kept.model_id, kept.target))
            if not recovered:
                await trio.sleep(ADOPTION_POLL_S * 4)

    # ------------------------------------------------------------ samples

    async def send_sample(self, call: Call, sampler_id: str, home: Home) -> Reply:
        """A sample relayed to its sampler's home, kept until its result is read. A home that does not
        answer (it is dying) is waited for as for a training request, and the sample goes to the new one."""
        assert home.member is not None
        answer = await self._reach.forward(call, home.member, sampler_id)
        if _unreachable(answer):
            moved = await self.sampler_home(sampler_id, home.member.name)
            if moved is None:
                return answer
            if isinstance(moved, str):
                return detail_reply(410, moved)
            home = moved
            if home.where is Where.LOCAL:
                answer = await self._reach.local(call.scope, call.body)
            else:
                answer = await self._send_home(home, call, sampler_id)
        request_id = _request_id_of(answer) if answer.status == 200 else None
        if request_id is not None and home.where is Where.REMOTE and home.member is not None:
            self.journal.keep_sample(sampler_id, call, home.member.name, request_id)
        return answer

    def created(self, sampler_id: str, call: Call) -> None:
        """A create_sampling_session answered by another node: kept, to make the session again elsewhere."""
        self.journal.created(sampler_id, call)

    async def sampler_home(self, sampler_id: str, dead: str) -> Home | str | None:
        """Where sampling session `sampler_id` lives once its home `dead` is gone: made again on the adopter
        of the job that saved its weights, or wherever its checkpoint's run lives now. A str: why it is
        lost for good; None: not yet (its job's adopter has not shown)."""
        save = self.journal.save_of(sampler_id)
        if save is not None:
            if not await self.recover(save.model_id, dead):
                return None
            if save.lost is not None:
                return save.lost
            failed = await self._saved(save)
            if failed is not None:
                return failed
        elif (creation := self.journal.creation(sampler_id)) is not None and self._recreate is not None:
            answer = await self._recreate(creation)
            if answer is None:
                answer = await self._reach.local(creation.scope, creation.body)
            if answer.status != 200:
                return (
                    f"sampling session {sampler_id} lived on node {dead}, which died, and could not be made again "
                    f"({_detail_of(answer)})"
                )
        home = self._directory.sampler(sampler_id)
        if home.where is Where.LOCAL or (home.where is Where.REMOTE and home.member is not None and home.member.name != dead):
            return home
        return (
            f"sampling session {sampler_id} lived on node {dead}, which died; the weights it sampled lived only "
            "there (saved before its training job's last auto-save): they were lost. Save weights for sampling "
            "again (save_weights_and_get_sampling_client) and sample from the new session"
        )

    async def _saved(self, save: Kept) -> str | None:
        """Wait until the replayed save that makes a sampling session has run at its new home, as the SDK waits
        for a save's result before it samples: a sample sent sooner finds the session's weights not yet there,
        and fails. None once it has run; why the session is lost if the save failed or did not answer within
        ADOPTION_HOLD_S."""
        member = self._directory.member(save.target)
        if save.target_id is None or member is None:
            return None  # it was not replayed (this node never sent it on): nothing to wait for
        poll = _retrieve_call(save.call, save.target_id)
        deadline = trio.current_time() + ADOPTION_HOLD_S
        while trio.current_time() < deadline:
            answer = await self._send(member, poll, save.model_id)
            if _is_final(answer):
                body = _json(answer)
                if answer.status == 200 and (body is None or "error" not in body):
                    return None
                why = body.get("error") if body is not None and isinstance(body.get("error"), str) else None
                return (
                    f"sampling session {save.sampler_id} could not be made again on node {save.target}: the save of "
                    f"its weights failed there ({why or _detail_of(answer)})"
                )
            if answer.status != 200:  # its node is not answering yet (a long poll's 'try again' comes back at once)
                await trio.sleep(ADOPTION_POLL_S)
        return f"sampling session {save.sampler_id}: the save of its weights on node {save.target} did not finish in time"

    async def _recover_sample(self, kept: Kept) -> bool:
        """A sample whose sampler's home died: sent again to the sampler's new home; True once it has a new
        copy or is lost, False while the new home has not shown."""
        home = await self.sampler_home(kept.model_id, kept.target)
        if home is None:
            return False
        if isinstance(home, str):
            self._lose(kept, home)
            return True
        if home.where is Where.LOCAL:
            answer = await self._reach.local(kept.call.scope, kept.call.body)
            target = self._local
        else:
            assert home.member is not None
            answer = await self._reach.forward(kept.call, home.member, kept.model_id)
            target = home.member.name
        request_id = _request_id_of(answer) if answer.status == 200 else None
        if request_id is None:
            self._lose(kept, f"the sample sent to sampling session {kept.model_id} was lost with node {kept.target} "
                             f"and could not be sent again ({_detail_of(answer)})")
        else:
            self.journal.moved(kept, target, request_id)
            self._counters.replayed += 1
        return True

    async def _send_home(self, home: Home, call: Call, what: str) -> Reply:
        assert home.member is not None
        return await self._reach.forward(call, home.member, what)

    # ------------------------------------------------------------ replay

    async def recover(self, model_id: str, dead: str) -> bool:
        """Replay on the job's adopter what is kept for it at `dead`, once the adopter shows (within
        ADOPTION_HOLD_S). False if it has not shown yet; True once nothing is left at `dead`."""
        lock = self._locks.setdefault(model_id, trio.Lock())
        async with lock:
            pending = self.journal.pending(model_id, dead)
            if not pending:
                return True
            home = await self._new_home(model_id, dead)
            if home is None:
                return False
            adopter = home.member.name if home.member is not None else self._local
            if self._root is not None:  # what the adopter resumed from covers what was read before it
                await self._read_covered(model_id)
                pending = [kept for kept in pending if kept.lost is None and self.journal.lookup_kept(kept)]
            incomplete = self.journal.incomplete_above(model_id)
            for kept in pending:
                if incomplete is not None and kept.seq_id > self.journal.covered(model_id):
                    self._lose(kept, f"this node could not keep every request of model {model_id} since its last "
                                     f"auto-save (its memory cap), so the request of seq_id {kept.seq_id} cannot be replayed")
                    continue
                await self._replay_one(kept, home, adopter)
            logger.info("replayed model_id=%s from=%s to=%s requests=%d", model_id, dead, adopter, len(pending))
            return True

    async def _replay_one(self, kept: Kept, home: Home, adopter: str) -> None:
        if home.where is Where.LOCAL:
            answer = await self._reach.local(kept.call.scope, kept.call.body)
        else:
            assert home.member is not None
            answer = await self._reach.forward(kept.call, home.member, kept.model_id)
        request_id = _request_id_of(answer) if answer.status == 200 else None
        if request_id is not None:
            self.journal.moved(kept, adopter, request_id)
            self._counters.replayed += 1
            # One line a request: what the adopter computes again (an optim_step: a step recomputed).
            logger.info(
                "replayed model_id=%s seq_id=%d path=%s to=%s", kept.model_id, kept.seq_id, kept.call.scope["path"], adopter
            )
            if kept.sampler_id is not None:
                self._directory.record(kept.sampler_id, adopter)
            return
        if kept.read:
            self.journal.drop(kept)  # the auto-save covers it, and its client has its result
            return
        self._lose(kept, (
            f"the result of model {kept.model_id}'s request of seq_id {kept.seq_id} ({kept.call.scope['path']}) was "
            f"lost with its node; the job goes on at node {adopter} from its last auto-save, which already covers "
            f"this request ({_detail_of(answer)})"
        ))

    def _lose(self, kept: Kept, detail: str) -> None:
        kept.lost = detail
        self._counters.unreplayable += 1
        logger.warning("not replayed model_id=%s seq_id=%d: %s", kept.model_id, kept.seq_id, detail)

    async def _new_home(self, model_id: str, dead: str) -> Home | None:
        """The job's home once it is no longer `dead`: a live member (its adopter) or this node."""
        deadline = trio.current_time() + ADOPTION_HOLD_S
        while True:
            home = self._directory.model(model_id)
            if home.where is Where.LOCAL or (home.where is Where.REMOTE and home.member is not None and home.member.name != dead):
                return home
            if home.where is Where.LOST and home.member is not None and _gave_up(home.member):
                for kept in self.journal.pending(model_id, dead):
                    self._lose(kept, f"model {model_id} was lost with node {dead}: no surviving node adopted it")
                return None
            if trio.current_time() >= deadline:
                return None
            await trio.sleep(ADOPTION_POLL_S)

    # ------------------------------------------------------------ what is covered

    def _check_covered(self, kept: Kept) -> None:
        """After an optim_step's result is read, learn from the shared root what the job's auto-saves cover."""
        if self._root is None or kept.call.scope["path"] != "/api/v1/optim_step" or kept.model_id in self._checking:
            return
        self._checking.add(kept.model_id)
        if self._spawn is not None:
            self._spawn(self._read_covered, kept.model_id)

    async def _read_covered(self, model_id: str) -> None:
        self._checking.add(model_id)
        try:
            assert self._root is not None
            found = await trio.to_thread.run_sync(latest_autosave, self._root, model_id)
            if found is not None:
                self.journal.cover(model_id, found.manifest.seq_id)
        except Exception:  # a bad id, an unreadable root: the journal stays as it is, bounded
            logger.exception("reading the auto-save of model_id=%s failed", model_id)
        finally:
            self._checking.discard(model_id)

    # ------------------------------------------------------------ plumbing

    @property
    def _local(self) -> str:
        return self._directory.local_name

    async def _send(self, member: Member, call: Call, what: str) -> Reply:
        if member.name == self._local:
            return await self._reach.local(call.scope, call.body)
        return await self._reach.forward(call, member, what)


def _gave_up(member: Member) -> bool:
    return trio.current_time() >= member.state_since_s + ADOPTION_GIVE_UP_S


def _unreachable(answer: Reply) -> bool:
    return answer.status == 503 and RELAY_FAILED.encode() in answer.body


def _json(answer: Reply) -> dict | None:
    if not (answer.header(b"content-type") or b"").startswith(b"application/json"):
        return None
    try:
        value = msgspec.json.decode(answer.body)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _request_id_of(answer: Reply) -> str | None:
    body = _json(answer)
    request_id = body.get("request_id") if body is not None else None
    return request_id if isinstance(request_id, str) else None


def _detail_of(answer: Reply) -> str:
    body = _json(answer)
    detail = body.get("detail") if body is not None else None
    return f"{answer.status}: {detail}" if isinstance(detail, str) else str(answer.status)


def _is_final(answer: Reply) -> bool:
    """A retrieve_future answer that ends the client's polling: a result or a failure, not 'try again'."""
    if answer.status == 408 or answer.status >= 500:
        return False
    body = _json(answer)
    return body is None or (body.get("type") != "try_again" and body.get("status") != "complete_metadata")


def _future_answer(request_id: str, model_id: str) -> Reply:
    return json_reply({"request_id": request_id, "model_id": model_id})


def _retrieve_call(call: Call, request_id: str) -> Call:
    """A retrieve_future call for `request_id`, with `call`'s credentials."""
    headers = [(k, v) for k, v in call.scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")]
    scope = {**call.scope, "path": RETRIEVE_PATH, "raw_path": RETRIEVE_PATH.encode(), "query_string": b"", "headers": headers}
    return replace(call, scope=scope, headers=dict(headers), body=msgspec.json.encode({"request_id": request_id}), params={})


def _with_request_id(call: Call, request_id: str) -> Call:
    """A retrieve_future call for `request_id` instead of the one it names (its body is JSON)."""
    headers = [(k, v) for k, v in call.scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")]
    encoding = dict(call.scope["headers"]).get(b"content-encoding")
    try:
        raw = media.decompress(
            call.body, encoding.decode("latin-1") if encoding else None, max_body_bytes=MAX_RETRIEVE_BYTES, where="body"
        )
        decoded = msgspec.json.decode(raw)
    except (BadRequest, msgspec.DecodeError):
        decoded = None
    body = decoded if isinstance(decoded, dict) else {}
    body["request_id"] = request_id
    return replace(call, scope={**call.scope, "headers": headers}, body=msgspec.json.encode(body))


def _with_answer_id(answer: Reply, live_id: str, polled_id: str) -> Reply:
    """The answer as for the id the client polls: a 'try again' names the request id it was asked about."""
    if live_id == polled_id:
        return answer
    body = _json(answer)
    if body is None or body.get("request_id") != live_id:
        return answer
    body["request_id"] = polled_id
    return msgspec.structs.replace(answer, body=msgspec.json.encode(body))
