"""What the routes put on the wire, byte for byte, where the bytes are the point.

Every route replies through a `wire` Struct, whose tests (tests/api/test_wire.py)
check it against the SDK's types. These tests check that the route really
sends it that way: a field at its default is left out rather than sent as null
or as its default, and an acknowledgement is exactly `{}`.
"""

from __future__ import annotations

from datetime import datetime

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
