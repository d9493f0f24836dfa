"""Users are kept apart, and no name or path a client sends reaches outside the data dir.

One daemon in key-file mode with two users. Alice trains and saves; Bob tries
every route that takes a run, checkpoint, session or sampler of hers and gets
404, as for a thing that does not exist, until she publishes a checkpoint,
which he may then read but still not change. Then every route that takes a
name or path is fed the escape tricks (absolute paths, '..', malformed
tinker:// paths), and symlinks planted in the data dir are refused.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import tinker
from conftest import Daemon, write_api_keys, write_config
from tinker import types

from tests.waits import wait_for

ALICE = {"X-API-Key": "tml-alice-key"}
BOB = {"X-API-Key": "tml-bob-key"}
SECRET = "top secret outside the data dir"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("isolation")
    keys = write_api_keys(root / "keys.toml", {"tml-alice-key": "alice", "tml-bob-key": "bob"})
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama},
        f'longpoll_s = 3.0\napi_keys_file = "{keys}"\nmaintenance_interval_s = 0.2',
    )
    started = Daemon(root / "data", config, root / "daemon.log").start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def alice(daemon: Daemon):
    """Alice's run, checkpoints, session and sampler (none published)."""
    service = tinker.ServiceClient(base_url=daemon.url, api_key=ALICE["X-API-Key"])
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(40, 50))), loss_fn_inputs={"target_tokens": list(range(41, 51))})
    training.forward_backward([datum], "cross_entropy").result()
    state = training.save_state("state").result().path
    sampler_path = training.save_weights_for_sampler("sampler").result().path
    external = training.save_weights_external("external").result().path
    sampling = service.create_sampling_client(model_path=sampler_path).result()
    run_id = training.get_info().model_id
    session_id = run_id.split(":", 1)[0]
    sampler_id = tinker.RestClient(base_url=daemon.url, api_key=ALICE["X-API-Key"]).get_session(session_id).result().sampler_ids[0]
    del sampling
    yield {"run": run_id, "session": session_id, "state": state, "sampler_path": sampler_path,
           "external": external, "sampler_id": sampler_id}
    service.close("success").result()  # before the daemon stops, or its heartbeat complains at exit


@pytest.fixture
def http(daemon: Daemon):
    with httpx.Client(base_url=daemon.url, timeout=60) as client:
        yield client


def _bob_session(http: httpx.Client) -> str:
    body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
    return http.post("/api/v1/create_session", json=body, headers=BOB).json()["session_id"]


def _route_calls(a: dict[str, str], bob_session: str) -> list[tuple[str, str, dict | None]]:
    run, ckpt = a["run"], a["state"].split("/", 3)[3]
    sampler_ckpt = a["sampler_path"].split("/", 3)[3]
    return [
        ("GET", f"/api/v1/training_runs/{run}", None),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints", None),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/weights/{ckpt}", None),
        ("POST", f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/{sampler_ckpt}/publish", None),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/{sampler_ckpt}/publish", None),
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/weights/{ckpt}/ttl", {"ttl_seconds": 3600}),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints/external_weights/external/external_weights_urls", None),
        ("POST", "/api/v1/weights_info", {"tinker_path": a["state"]}),
        ("POST", "/api/v1/copy_weights", {"source_path": a["state"]}),
        ("GET", f"/api/v1/sessions/{a['session']}", None),
        ("PUT", f"/api/v1/sessions/{a['session']}/project", {"project_id": "p"}),
        ("GET", f"/api/v1/sessions/{a['session']}/trace_export", None),
        ("POST", f"/api/v1/sessions/{a['session']}/finish", {"reason": {"type": "success"}, "detail": None}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": a["session"]}),
        ("GET", f"/api/v1/samplers/{a['sampler_id']}", None),
        ("POST", "/api/v1/get_info", {"model_id": run}),
        ("POST", "/api/v1/optim_step", {"model_id": run, "seq_id": 9, "adam_params": {}}),
        ("POST", "/api/v1/save_weights", {"model_id": run, "seq_id": 9, "path": "stolen"}),
        ("POST", "/api/v1/create_sampling_session",
         {"session_id": bob_session, "sampling_session_seq_id": 0, "model_path": a["sampler_path"]}),
        ("POST", "/api/v1/load_weights", {"session_id": bob_session, "model_seq_id": 0, "path": a["state"], "optimizer": False}),
    ]


