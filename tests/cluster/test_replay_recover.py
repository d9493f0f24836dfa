"""Replay on an adopter (issue 41), with a stand-in network: what is kept for a dead home goes to the adopter in
seq_id order, a client polling the dead home's request id is answered from the adopter, and a result the
auto-save covers but nobody read is reported lost.
"""

from __future__ import annotations

import msgspec
import trio

from openrld.api.asgi import Reply, detail_reply, json_reply
from openrld.cluster.body_ids import Call, Ids
from openrld.cluster.directory import Home, Where
from openrld.cluster.membership.messages import JobNote, MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.cluster.peer_client import RelayCounters
from openrld.cluster.replay import Replay

MODEL = "s-1:train:0"


def member(name: str, state: MemberState = MemberState.ALIVE) -> Member:
    notes = {MODEL: JobNote("alice", "tiny-llama", "lora", False, "", 1)}
    payload = NodePayload(peer_url=f"http://{name}", job_notes=notes)
    return Member(name, f"{name}:1", 1, state, payload, trio.current_time())  # the state began just now


def call(path: str, body: dict) -> Call:
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")]}
    return Call(scope, dict(scope["headers"]), msgspec.json.encode(body), {})


class Network:
    """The home b, which dies, and the adopter c, which applies what follows its auto-save at seq_id 2."""

    def __init__(self) -> None:
        self.alive = {"b": True, "c": False}
        self.adopted = False
        self.sent: list[tuple[str, str, int | None]] = []  # (node, path, seq_id)

    async def forward(self, call: Call, member: Member, what: str, connect_timeout_s: float = 5.0) -> Reply:
        body = msgspec.json.decode(call.body)
        self.sent.append((member.name, call.scope["path"], body.get("seq_id")))
        if not self.alive[member.name]:
            return detail_reply(503, f"{what} lives on node {member.name}, which did not answer (ConnectError)")
        if call.scope["path"] == "/api/v1/retrieve_future":
            return json_reply({"loss": body["request_id"]})
        if member.name == "c" and body["seq_id"] <= 2:
            return detail_reply(409, f"model {MODEL}: seq_id {body['seq_id']} was already submitted")
        return json_reply({"request_id": f"{member.name}-{body['seq_id']}", "model_id": MODEL})

    async def local(self, scope: dict, body: bytes) -> Reply:
        raise AssertionError("nothing is answered here")


class Directory:
    local_name = "a"

    def __init__(self, network: Network) -> None:
        self._network = network

    def model(self, model_id: str) -> Home:
        if self._network.adopted:
            return Home(Where.REMOTE, member("c"))
        if self._network.alive["b"]:
            return Home(Where.REMOTE, member("b"))
        return Home(Where.LOST, member("b", MemberState.DEAD), member("b").payload.job_notes[MODEL])

    def member(self, name: str) -> Member:
        alive = self._network.alive[name] or (name == "c" and self._network.adopted)
        return member(name, MemberState.ALIVE if alive else MemberState.DEAD)

    def record(self, some_id: str, node: str) -> None:
        pass


async def test_what_was_kept_for_a_dead_home_is_replayed_on_the_adopter_in_seq_id_order() -> None:
    network = Network()
    counters = RelayCounters()
    replay = Replay(reach=network, directory=Directory(network), counters=counters, root=None)  # type: ignore[arg-type]
    home = Home(Where.REMOTE, member("b"))
    paths = {1: "/api/v1/forward_backward", 2: "/api/v1/optim_step", 3: "/api/v1/forward_backward", 4: "/api/v1/optim_step"}
    for seq, path in paths.items():
        answer = await replay.send(call(path, {"model_id": MODEL, "seq_id": seq}), Ids(model_id=MODEL, seq_id=seq), home)
        assert msgspec.json.decode(answer.body)["request_id"] == f"b-{seq}"
    # The client read steps 1 and 2 and seq_id 3; then b dies with seq_id 4's result unread.
    for seq in (1, 2, 3):
        kept = replay.journal.lookup(f"b-{seq}")
        assert kept is not None
        replay.journal.read(kept)
    network.alive["b"] = False
    network.sent.clear()

    async def adopt_soon() -> None:
        await trio.sleep(0.2)
        network.alive["c"] = network.adopted = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(adopt_soon)
        kept = replay.journal.lookup("b-4")
        assert kept is not None
        polled = call("/api/v1/retrieve_future", {"request_id": "b-4"})
        answer = await replay.retrieve(polled, kept, "b-4")
    # b is dead: everything kept goes to c in seq_id order once it shows; c refuses what its auto-save covers.
    assert network.sent == [
        ("c", "/api/v1/forward_backward", 1), ("c", "/api/v1/optim_step", 2),
        ("c", "/api/v1/forward_backward", 3), ("c", "/api/v1/optim_step", 4),
        ("c", "/api/v1/retrieve_future", None),
    ]
    assert (answer.status, msgspec.json.decode(answer.body)) == (200, {"loss": "c-4"})
    assert (counters.replayed, counters.unreplayable) == (2, 0)


