"""The wire protocol at the edges the SDK alone does not reach: ordering, retries, auth, bad input."""

from __future__ import annotations

import gzip
import signal
import socket
from urllib.parse import urlsplit

import httpx
import pytest
import tinker
from conftest import Daemon, write_config
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

HEADERS = {"X-API-Key": "tml-test"}


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(f"/api/v1/{path}", json=body, headers=HEADERS)


def _result(client: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(20):
        response = _post(client, "retrieve_future", {"request_id": request_id, "allow_metadata_only": False})
        if response.headers["content-type"].startswith("application/json") and response.json().get("type") == "try_again":
            continue
        return response
    raise AssertionError(f"future {request_id} never completed")


def _fb_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:]},
                )
            ],
            loss_fn="cross_entropy",
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


@pytest.fixture
def http(shared_daemon):
    with httpx.Client(base_url=shared_daemon.url, timeout=60) as client:
        yield client


@pytest.fixture
def model_id(http):
    session_id = _post(http, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    future = _post(
        http, "create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
    ).json()
    assert _result(http, future["request_id"]).json()["model_id"] == future["model_id"]
    return future["model_id"]


def _fb(http: httpx.Client, model_id: str, seq_id: int, tokens: list[int]) -> httpx.Response:
    return http.post(
        "/api/v1/forward_backward", content=_fb_body(model_id, seq_id, tokens),
        headers={**HEADERS, "Content-Type": "application/x-protobuf"},
    )


def test_out_of_order_seq_ids_run_in_seq_id_order_without_deadlock(http, model_id):
    tokens = list(range(10, 30))
    # Arrival order 3, 2, 1 as the SDK's concurrent chunks do (first chunk last).
    optim = _post(http, "optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 0.1}}).json()
    second = _fb(http, model_id, 2, tokens).json()
    first = _fb(http, model_id, 1, tokens).json()
    from tinker.proto.response_conv import deserialize_forward_backward_output

    loss1 = deserialize_forward_backward_output(_result(http, first["request_id"]).content).metrics["loss:sum"]
    loss2 = deserialize_forward_backward_output(_result(http, second["request_id"]).content).metrics["loss:sum"]
    assert loss1 == loss2  # both ran before the optim_step that follows them
    assert "grad_norm:mean" in _result(http, optim["request_id"]).json()["metrics"]


def test_retried_seq_id_returns_the_first_future(http, model_id):
    first = _fb(http, model_id, 1, list(range(5, 15))).json()
    retry = _fb(http, model_id, 1, list(range(5, 15))).json()
    assert retry["request_id"] == first["request_id"]


def test_pending_future_answers_408_try_again_after_the_long_poll(http, model_id):
    # seq 2 waits for seq 1, which never comes: the poll must come back, not hang.
    pending = _fb(http, model_id, 2, list(range(5, 15))).json()
    response = _post(http, "retrieve_future", {"request_id": pending["request_id"], "allow_metadata_only": True})
    assert response.status_code == 408
    assert response.json() == {"type": "try_again", "request_id": pending["request_id"], "queue_state": "active"}


def test_the_sdk_polls_through_408s_without_a_warning(tmp_path, tiny_llama, caplog):
    # A node whose long-poll lets go after 10 ms: every future outlives several polls. The SDK
    # logs a warning for each 200 try_again it polls through; a 408 it re-polls in silence.
    config = write_config(tmp_path / "openrld.toml", tmp_path / "data", {"tiny-llama": tiny_llama}, "longpoll_s = 0.01")
    daemon = Daemon(tmp_path / "data", config, tmp_path / "daemon.log").start()
    try:
        service = tinker.ServiceClient(base_url=daemon.url, api_key=HEADERS["X-API-Key"])
        with caplog.at_level("WARNING", logger="tinker"):
            training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
            tokens = list(range(5, 105))
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})
            loss = training.forward_backward([datum] * 8, "cross_entropy").result().metrics["loss:sum"]
        polled = [line for line in httpx.get(f"{daemon.url}/metrics", timeout=10).text.splitlines()
                  if line.startswith("openrld_http_requests_total") and "retrieve_future" in line and 'status="408"' in line]
    finally:
        daemon.stop()
    assert [r.getMessage() for r in caplog.records if "try_again" in r.getMessage()] == []
    assert len(polled) == 1 and float(polled[0].split()[-1]) >= 1  # it did poll through 408s
    assert loss > 0.0