def test_another_users_runs_checkpoints_sessions_and_samplers_answer_404(http, alice):
    bob_session = _bob_session(http)
    statuses = {
        f"{method} {path}": http.request(method, path, json=body, headers=BOB).status_code
        for method, path, body in _route_calls(alice, bob_session)
    }
    assert statuses == dict.fromkeys(statuses, 404)


def test_another_users_things_are_not_listed(http, alice):
    runs = http.get("/api/v1/training_runs", headers=BOB).json()["training_runs"]
    checkpoints = http.get("/api/v1/checkpoints", headers=BOB).json()["checkpoints"]
    sessions = http.get("/api/v1/sessions", headers=BOB).json()["sessions"]
    found = http.post("/api/v1/sessions/search", json={}, headers=BOB).json()["sessions"]
    assert alice["run"] not in [r["training_run_id"] for r in runs]
    assert [c for c in checkpoints if c["tinker_path"].startswith(f"tinker://{alice['run']}/")] == []
    assert alice["session"] not in sessions
    assert alice["session"] not in [s["session_id"] for s in found]


def test_a_published_checkpoint_is_readable_but_not_changeable_by_others(daemon, http, alice):
    path = alice["sampler_path"]
    name = path.rsplit("/", 1)[1]
    assert http.post(f"/api/v1/training_runs/{alice['run']}/checkpoints/sampler_weights/{name}/publish", headers=ALICE).status_code == 200
    try:
        assert http.post("/api/v1/weights_info", json={"tinker_path": path}, headers=BOB).json()["lora_rank"] == 4
        bob = tinker.ServiceClient(base_url=daemon.url, api_key=BOB["X-API-Key"])
        prompt = types.ModelInput.from_ints([40, 41, 42])
        bob_logprobs = bob.create_sampling_client(model_path=path).result().compute_logprobs(prompt).result()
        bob.close("success").result()
        alice_service = tinker.ServiceClient(base_url=daemon.url, api_key=ALICE["X-API-Key"])
        assert bob_logprobs == alice_service.create_sampling_client(model_path=path).result().compute_logprobs(prompt).result()
        alice_service.close("success").result()
        copy = http.post("/api/v1/copy_weights", json={"source_path": path}, headers=BOB)
        assert copy.status_code == 200
        assert http.post("/api/v1/weights_info", json={"tinker_path": copy.json()["tinker_path"]}, headers=ALICE).status_code == 404
        weights = f"/api/v1/training_runs/{alice['run']}/checkpoints/sampler_weights/{name}"
        for method in ("DELETE",):
            assert http.request(method, weights, headers=BOB).status_code == 404
        assert http.delete(f"{weights}/publish", headers=BOB).status_code == 404
        assert http.put(f"{weights}/ttl", json={"ttl_seconds": 3600}, headers=BOB).status_code == 404
    finally:
        http.delete(f"/api/v1/training_runs/{alice['run']}/checkpoints/sampler_weights/{name}/publish", headers=ALICE)
    assert http.post("/api/v1/weights_info", json={"tinker_path": path}, headers=BOB).status_code == 404



def _accessible_run_ids(http: httpx.Client) -> set[str]:
    body = http.get("/api/v1/training_runs", params={"access_scope": "accessible"}, headers=BOB).json()
    return {run["training_run_id"] for run in body["training_runs"]}


def test_a_run_with_a_published_checkpoint_is_accessible_but_not_owned_by_others(http, alice):
    name = alice["sampler_path"].rsplit("/", 1)[1]
    run = alice["run"]
    assert run not in _accessible_run_ids(http)
    assert http.post(f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}/publish", headers=ALICE).status_code == 200
    try:
        assert run in _accessible_run_ids(http)
        owned = http.get("/api/v1/training_runs", headers=BOB).json()["training_runs"]
        assert run not in {r["training_run_id"] for r in owned}
        seen = http.get(f"/api/v1/training_runs/{run}", params={"access_scope": "accessible"}, headers=BOB).json()
        # Only what Alice published shows: her sampler checkpoint, not her unpublished state.
        assert seen["last_sampler_checkpoint"]["tinker_path"] == alice["sampler_path"]
        assert "last_checkpoint" not in seen
        assert http.get(f"/api/v1/training_runs/{run}", headers=BOB).status_code == 404
    finally:
        http.delete(f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}/publish", headers=ALICE)
    assert run not in _accessible_run_ids(http)


