"""A node with a key file against clients that misbehave: refused from the head, forgotten when gone.

One daemon with an API key file serves the module. Raw sockets send request
heads whose bodies never come; a refusal must arrive anyway, from the head
alone. A long-poll whose client closes its socket must end at once, not hold
its connection until `longpoll_s`.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, write_api_keys, write_config
from tests.e2e.test_sampling_load import LONG, asample, long_context_qwen3
from tests.waits import wait_for

KEY = "tml-alice"
HEADERS = {"X-API-Key": KEY}
MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("hostile")
    keys = write_api_keys(root / "keys.toml", {KEY: "alice"})
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama, "tiny-qwen3": long_context_qwen3(root / "q")},
        f'api_keys_file = "{keys}"\nmax_body_bytes = {MAX_BODY}',
    )
    started = Daemon(root / "data", config, root / "daemon.log").start()
    yield started
    started.stop()


def head_only(daemon: Daemon, head: str) -> tuple[int, bytes]:
    """Send a request head and none of its body; the status and body of the reply that comes anyway."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as sock:
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, reply.partition(b"\r\n\r\n")[2]


def _length(reply: bytes) -> int:
    match = re.search(rb"content-length: (\d+)", reply.partition(b"\r\n\r\n")[0], re.IGNORECASE)
    return int(match.group(1)) if match else 0


def test_a_request_without_a_key_is_answered_401_before_its_body(daemon: Daemon) -> None:
    head = "POST /api/v1/forward_backward HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n"
    assert head_only(daemon, head) == (401, b'{"detail":"missing X-API-Key header"}')


def test_a_request_with_an_unknown_key_is_answered_401_before_its_body(daemon: Daemon) -> None:
    head = "POST /api/v1/create_model HTTP/1.1\r\nHost: t\r\nX-API-Key: tml-mallory\r\nContent-Length: 1000000\r\n\r\n"
    assert head_only(daemon, head) == (401, b'{"detail":"unknown API key"}')


def test_a_body_over_max_body_bytes_is_answered_413_from_its_head(daemon: Daemon) -> None:
    head = f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: t\r\nX-API-Key: {KEY}\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
    assert head_only(daemon, head) == (413, f'{{"detail":"request body over {MAX_BODY} bytes"}}'.encode())


def test_health_needs_no_key(daemon: Daemon) -> None:
    assert httpx.get(daemon.url + "/api/v1/healthz").status_code == 200


def open_connections(client: httpx.Client) -> int:
    metrics = client.get("/metrics").text
    return int(re.search(r"^openrld_http_connections_open (\d+)$", metrics, re.MULTILINE).group(1))


def test_a_long_poll_ends_when_its_client_goes_away(daemon: Daemon) -> None:
    with httpx.Client(base_url=daemon.url, headers=HEADERS, timeout=60) as client:
        session = client.post("/api/v1/create_session", json={"sdk_version": "test"}).json()["session_id"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-qwen3"}
        sampler_id = client.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        request_id = asample(client, sampler_id, 0, LONG).json()["request_id"]
        assert open_connections(client) == 1  # this client's own
        poll = f'{{"request_id": "{request_id}"}}'
        sock = socket.create_connection(("127.0.0.1", daemon.port))
        sock.sendall(
            f"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: t\r\nX-API-Key: {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(poll)}\r\n\r\n{poll}".encode()
        )
        wait_for(lambda: open_connections(client) == 2, timeout_s=5)  # the poll is held (longpoll_s is 30 s)
        sock.close()
        wait_for(lambda: open_connections(client) == 1, timeout_s=5)
        client.post("/api/v1/cancel_future", json={"request_id": request_id})
