"""Round-trip latency of a future that does no work, on loopback.

The work-free future is an `optim_step` with no gradient since the last step
(a no-op by the spec): submit it, then `retrieve_future` its result. It is
measured two ways against a real daemon:

- lean client: Python's http.client on one keep-alive connection, so the
  figure is the daemon's, not the client library's. The baseline, in the same
  run and on the same connection, is the bare HTTP round trip of
  `GET /api/v1/healthz`; the ratio separates the future machinery from transport.
- the real SDK: `training_client.optim_step(AdamParams()).result()`.

Run: `make bench` or `.venv/bin/python bench/future_latency.py`.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import tiny_daemon

ROUNDS, WARMUP = 1000, 100
HEADERS = {"X-API-Key": "tml-bench", "Content-Type": "application/json"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Lean:
    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.conn = http.client.HTTPConnection(parsed.hostname, parsed.port)
        self.conn.connect()
        # http.client writes headers and body in two sends; without NODELAY the
        # body waits on Nagle for the server's delayed ACK, which is the client's fault.
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        self.conn.request(method, path, body=None if body is None else json.dumps(body), headers=HEADERS)
        return json.loads(self.conn.getresponse().read())


def lean_model(url: str) -> tuple[Lean, str]:
    """A lean client and a ready LoRA job on the tiny Llama: (client, model id)."""
    lean = Lean(url)
    session = lean.call("POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "bench"})
    created = lean.call(
        "POST", "/api/v1/create_model",
        {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
    )
    while lean.call("POST", "/api/v1/retrieve_future", {"request_id": created["request_id"]}).get("type") == "try_again":
        pass
    return lean, created["model_id"]


def lean_client(url: str) -> tuple[list[float], list[float]]:
    lean, model_id = lean_model(url)
    bare, future = [], []
    for i in range(WARMUP + ROUNDS):
        start = time.perf_counter()
        lean.call("GET", "/api/v1/healthz")
        middle = time.perf_counter()
        submitted = lean.call("POST", "/api/v1/optim_step", {"model_id": model_id, "seq_id": i + 1, "adam_params": {}})
        result = lean.call("POST", "/api/v1/retrieve_future", {"request_id": submitted["request_id"]})
        end = time.perf_counter()
        assert "metrics" in result, result
        if i >= WARMUP:
            bare.append(middle - start)
            future.append(end - middle)
    return bare, future


def through_sdk(url: str) -> list[float]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    times = []
    for i in range(WARMUP + ROUNDS // 4):
        start = time.perf_counter()
        training.optim_step(types.AdamParams()).result()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    service.close("success").result()
    return times


def main() -> None:
    with tiny_daemon() as (url, _):
        bare, future = lean_client(url)
        sdk = through_sdk(url)
    p50 = statistics.median(future)
    print(f"no-work future (optim_step with no gradient), loopback, {ROUNDS} rounds")
    print(f"lean client: bare HTTP round trip p50 {statistics.median(bare) * 1e3:.2f} ms")
    print(f"lean client: submit + retrieve p50 {p50 * 1e3:.2f} ms, p99 {percentile(future, 0.99) * 1e3:.2f} ms (target p50 < 3 ms)")
    print(f"lean client: ratio future / bare round trip: {p50 / statistics.median(bare):.2f}")
    print(f"tinker SDK: optim_step().result() p50 {statistics.median(sdk) * 1e3:.2f} ms, p99 {percentile(sdk, 0.99) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