def test_bad_loss_input_fails_the_future_and_the_next_seq_id_still_runs(http, model_id):
    bad = types.ForwardBackwardRequest(
        model_id=model_id, seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(
            data=[types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [1, 2]})],
            loss_fn="cross_entropy",
        ),
    )
    response = http.post(
        "/api/v1/forward_backward", content=forward_backward_request_to_proto(bad).SerializeToString(),
        headers={**HEADERS, "Content-Type": "application/x-protobuf"},
    ).json()
    failed = _result(http, response["request_id"]).json()
    assert failed["category"] == "user"
    assert "target_tokens" in failed["error"]
    ok = _fb(http, model_id, 2, list(range(5, 15))).json()
    assert _result(http, ok["request_id"]).headers["content-type"].startswith("application/x-protobuf")


def test_unknown_openrl_key_is_400_naming_the_key(http):
    response = _post(http, "create_session", {"tags": ["openrl.fast_mode=true"], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert response.status_code == 400
    assert "openrl.fast_mode" in response.json()["detail"]


def test_automodel_on_a_node_without_its_environment_is_refused_by_name(http):
    session_id = _post(http, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    response = _post(
        http, "create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4},
         "user_metadata": {"openrl.trainer_backend": "automodel"}},
    )
    assert (response.status_code, response.json()["detail"]) == (
        400,
        "openrl.trainer_backend=automodel: this node has no Automodel environment "
        "([workers] automodel_python is unset; `make automodel-env` builds one)",
    )


def test_a_trainer_image_on_several_devices_is_refused_by_name(http):
    session_id = _post(http, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    response = _post(
        http, "create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4},
         "user_metadata": {"openrl.trainer_backend": "registry.example/trainer:1", "openrl.trainer_gpus": "2"}},
    )
    assert response.status_code == 400
    assert "openrl.trainer_gpus=2 with a trainer image is not supported yet" in response.json()["detail"]


def test_malformed_protobuf_is_400_and_the_daemon_keeps_serving(http):
    response = http.post(
        "/api/v1/forward_backward", content=b"\xff\xff\xff not protobuf",
        headers={**HEADERS, "Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 400
    assert "detail" in response.json()
    assert http.get("/api/v1/healthz").json()["status"] == "ok"


def test_bytes_that_are_not_http_are_400_and_the_daemon_keeps_serving(shared_daemon, http):
    address = urlsplit(shared_daemon.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as raw:
        raw.sendall(b"\x16\x03\x01 a TLS hello is not HTTP\r\n\r\n")
        reply = raw.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert b"bad HTTP request" in reply
    assert http.get("/api/v1/healthz").json()["status"] == "ok"


def test_a_body_over_the_limit_is_413_and_its_connection_serves_the_next_request(make_daemon):
    daemon = make_daemon("max_body_bytes = 4096")
    with httpx.Client(base_url=daemon.url, timeout=60) as client:
        refused = client.post("/api/v1/forward_backward", content=b"x" * 20_000, headers=HEADERS)
        after = client.get("/api/v1/healthz")
    assert refused.status_code == 413
    assert refused.json()["detail"] == "request body over 4096 bytes"
    assert after.json()["status"] == "ok"


@pytest.mark.parametrize(
    "name", ["../escape", "/etc/passwd", "a/b", "..", ".hidden"], ids=["dotdot", "absolute", "slash", "parent", "dotfile"]
)
def test_checkpoint_names_that_could_leave_the_data_dir_are_refused(http, model_id, name):
    response = _post(http, "save_weights", {"model_id": model_id, "seq_id": 1, "path": name})
    assert response.status_code == 400
    assert "name" in response.json()["detail"]


def test_unknown_model_is_404(http):
    response = _post(http, "optim_step", {"model_id": "s-0000:train:0", "seq_id": 1, "adam_params": {}})
    assert response.status_code == 404


def test_a_key_without_the_tml_prefix_is_refused_by_the_sdk(shared_daemon):
    with pytest.raises(tinker.TinkerError, match="tml-"):
        tinker.ServiceClient(base_url=shared_daemon.url, api_key="sk-not-tinker").create_rest_client()


def test_in_key_file_mode_an_unknown_key_is_401(make_daemon, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('"tml-alice-key" = "alice"\n')
    daemon = make_daemon(f'api_keys_file = "{keys}"')
    with httpx.Client(base_url=daemon.url) as client:
        denied = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": "tml-mallory"})
        allowed = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": "tml-alice-key"})
    assert denied.status_code == 401
    assert allowed.status_code == 200


def test_sigterm_shuts_down_cleanly(make_daemon):
    daemon = make_daemon()
    assert daemon.stop(signal.SIGTERM) == 0
    assert "Traceback" not in daemon.log()


def _json_fb(http: httpx.Client, model_id: str, seq_id: int, tokens: list[int]) -> httpx.Response:
    # The body SDK 0.16.1 sends: JSON, TensorData lists, chunks without `type`.
    datum = {
        "model_input": {"chunks": [{"tokens": tokens[:-1]}]},
        "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [len(tokens) - 1]}},
    }
    body = {"forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}, "model_id": model_id, "seq_id": seq_id}
    return http.post("/api/v1/forward_backward", json=body, headers=HEADERS)


def test_forward_backward_result_comes_in_the_form_accept_asks_for(http, model_id):
    future = _json_fb(http, model_id, 1, list(range(10, 20))).json()
    retrieve = {"request_id": future["request_id"], "allow_metadata_only": False}
    as_json = http.post("/api/v1/retrieve_future", json=retrieve, headers={**HEADERS, "Accept": "application/json"})
    as_protobuf = _result(http, future["request_id"])  # httpx's default Accept: */*
    from tinker.proto.response_conv import deserialize_forward_backward_output

    output = deserialize_forward_backward_output(as_protobuf.content)
    body = as_json.json()
    assert as_json.headers["content-type"] == "application/json"
    assert as_protobuf.headers["content-type"].startswith("application/x-protobuf")
    assert body["metrics"] == output.metrics
    assert body["loss_fn_outputs"][0]["logprobs"] == {
        "data": output.loss_fn_outputs[0]["logprobs"].data, "dtype": "float32", "shape": [9],
    }


def test_forward_backward_declared_as_json_that_is_not_is_400_naming_the_type(http, model_id):
    response = http.post(
        "/api/v1/forward_backward", content=_fb_body(model_id, 1, list(range(10, 20))),
        headers={**HEADERS, "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["detail"].startswith("invalid ForwardBackwardJsonRequest body: not application/json: ")


def test_json_route_given_protobuf_is_415_naming_what_it_takes(http):
    response = http.post(
        "/api/v1/create_session", content=b"\x0a\x00", headers={**HEADERS, "Content-Type": "application/x-protobuf"}
    )
    assert (response.status_code, response.json()["detail"]) == (
        415, "CreateSessionRequest: this route takes application/json, got Content-Type 'application/x-protobuf'"
    )


def test_gzip_json_body_is_read_by_its_content_encoding(http):
    body = gzip.compress(b'{"tags": [], "sdk_version": "0.38.0"}')
    response = http.post(
        "/api/v1/create_session", content=body,
        headers={**HEADERS, "Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert (response.status_code, response.json()["type"]) == (200, "create_session")


def test_checkpoint_archive_of_sdks_before_0_36_is_refused_naming_the_sdk_to_upgrade_to(http):
    response = http.get("/api/v1/training_runs/s-1:train:0/checkpoints/weights/step-1/archive", headers=HEADERS)
    assert (response.status_code, response.json()["detail"]) == (
        400,
        "checkpoint archives (RestClient.get_checkpoint_archive_url) are not served by openrld; it serves a "
        "checkpoint's files as signed URLs: TrainingClient.save_weights_external, then "
        "RestClient.get_external_weights_urls, in tinker 0.28.0 and later (pip install 'tinker>=0.28.0')",
    )
