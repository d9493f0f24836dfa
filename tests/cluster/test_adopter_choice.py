"""Adoption's choice and claim (issue 41): exactly one survivor adopts a dead node's auto-saved job.

The choice (`adopter_order`) is the same on every node that knows the same members; the
claim on the shared root (`store/job_claims.py`) makes one adopter even when views differ;
two watchers that notice the same death at once adopt the job once between them.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import trio

from openrld.autosave import AUTOSAVE_FORMAT, AUTOSAVE_MANIFEST, Autosave, AutosaveManifest
from openrld.checkpoint_manifest import MANIFEST_FORMAT, CheckpointManifest
from openrld.cluster.adoption import AdoptionWatcher, adopter_order, candidates
from openrld.cluster.directory import Directory, Where
from openrld.cluster.membership.messages import DeviceSlot, JobNote, MemberState, NodePayload
from openrld.cluster.membership.table import Member
from openrld.store.job_claims import Claim, claims_dir, is_superseded, latest_claim, try_claim

MODEL = "s-0123456789abcdef:train:0"
DEVICE = (DeviceSlot("cpu", "cpu", 1 << 30, 1 << 30),)


def member(name: str, state: MemberState = MemberState.ALIVE, *, devices=DEVICE, jobs=(), notes=None) -> Member:
    payload = NodePayload(peer_url=f"http://{name}", devices=devices, jobs=tuple(jobs), job_notes=notes or {})
    return Member(name, f"{name}:1", 1, state, payload, 0.0)


def note(autosave_steps: int = 1) -> JobNote:
    return JobNote("alice", "tiny-llama", "lora", False, "", autosave_steps)


# ---------------------------------------------------------------- the choice


def test_every_node_orders_the_candidates_alike_whatever_order_it_lists_them_in() -> None:
    names = [f"node-{i}" for i in range(8)]
    assert adopter_order(MODEL, names) == adopter_order(MODEL, list(reversed(names))) == adopter_order(MODEL, names * 2)


def test_a_candidate_leaving_moves_only_the_jobs_it_was_first_for() -> None:
    names = [f"node-{i}" for i in range(6)]
    for n in range(50):
        model_id = f"s-{n:016x}:train:0"
        order = adopter_order(model_id, names)
        fewer = adopter_order(model_id, [name for name in names if name != order[-1]])
        assert fewer[0] == order[0]


def test_the_jobs_of_a_dead_node_spread_over_the_survivors() -> None:
    firsts = {adopter_order(f"s-{n:016x}:train:0", ["a", "b", "c"])[0] for n in range(60)}
    assert firsts == {"a", "b", "c"}


def test_candidates_are_the_live_members_that_take_jobs_but_the_dead_home() -> None:
    members = [
        member("front", devices=()),  # accept_jobs = false: publishes no devices
        member("b", MemberState.DEAD),
        member("c"),
        member("d", MemberState.SUSPECT),
        member("e", MemberState.LEFT),
    ]
    assert candidates(members, "b") == ["c", "d"]


# ---------------------------------------------------------------- the claim


def test_the_first_claim_takes_the_job_and_a_second_from_the_same_home_is_refused(tmp_path: Path) -> None:
    first = try_claim(tmp_path, MODEL, adopter="c", previous_home="b", step=4, seq_id=8)
    assert first is not None and (first.generation, first.adopter, first.detail) == (1, "c", "adopted from node b at step 4")
    assert try_claim(tmp_path, MODEL, adopter="d", previous_home="b", step=4, seq_id=8) is None
    assert latest_claim(tmp_path, MODEL) == first


def test_claims_chain_each_from_the_adopter_before(tmp_path: Path) -> None:
    assert try_claim(tmp_path, MODEL, adopter="c", previous_home="b", step=4, seq_id=8) is not None
    assert try_claim(tmp_path, MODEL, adopter="d", previous_home="a", step=4, seq_id=8) is None  # a was never home
    second = try_claim(tmp_path, MODEL, adopter="d", previous_home="c", step=9, seq_id=18)
    assert second is not None and second.generation == 2
    # b, declared dead but alive behind a partition, finds its job taken; c, which held it by claim 1, too.
    assert is_superseded(tmp_path, MODEL, home="b", generation=0) == second
    assert is_superseded(tmp_path, MODEL, home="c", generation=1) == second
    assert is_superseded(tmp_path, MODEL, home="d", generation=2) is None


def test_of_many_claims_at_once_exactly_one_wins(tmp_path: Path) -> None:
    won: list[Claim] = []
    start = threading.Barrier(8)

    def claim(name: str) -> None:
        start.wait()
        result = try_claim(tmp_path, MODEL, adopter=name, previous_home="b", step=1, seq_id=2)
        if result is not None:
            won.append(result)

    threads = [threading.Thread(target=claim, args=(f"node-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    assert latest_claim(tmp_path, MODEL) == won[0]
    assert sorted(p.name for p in claims_dir(tmp_path, MODEL).iterdir()) == ["000000001.json"]  # no temporaries left


def test_an_unreadable_claim_file_is_skipped(tmp_path: Path) -> None:
    first = try_claim(tmp_path, MODEL, adopter="c", previous_home="b", step=4, seq_id=8)
    (claims_dir(tmp_path, MODEL) / "000000002.json").write_bytes(b"{half")
    assert latest_claim(tmp_path, MODEL) == first


# ---------------------------------------------------------------- two watchers noticing one death


def write_autosave(root: Path, model_id: str, step: int, seq_id: int) -> Autosave:
    now = datetime.now(UTC)
    run = CheckpointManifest(
        format=MANIFEST_FORMAT, run_id=model_id, kind="weights", name=f"step-{step:09d}", owner="alice",
        session_id=model_id.split(":")[0], base_model="tiny-llama", model_dir="/m", lora={"rank": 4}, settings={},
        optimizer_config={}, run_user_metadata={}, run_created_at=now, user_metadata={}, size_bytes=None,
        created_at=now, expires_at=None, public=False,
    )
    directory = root / ".autosave" / model_id / f"step-{step:09d}"
    directory.mkdir(parents=True)
    (directory / "adapter.safetensors").write_bytes(b"x" * 10)
    manifest = AutosaveManifest(
        format=AUTOSAVE_FORMAT, model_id=model_id, step=step, seq_id=seq_id, run=run,
        files={"adapter.safetensors": 10}, created_at=now,
    )
    (directory / AUTOSAVE_MANIFEST).write_bytes(msgspec.json.encode(manifest))
    return Autosave(directory, manifest)


class FakeHost:
    def __init__(self, name: str, adopted: list[str], *, refusal: str | None = None) -> None:
        self.name = name
        self.adopted = adopted
        self._refusal = refusal
        self.running: set[str] = set()

    def is_running(self, model_id: str) -> bool:
        return model_id in self.running

    def refusal(self, autosave: Autosave) -> str | None:
        return self._refusal

    async def adopt(self, autosave: Autosave, claim: Claim) -> None:
        await trio.sleep(0.01)
        self.running.add(autosave.manifest.model_id)
        self.adopted.append(f"{self.name}:{autosave.manifest.model_id}:{autosave.manifest.step}")

    def claimed_jobs(self) -> list[tuple[str, int]]:
        return []

    def superseded(self, model_id: str, claim: Claim) -> None:
        self.running.discard(model_id)


async def run_watchers(root: Path, views: dict[str, list[Member]], hosts: dict[str, FakeHost], wait_s: float) -> None:
    async with trio.open_nursery() as nursery:
        for name, host in hosts.items():
            watcher = AdoptionWatcher(
                local_name=name, root=root, members=lambda v=views[name]: v, host=host, published=lambda: None,
                stagger_s=0.3,
            )
            nursery.start_soon(watcher.run)
        await trio.sleep(wait_s)
        nursery.cancel_scope.cancel()


async def test_two_nodes_that_notice_a_death_at_once_adopt_each_job_once(tmp_path: Path) -> None:
    jobs = [f"s-{n:016x}:train:0" for n in range(6)]
    for model_id in jobs:
        write_autosave(tmp_path, model_id, step=3, seq_id=6)
    dead = member("b", MemberState.DEAD, jobs=jobs, notes={m: note() for m in jobs})
    view = [member("c"), member("d"), dead]
    adopted: list[str] = []
    hosts = {"c": FakeHost("c", adopted), "d": FakeHost("d", adopted)}
    await run_watchers(tmp_path, {"c": view, "d": view}, hosts, wait_s=1.5)
    assert sorted(a.split(":", 1)[1] for a in adopted) == sorted(f"{m}:3" for m in jobs)
    for model_id in jobs:
        expected = adopter_order(model_id, ["c", "d"])[0]
        assert f"{expected}:{model_id}:3" in adopted
        claim = latest_claim(tmp_path, model_id)
        assert claim is not None and (claim.adopter, claim.previous_home, claim.step, claim.seq_id) == (expected, "b", 3, 6)


async def test_views_that_disagree_still_make_one_adopter(tmp_path: Path) -> None:
    """c does not know d yet, and d not c: each thinks itself first; the claim decides."""
    write_autosave(tmp_path, MODEL, step=2, seq_id=4)
    dead = member("b", MemberState.DEAD, jobs=[MODEL], notes={MODEL: note()})
    adopted: list[str] = []
    hosts = {"c": FakeHost("c", adopted), "d": FakeHost("d", adopted)}
    await run_watchers(tmp_path, {"c": [member("c"), dead], "d": [member("d"), dead]}, hosts, wait_s=1.0)
    assert len(adopted) == 1


async def test_the_next_candidate_adopts_what_the_first_cannot_hold(tmp_path: Path) -> None:
    write_autosave(tmp_path, MODEL, step=2, seq_id=4)
    dead = member("b", MemberState.DEAD, jobs=[MODEL], notes={MODEL: note()})
    first, second = adopter_order(MODEL, ["c", "d"])
    adopted: list[str] = []
    hosts = {first: FakeHost(first, adopted, refusal="no such model"), second: FakeHost(second, adopted)}
    view = [member("c"), member("d"), dead]
    await run_watchers(tmp_path, {"c": view, "d": view}, hosts, wait_s=1.5)
    assert adopted == [f"{second}:{MODEL}:2"]


async def test_a_job_that_does_not_auto_save_is_not_adopted(tmp_path: Path) -> None:
    write_autosave(tmp_path, MODEL, step=2, seq_id=4)
    dead = member("b", MemberState.DEAD, jobs=[MODEL], notes={MODEL: note(0)})
    adopted: list[str] = []
    await run_watchers(tmp_path, {"c": [member("c"), dead]}, {"c": FakeHost("c", adopted)}, wait_s=0.5)
    assert adopted == []


async def test_a_job_without_a_complete_auto_save_is_not_adopted(tmp_path: Path) -> None:
    dead = member("b", MemberState.DEAD, jobs=[MODEL], notes={MODEL: note()})
    adopted: list[str] = []
    await run_watchers(tmp_path, {"c": [member("c"), dead]}, {"c": FakeHost("c", adopted)}, wait_s=0.5)
    assert adopted == []
    assert latest_claim(tmp_path, MODEL) is None


# ---------------------------------------------------------------- the directory after an adoption


class _Cluster:
    def __init__(self, name: str, members: list[Member]) -> None:
        self.name = name
        self._members = members

    def members(self) -> list[Member]:
        return self._members

    def member(self, name: str) -> Member | None:
        return next((m for m in self._members if m.name == name), None)


class _Jobs:
    def is_running(self, model_id: str) -> bool:
        return False

    def has_run(self, model_id: str) -> bool:
        return False


def test_the_directory_sends_an_adopted_job_to_its_adopter_over_what_this_node_placed() -> None:
    dead = member("b", MemberState.DEAD, jobs=[MODEL], notes={MODEL: note()})
    front = member("a", devices=())
    directory = Directory(_Cluster("a", [front, dead, member("c")]), _Jobs(), None)  # type: ignore[arg-type]
    directory.record(MODEL, "b")  # a placed the job on b
    lost = directory.model(MODEL)
    assert (lost.where, lost.member.name if lost.member else None, lost.note) == (Where.LOST, "b", note())
    adopted = Directory(
        _Cluster("a", [front, dead, member("c", jobs=[MODEL])]), _Jobs(), None  # type: ignore[arg-type]
    )
    adopted.record(MODEL, "b")
    home = adopted.model(MODEL)
    assert (home.where, home.member.name if home.member else None) == (Where.REMOTE, "c")