async def test_a_result_the_auto_save_covers_but_nobody_read_is_reported_lost() -> None:
    network = Network()
    counters = RelayCounters()
    replay = Replay(reach=network, directory=Directory(network), counters=counters, root=None)  # type: ignore[arg-type]
    home = Home(Where.REMOTE, member("b"))
    await replay.send(call("/api/v1/optim_step", {"model_id": MODEL, "seq_id": 2}), Ids(model_id=MODEL, seq_id=2), home)
    network.alive["b"] = False
    network.alive["c"] = network.adopted = True
    kept = replay.journal.lookup("b-2")
    assert kept is not None
    answer = await replay.retrieve(call("/api/v1/retrieve_future", {"request_id": "b-2"}), kept, "b-2")
    detail = msgspec.json.decode(answer.body)["detail"]
    assert answer.status == 410
    assert f"the result of model {MODEL}'s request of seq_id 2 (/api/v1/optim_step) was lost" in detail
    assert "the job goes on at node c" in detail
    assert (counters.replayed, counters.unreplayable) == (0, 1)


SAMPLER = "s-1:sample:5"  # the sampling session an unnamed save_weights_for_sampler of MODEL makes


class SamplingNetwork(Network):
    """As Network, with a save for sampling at seq_id 3 whose replay on c takes two polls to finish."""

    def __init__(self) -> None:
        super().__init__()
        self.polls_left = 2

    async def forward(self, call: Call, member: Member, what: str, connect_timeout_s: float = 5.0) -> Reply:
        path = call.scope["path"]
        if path == "/api/v1/asample":
            self.sent.append((member.name, path, None))
            if not self.alive[member.name]:
                return detail_reply(503, f"{what} lives on node {member.name}, which did not answer (ConnectError)")
            return json_reply({"request_id": f"{member.name}-sample"})
        if path == "/api/v1/retrieve_future" and member.name == "c":
            self.sent.append((member.name, path, None))
            self.polls_left -= 1
            if self.polls_left > 0:
                return json_reply({"type": "try_again", "request_id": "c-3", "queue_state": "active"})
            return json_reply({"path": None, "sampling_session_id": SAMPLER})
        return await super().forward(call, member, what, connect_timeout_s)


class SamplingDirectory(Directory):
    def sampler(self, sampler_id: str) -> Home:
        return self.model(MODEL)


async def test_a_sample_for_a_session_made_again_by_a_replayed_save_waits_for_that_save() -> None:
    network = SamplingNetwork()
    replay = Replay(
        reach=network, directory=SamplingDirectory(network), counters=RelayCounters(), root=None  # type: ignore[arg-type]
    )
    home = Home(Where.REMOTE, member("b"))
    save = call("/api/v1/save_weights_for_sampler", {"model_id": MODEL, "seq_id": 3, "sampling_session_seq_id": 5})
    await replay.send(save, Ids(model_id=MODEL, seq_id=3, sampling_session_seq_id=5), home)
    kept = replay.journal.lookup("b-3")
    assert kept is not None
    replay.journal.read(kept)  # the client had the save's result, made its sampling client, and samples
    network.alive["b"] = False
    network.alive["c"] = network.adopted = True
    network.sent.clear()
    answer = await replay.send_sample(call("/api/v1/asample", {"sampling_session_id": SAMPLER}), SAMPLER, home)
    assert msgspec.json.decode(answer.body) == {"request_id": "c-sample"}
    # The save is replayed on c, and the sample goes there only once the save's result is final.
    assert network.sent == [
        ("b", "/api/v1/asample", None),
        ("c", "/api/v1/save_weights_for_sampler", 3),
        ("c", "/api/v1/retrieve_future", None), ("c", "/api/v1/retrieve_future", None),
        ("c", "/api/v1/asample", None),
    ]