def test_an_unknown_access_scope_is_400_naming_it(http):
    response = http.get("/api/v1/training_runs", params={"access_scope": "everything"}, headers=BOB)
    assert response.status_code == 400
    assert "access_scope" in response.json()["detail"]


BAD_PATHS = [
    "/etc/passwd",
    "tinker:///etc/passwd",
    "tinker://../../etc/weights/passwd",
    "tinker://run/weights/../../../etc/passwd",
    "tinker://run/weights/..",
    "tinker://run/weights/.hidden",
    "tinker://run/bogus/name",
    "tinker://run/weights",
    "tinker://run/weights/a/b",
    "tinker://run/weights/a%00b",
    "file:///etc/passwd",
    "",
]
BAD_PATH_IDS = ["absolute", "empty-run", "dotdot-run", "dotdot-name", "parent", "dotfile", "bad-kind", "two-parts",
                "four-parts", "nul", "file-scheme", "empty"]


@pytest.mark.parametrize("bad", BAD_PATHS, ids=BAD_PATH_IDS)
def test_every_body_path_refuses_escape_tricks_with_400(http, alice, bad):
    session = http.post(
        "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}, headers=ALICE,
    ).json()["session_id"]
    calls = {
        "weights_info": ("/api/v1/weights_info", {"tinker_path": bad}),
        "copy_weights": ("/api/v1/copy_weights", {"source_path": bad}),
        "create_sampling_session": (
            "/api/v1/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0, "model_path": bad},
        ),
        "load_weights": ("/api/v1/load_weights", {"session_id": session, "model_seq_id": 0, "path": bad, "optimizer": False}),
        "legacy_load_weights": ("/api/v1/load_weights", {"model_id": alice["run"], "seq_id": 99, "path": bad, "optimizer": False}),
    }
    statuses = {name: http.post(path, json=body, headers=ALICE).status_code for name, (path, body) in calls.items()}
    assert statuses == dict.fromkeys(calls, 400)


@pytest.mark.parametrize(
    # A bare '..' segment never reaches a server: HTTP clients resolve it first, so it is sent encoded.
    "segment", ["%2E%2E", "%2e%2e%2fetc", ".hidden", "a%00b", "%2Fetc%2Fpasswd"],
    ids=["encoded-dotdot", "encoded-dotdot-slash", "dotfile", "nul", "encoded-absolute"],
)
def test_every_url_name_refuses_escape_tricks_with_4xx(http, alice, segment):
    run = alice["run"]
    paths = [
        ("GET", f"/api/v1/training_runs/{segment}"),
        ("GET", f"/api/v1/training_runs/{segment}/checkpoints"),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/weights/{segment}"),
        ("DELETE", f"/api/v1/training_runs/{segment}/checkpoints/weights/state"),
        ("POST", f"/api/v1/training_runs/{run}/checkpoints/weights/{segment}/publish"),
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/{segment}/state/ttl"),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints/external_weights/{segment}/external_weights_urls"),
        ("GET", f"/api/v1/download/{run}/external_weights/external/{segment}?expires=9999999999&sig=00"),
        ("GET", f"/api/v1/sessions/{segment}"),
        ("GET", f"/api/v1/samplers/{segment}"),
    ]
    for method, path in paths:
        # A merged '//' may first be redirected to its normal form; where it lands must refuse too.
        response = http.request(
            method, path, headers=ALICE, json={"ttl_seconds": 3600} if method == "PUT" else None, follow_redirects=True
        )
        assert 400 <= response.status_code < 500, (method, path, response.status_code)
        assert SECRET not in response.text


def _plant_row(daemon: Daemon, run: str, kind: str, name: str) -> None:
    with sqlite3.connect(daemon.data_dir / "openrld.sqlite3", timeout=5) as db:
        db.execute(
            "INSERT INTO checkpoints (run_id, kind, name, owner, size_bytes, user_metadata, created_us, expires_us, public)"
            " VALUES (?, ?, ?, 'alice', 1, '{}', ?, NULL, 0)", (run, kind, name, int(time.time() * 1e6)),
        )


