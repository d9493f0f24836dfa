"""The route table, driven directly: what a method and path match, and which paths the gate lets in keyless."""

from __future__ import annotations

import trio

from openrld.api import rest, tinker
from openrld.api.asgi import Reply, replay
from openrld.api.auth import SCOPE_USER, Authenticator
from openrld.api.fastpath import Call, FastPath
from openrld.api.gate import Gate
from openrld.api.metrics import RequestMetrics
from openrld.api.routes import ROUTES, TABLE
from openrld.cluster.relay import HomeBy


def test_a_fixed_path_matches_its_route_with_no_parameters() -> None:
    matched = TABLE.match("POST", "/api/v1/forward_backward")
    assert matched is not None
    assert (matched.route.handler, matched.route.is_hot, matched.route.home, matched.params) == (
        tinker.forward_backward, True, HomeBy.MODEL_IN_BODY, {}
    )


def test_a_patterned_path_matches_with_its_parameters() -> None:
    matched = TABLE.match("DELETE", "/api/v1/training_runs/r-1/checkpoints/weights/step-2")
    assert matched is not None
    assert (matched.route.handler, matched.route.home, matched.params) == (
        rest.delete_checkpoint, HomeBy.RUN_IN_PATH, {"run_id": "r-1", "kind": "weights", "name": "step-2"}
    )


def test_a_fixed_path_wins_over_a_pattern_that_also_fits_it() -> None:
    matched = TABLE.match("POST", "/api/v1/sessions/search")
    assert matched is not None and matched.route.path == "/api/v1/sessions/search"


def test_another_method_a_head_or_an_unknown_path_matches_nothing() -> None:
    assert TABLE.match("GET", "/api/v1/forward_backward") is None
    assert TABLE.match("HEAD", "/api/v1/sessions/s-1") is None
    assert TABLE.match("GET", "/api/v1/no_such_route") is None
    assert TABLE.match("GET", "/api/v1/training_runs/r-1/") is None


def test_keyless_paths_are_health_metrics_the_peer_api_signed_files_and_the_console_page() -> None:
    assert sorted(TABLE.keyless_paths) == [
        "/api/v1/healthz", "/console", "/metrics", "/openrl/peer/v1/locate", "/openrl/peer/v1/pushpull",
        "/openrl/peer/v1/spans/ended", "/openrl/peer/v1/spans/start", "/openrl/peer/v1/spans/stop",
    ]
    assert TABLE.keyless_prefixes == ("/api/v1/download/", "/api/v1/trace/", "/console/")
    assert TABLE.is_keyless("/api/v1/download/r-1/weights/a/adapter.safetensors")
    assert not TABLE.is_keyless("/api/v1/forward_backward")


def test_each_method_and_path_is_declared_once_and_every_hot_route_is_a_post() -> None:
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    assert {r.method for r in ROUTES if r.is_hot} == {"POST"}
    assert [r.path for r in ROUTES if r.is_longpoll] == ["/api/v1/retrieve_future"]


async def scope_past_the_gate(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """The scope the gate hands its inner app for a request with `headers`, on a node with one key."""
    seen: list[dict] = []

    async def inner(scope: dict, receive, send) -> None:
        seen.append(scope)

    gate = Gate(
        inner, auth=Authenticator({"tml-a": "alice"}), routes=TABLE, max_body_bytes=100, metrics=RequestMetrics()
    )
    await gate({"type": "http", "method": "POST", "path": path, "headers": headers}, trio.sleep_forever, trio.sleep_forever)
    return seen[0]


async def test_the_gate_leaves_the_user_it_found_in_the_scope() -> None:
    scope = await scope_past_the_gate("/api/v1/optim_step", [(b"x-api-key", b"tml-a")])
    assert scope[SCOPE_USER] == "alice"


async def test_the_gate_looks_for_no_user_on_a_keyless_path() -> None:
    assert SCOPE_USER not in await scope_past_the_gate("/api/v1/healthz", [])


async def test_the_fast_path_hands_its_handler_the_user_the_gate_found() -> None:
    calls: list[Call] = []

    async def handler(call: Call) -> Reply:
        calls.append(call)
        return Reply(b"{}")

    async def send(message: dict) -> None:
        pass

    front = FastPath(None, {"/api/v1/optim_step": handler}, max_body_bytes=100)  # type: ignore[arg-type]
    scope = {
        "type": "http", "method": "POST", "path": "/api/v1/optim_step",
        "headers": [(b"x-api-key", b"tml-a")], SCOPE_USER: "alice",
    }
    await front(scope, replay(b"{}"), send)
    assert (calls[0].user, calls[0].api_key, calls[0].body) == ("alice", "tml-a", b"{}")
