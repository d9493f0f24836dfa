"""What the routes put on the wire, byte for byte, where the bytes are the point.

Every route replies through a `wire` Struct, whose tests (tests/api/test_wire.py)
check it against the SDK's types. These tests check that the route really
sends it that way: a field at its default is left out rather than sent as null
or as its default, and an acknowledgement is exactly `{}`.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
import tinker
from tinker import types

from openrld import __version__

HEADERS = {"X-API-Key": "tml-test"}


@pytest.fixture(scope="module")
def http(shared_daemon):
    with httpx.Client(base_url=shared_daemon.url, headers=HEADERS, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def trained(shared_daemon):
    """A LoRA run with one saved state (unpublished, no TTL) and no sampler checkpoint, and a
    sampling session on the base model."""
    service = tinker.ServiceClient(base_url=shared_daemon.url, api_key=HEADERS["X-API-Key"])
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(40, 50))),
        loss_fn_inputs={"target_tokens": list(range(41, 51))},
    )
    training.forward_backward([datum], "cross_entropy").result()
    state = training.save_state("state").result().path
    run_id = training.get_info().model_id
    service.create_sampling_client(base_model="tiny-llama")
    yield {"run": run_id, "session": run_id.split(":", 1)[0], "state": state}
    service.close("success").result()


def test_a_run_without_a_sampler_checkpoint_leaves_the_key_out(http, trained):
    body = http.get(f"/api/v1/training_runs/{trained['run']}").json()
    assert "last_sampler_checkpoint" not in body
    assert body["last_checkpoint"]["tinker_path"] == trained["state"]


def test_a_run_that_is_not_corrupted_leaves_corrupted_out(http, trained):
    body = http.get(f"/api/v1/training_runs/{trained['run']}").json()
    assert "corrupted" not in body  # the SDK's default is False


def test_an_unpublished_checkpoint_without_ttl_leaves_public_and_expires_at_out(http, trained):
    body = http.get(f"/api/v1/training_runs/{trained['run']}/checkpoints").json()
    [row] = body["checkpoints"]
    assert sorted(row) == ["checkpoint_id", "checkpoint_type", "size_bytes", "time", "tinker_path", "user_metadata"]


def test_checkpoint_times_carry_a_timezone(http, trained):
    [row] = http.get(f"/api/v1/training_runs/{trained['run']}/checkpoints").json()["checkpoints"]
    assert datetime.fromisoformat(row["time"].replace("Z", "+00:00")).utcoffset() is not None


def test_a_session_without_a_display_name_leaves_it_out(http, trained):
    body = http.get(f"/api/v1/sessions/{trained['session']}").json()
    assert sorted(body) == ["sampler_ids", "training_run_ids", "user_metadata"]


def test_deleting_a_checkpoint_answers_an_empty_object(http, trained):
    service = tinker.ServiceClient(base_url=str(http.base_url), api_key=HEADERS["X-API-Key"])
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    path = training.save_state("doomed").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    response = http.delete(f"/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    assert (response.status_code, response.content) == (200, b"{}")
    service.close("success").result()


def test_healthz_is_status_and_version(http):
    response = http.get("/api/v1/healthz")
    assert response.json() == {"status": "ok", "version": __version__}


def test_client_config_with_every_flag_at_the_sdk_default_is_empty(http):
    response = http.post("/api/v1/client/config", json={"sdk_version": tinker.__version__})
    assert (response.status_code, response.content) == (200, b"{}")  # open mode: no JWT exchange


def test_create_session_carries_the_type_the_sdk_declares(http):
    body = http.post("/api/v1/create_session", json={"sdk_version": tinker.__version__}).json()
    assert sorted(body) == ["session_id", "type"] and body["type"] == "create_session"


def test_a_base_model_sampler_leaves_model_path_out(http, trained):
    [sampler_id] = http.get(f"/api/v1/sessions/{trained['session']}").json()["sampler_ids"]
    body = http.get(f"/api/v1/samplers/{sampler_id}").json()
    assert body == {"sampler_id": sampler_id, "base_model": "tiny-llama"}


def test_an_error_is_exactly_its_detail(http):
    response = http.get("/api/v1/training_runs/no-such-run")
    assert (response.status_code, response.content) == (404, b'{"detail":"no training run \'no-such-run\'"}')


def test_an_unknown_route_is_exactly_its_detail(http):
    response = http.get("/api/v1/no_such_route")
    assert (response.status_code, response.content) == (404, b'{"detail":"no route GET /api/v1/no_such_route"}')


def test_apikey_me_in_open_mode_is_exactly_what_the_cli_reads(http):
    response = http.get("/api/v1/auth/apikey/me")
    assert (response.status_code, response.content) == (200, (
        b'{"key_id":0,"name":"open mode","note":"open mode: no key file",'
        b'"details":{"org_details":{"name":"openrld"},"user_details":{"email":""}}}'
    ))


def test_an_audit_entry_copies_its_deprecated_fields_and_writes_utc(http, trained):
    entries = http.get("/api/v1/audit", params={"event_type": "checkpoints"}).json()["entries"]
    [entry] = [e for e in entries if e["event"] == "checkpoint_created" and e["tinker_path"] == trained["state"]]
    assert sorted(entry) == ["event", "event_details", "model_id", "timestamp", "tinker_path"]
    assert entry["model_id"] == trained["run"] and entry["timestamp"].endswith("Z")


def test_billing_usage_of_a_session_without_metadata_leaves_it_out(http, trained):
    now = datetime.now(UTC)
    hours = timedelta(hours=2)
    window = {"starting_on": (now - hours).isoformat(), "ending_before": (now + hours).isoformat()}
    body = http.get("/api/v1/billing/usage/events", params=window).json()
    assert body["sessions"][trained["session"]] == {}  # the SDK's default user_metadata is None: not null
    events = {e["event_info"]["type"]: e for e in body["data"] if e["session_id"] == trained["session"]}
    assert sorted(events["training"]) == [
        "base_model", "bucket_end", "bucket_start", "event_info", "session_id", "user_id", "user_name",
    ]
    assert "base_model" not in events["checkpoint"]
    assert events["checkpoint"]["event_info"] == {"type": "checkpoint", "count": 1}


def test_checkpoint_storage_outside_a_project_leaves_project_id_out(http, trained):
    items = http.get("/api/v1/billing/usage/checkpoints/current").json()["data"]
    [item] = [i for i in items if "project_id" not in i]
    assert sorted(item) == ["checkpoint_count", "org_user_urn", "size_bytes", "size_gigabytes", "user_name"]