def test_a_symlinked_checkpoint_dir_planted_in_the_data_dir_is_refused(daemon, http, alice, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text(SECRET)
    planted = daemon.data_dir / "checkpoints" / alice["run"] / "external_weights" / "planted"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(outside)
    _plant_row(daemon, alice["run"], "external_weights", "planted")
    base = f"/api/v1/training_runs/{alice['run']}/checkpoints/external_weights/planted"
    urls = http.get(f"{base}/external_weights_urls", headers=ALICE)
    load = http.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{alice['run']}/external_weights/planted"}, headers=ALICE)
    deleted = http.delete(base, headers=ALICE)
    assert urls.status_code == 500 and "outside" in urls.json()["detail"]
    assert SECRET not in urls.text + load.text + deleted.text
    assert deleted.status_code == 500
    assert (outside / "adapter_config.json").read_text() == SECRET  # the delete never followed the link


def test_a_symlinked_file_inside_a_checkpoint_is_never_served(daemon, http, alice, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    directory = daemon.data_dir / "checkpoints" / alice["run"] / "external_weights" / "external"
    listing = f"/api/v1/training_runs/{alice['run']}/checkpoints/external_weights/external/external_weights_urls"
    urls = http.get(listing, headers=ALICE).json()["urls"]
    os.rename(directory / "adapter_config.json", directory / "adapter_config.json.real")
    (directory / "adapter_config.json").symlink_to(secret)
    try:
        served = httpx.get(urls["adapter_config.json"], timeout=30)
        listed = http.get(listing, headers=ALICE)
    finally:
        (directory / "adapter_config.json").unlink()
        os.rename(directory / "adapter_config.json.real", directory / "adapter_config.json")
    assert served.status_code == 404
    assert listed.status_code == 500
    assert SECRET not in served.text + listed.text


def test_a_tampered_or_expired_download_url_answers_404(http, alice):
    listing = f"/api/v1/training_runs/{alice['run']}/checkpoints/external_weights/external/external_weights_urls"
    urls = http.get(listing, headers=ALICE).json()["urls"]
    good = urls["adapter_model.safetensors"]
    assert httpx.get(good, timeout=30).status_code == 200
    assert httpx.get(good.replace("adapter_model.safetensors", "adapter_config.json"), timeout=30).status_code == 404
    expires = good.split("expires=")[1].split("&")[0]
    assert httpx.get(good.replace(f"expires={expires}", f"expires={int(expires) + 1}"), timeout=30).status_code == 404


def test_the_daemon_deletes_a_checkpoint_when_its_ttl_passes(daemon, http, alice):
    service = tinker.ServiceClient(base_url=daemon.url, api_key=ALICE["X-API-Key"])
    path = service.create_training_client_from_state(alice["state"]).result().save_state("short-lived", ttl_seconds=3600).result().path
    service.close("success").result()
    run, _, _, name = path[len("tinker://"):].partition("/")[0], None, None, path.rsplit("/", 1)[1]
    # The SDK's shortest TTL is an hour; move this one's expiry into the past instead of waiting.
    with sqlite3.connect(daemon.data_dir / "openrld.sqlite3", timeout=5) as db:
        db.execute("UPDATE checkpoints SET expires_us = 1 WHERE run_id = ? AND name = ?", (run, name))

    def listed() -> list[str]:
        return [c["tinker_path"] for c in http.get(f"/api/v1/training_runs/{run}/checkpoints", headers=ALICE).json()["checkpoints"]]

    def expired() -> list[str]:
        events = http.get("/api/v1/audit", params={"event_type": "checkpoints"}, headers=ALICE).json()["entries"]
        return [e["tinker_path"] for e in events if e["event"] == "checkpoint_expired"]

    files = daemon.data_dir / "checkpoints" / run / "weights" / name
    # The next maintenance sweep: the row goes first, then its files, in the checkpoint actor's
    # thread, and the audit event once that deletion has returned (actors/maintenance.py).
    wait_for(lambda: path not in listed() and not files.exists() and expired(), timeout_s=30, poll_s=0.1)
    assert expired() == [path]
