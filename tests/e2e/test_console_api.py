"""The console's page and routes (api/console.py) against a real daemon, with the real SDK training.

One daemon with a key file of three users: alice and bob train, `admin` is the
operator. The module's tests run in file order on alice's run: it trains and
samples, then each route is read as each user; the last test restarts the
daemon and reads the curves back from the store.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon
from tests.e2e.console_support import datum, keyed_daemon

ALICE, BOB, ADMIN = "tml-alice-console", "tml-bob-console", "tml-admin-console"
STEPS = 3
PROMPT = types.ModelInput.from_ints([7, 8, 9, 10])


def get(daemon: Daemon, path: str, key: str | None) -> httpx.Response:
    return httpx.get(daemon.url + path, headers={"X-API-Key": key} if key else {}, timeout=30)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    node = keyed_daemon(tmp_path_factory.mktemp("console"), tiny_llama, {ALICE: "alice", BOB: "bob", ADMIN: "admin"})
    yield node
    node.stop()


class Trained:
    """What alice's client did, as the SDK saw it."""

    def __init__(self, model_id: str, losses: list[float], sampled_tokens: int, checkpoint: str) -> None:
        self.model_id = model_id
        self.losses = losses
        self.sampled_tokens = sampled_tokens
        self.checkpoint = checkpoint


@pytest.fixture(scope="module")
def trained(daemon: Daemon) -> Trained:
    service = tinker.ServiceClient(base_url=daemon.url, api_key=ALICE)
    training = service.create_lora_training_client(
        base_model="tiny-llama", rank=4, seed=0, user_metadata={"name": "<script>alert(1)</script>"}
    ).result()
    losses = []
    for step in range(STEPS):
        fb = training.forward_backward([datum(list(range(5 + step, 17 + step)))], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    sampler = training.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=3, temperature=1.0, stop=[])).result()
    checkpoint = training.save_state("first").result().path
    service.close("success").result()
    return Trained(training.model_id, losses, sum(len(s.tokens) for s in sample.sequences), checkpoint)


def test_console_page_needs_no_key_and_forbids_inline_script(daemon: Daemon):
    response = get(daemon, "/console", None)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "<script>" not in response.text and 'src="/console/console.js"' in response.text


def test_console_serves_only_its_own_files(daemon: Daemon):
    assert get(daemon, "/console/console.js", None).headers["content-type"] == "text/javascript; charset=utf-8"
    assert get(daemon, "/console/console.css", None).status_code == 200
    assert get(daemon, "/console/..%2Fapp.py", None).status_code == 404
    assert get(daemon, "/console/secrets.txt", None).status_code == 404


def test_console_routes_need_a_key(daemon: Daemon):
    assert get(daemon, "/openrl/v1/runs", None).status_code == 401
    assert get(daemon, "/openrl/v1/node", "tml-nobody").status_code == 401


def test_a_user_lists_their_own_runs_with_state_and_step(daemon: Daemon, trained: Trained):
    runs = get(daemon, "/openrl/v1/runs", ALICE).json()["runs"]
    assert [(r["training_run_id"], r["owner"], r["status"]["step"]) for r in runs] == [(trained.model_id, "alice", STEPS)]
    assert runs[0]["status"]["state"] == "finished"  # the fixture's ServiceClient closed its session
    assert runs[0]["user_metadata"] == {"name": "<script>alert(1)</script>"}


def test_another_user_sees_neither_the_run_nor_its_curves(daemon: Daemon, trained: Trained):
    assert get(daemon, "/openrl/v1/runs", BOB).json()["runs"] == []
    assert get(daemon, f"/openrl/v1/runs/{trained.model_id}", BOB).status_code == 404
    assert get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", BOB).status_code == 404
    assert get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", BOB).json() == {
        "detail": f"no training run {trained.model_id!r}"
    }


def test_the_admin_key_sees_every_run(daemon: Daemon, trained: Trained):
    runs = get(daemon, "/openrl/v1/runs", ADMIN).json()["runs"]
    assert [r["training_run_id"] for r in runs] == [trained.model_id]
    assert get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", ADMIN).status_code == 200


def test_curves_hold_each_steps_loss_as_the_sdk_got_it(daemon: Daemon, trained: Trained):
    curves = get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", ALICE).json()
    assert [p["step"] for p in curves["points"]] == [1, 2, 3]
    assert [p["metrics"]["loss:sum"] for p in curves["points"]] == trained.losses


def test_curves_after_a_seq_hold_only_newer_points(daemon: Daemon, trained: Trained):
    curves = get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves?after=1", ALICE).json()
    assert [p["seq"] for p in curves["points"]] == [2]


def test_sampling_throughput_counts_the_tokens_sampled_from_the_runs_weights(daemon: Daemon, trained: Trained):
    curves = get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", ALICE).json()
    assert sum(b["tokens"] for b in curves["sampling"]) == trained.sampled_tokens
    assert sum(b["sequences"] for b in curves["sampling"]) == 2
    assert curves["bucket_s"] == 10.0


def test_run_detail_lists_its_checkpoints_with_size_and_path(daemon: Daemon, trained: Trained):
    detail = get(daemon, f"/openrl/v1/runs/{trained.model_id}", ALICE).json()
    [checkpoint] = detail["checkpoints"]
    assert checkpoint["tinker_path"] == trained.checkpoint
    assert (checkpoint["checkpoint_id"], checkpoint["public"], checkpoint["expires_at"]) == ("weights/first", False, None)
    assert checkpoint["size_bytes"] > 0


def test_node_view_shows_the_device_and_the_group_on_it(daemon: Daemon, trained: Trained):
    node = get(daemon, "/openrl/v1/node", BOB).json()
    [device] = node["devices"]
    assert (device["name"], device["kind"], device["groups"]) == ("cpu", "cpu", 1)
    assert sorted(w["worker"] for w in device["workers"]) == ["tiny-llama sampler", "tiny-llama trainer"]
    [group] = node["groups"]
    assert (group["base_model"], group["trainer_device"], group["sampler_device"]) == ("tiny-llama", "cpu", "cpu")


def test_curves_outlive_a_restart(daemon: Daemon, trained: Trained):
    daemon.stop()
    daemon.start()
    curves = get(daemon, f"/openrl/v1/runs/{trained.model_id}/curves", ALICE).json()
    assert [p["metrics"]["loss:sum"] for p in curves["points"]] == trained.losses
    assert sum(b["tokens"] for b in curves["sampling"]) == trained.sampled_tokens
    [run] = get(daemon, "/openrl/v1/runs", ALICE).json()["runs"]
    assert run["status"]["state"] == "finished"  # its session had finished before the restart
