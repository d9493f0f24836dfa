"""The request log records each request's finish, for the session trace and the pending gauge."""

from __future__ import annotations

import json
import urllib.request

import httpx
import tinker
from tinker import types

from tests.waits import wait_for

API_KEY = "tml-test"


def _pending_gauge(url: str) -> str:
    text = httpx.get(f"{url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    return next(line.split()[-1] for line in text.splitlines() if line.startswith("openrld_store_pending_requests"))


def _trace_events(rest: tinker.RestClient, session_id: str) -> list[dict]:
    with urllib.request.urlopen(rest.export_session_trace(session_id).result(), timeout=30) as response:
        return json.loads(response.read())["traceEvents"]


def test_finished_requests_leave_the_pending_gauge_and_show_their_duration_in_the_trace(make_daemon):
    daemon = make_daemon()
    service = tinker.ServiceClient(base_url=daemon.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]), loss_fn_inputs={"target_tokens": [6, 7, 8, 9]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    # Finishes are logged in batches, every futures.LOG_FLUSH_S.
    wait_for(lambda: _pending_gauge(daemon.url) == "0", timeout_s=10, poll_s=0.1)
    rest = tinker.RestClient(base_url=daemon.url, api_key=API_KEY)
    events = _trace_events(rest, training.model_id.split(":", 1)[0])
    service.close("success").result()
    assert _pending_gauge(daemon.url) == "0"
    assert [e["dur"] > 0 for e in events if e["name"] == "forward_backward"] == [True]
