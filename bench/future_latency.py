"""Round-trip latency of a future that does no work, on loopback.

The work-free future is an `optim_step` with no gradient since the last step
(a no-op by the spec): submit, then `retrieve_future`, over one keep-alive
HTTP/1.1 connection, as the SDK does. The baseline, measured in the same run,
is the bare HTTP round trip of `GET /api/v1/healthz` on the same connection,
so the figure separates the daemon's future machinery from the transport.

Run: `make bench` or `.venv/bin/python bench/future_latency.py`.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import tiny_daemon  # noqa: E402

ROUNDS, WARMUP = 500, 50
HEADERS = {"X-API-Key": "tml-bench"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    with tiny_daemon() as (url, _), httpx.Client(base_url=url, headers=HEADERS, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "bench"}).json()
        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session["session_id"], "model_seq_id": 0, "base_model": "tiny-llama", "lora_config": {"rank": 4}},
        ).json()
        model_id = created["model_id"]
        while http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json().get("type") == "try_again":
            pass

        bare, future = [], []
        for i in range(WARMUP + ROUNDS):
            start = time.perf_counter()
            http.get("/api/v1/healthz")
            middle = time.perf_counter()
            submitted = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": i + 1, "adam_params": {}}).json()
            result = http.post("/api/v1/retrieve_future", json={"request_id": submitted["request_id"]}).json()
            end = time.perf_counter()
            assert "metrics" in result, result
            if i >= WARMUP:
                bare.append(middle - start)
                future.append(end - middle)
    p50, p99 = statistics.median(future), percentile(future, 0.99)
    print(f"{ROUNDS} rounds on loopback, one keep-alive connection")
    print(f"bare HTTP round trip (healthz): p50 {statistics.median(bare) * 1e3:.2f} ms")
    print(f"no-work future (submit + retrieve): p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms (target p50 < 3 ms)")
    print(f"ratio future p50 / bare round trip p50: {p50 / statistics.median(bare):.2f}")


if __name__ == "__main__":
    main()
