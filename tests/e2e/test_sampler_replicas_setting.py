"""openrl.sampler_replicas end to end: a job's setting grows its (shared) group's sampler.

Rule under test: a LoRA group runs the most replicas any of its jobs asked for, from
the moment that job's create_model answers. The counts come from /metrics.
"""

from __future__ import annotations

import re

import httpx
import pytest
import tinker
from tinker import types

API_KEY = "tml-test"
REQUESTS = 6


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def sampler_metric(daemon, name: str, base_model: str) -> dict[str, float]:
    """{label suffix: value} of one sampler metric for one base model."""
    text = httpx.get(f"{daemon.url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf'{name}\{{base_model="{base_model}"(.*)\}} (\S+)', line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def test_the_group_runs_the_most_replicas_its_jobs_asked_for(service, shared_daemon):
    service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    assert sampler_metric(shared_daemon, "openrld_sampler_replicas", "tiny-llama") == {"": 1.0}
    service.create_lora_training_client(
        base_model="tiny-llama", rank=4, user_metadata={"openrl.sampler_replicas": "3"}
    ).result()
    service.create_lora_training_client(
        base_model="tiny-llama", rank=4, user_metadata={"openrl.sampler_replicas": "2"}
    ).result()
    assert sampler_metric(shared_daemon, "openrld_sampler_replicas", "tiny-llama") == {"": 3.0}


def test_replicas_of_a_job_serve_its_concurrent_requests(service, shared_daemon):
    training = service.create_lora_training_client(
        base_model="tiny-qwen3", rank=4, seed=3, user_metadata={"openrl.sampler_replicas": "2"}
    ).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=5, stop=[])
    prompt = types.ModelInput.from_ints([7, 8, 9])
    futures = [sampler.sample(prompt, num_samples=2, sampling_params=params) for _ in range(REQUESTS)]
    results = [future.result() for future in futures]
    # Same seed, same weights: whichever replica served a request, the tokens are the same.
    assert all(r.sequences[0].tokens == results[0].sequences[0].tokens for r in results)
    per_replica = sampler_metric(shared_daemon, "openrld_sampler_replica_requests_total", "tiny-qwen3")
    assert sorted(per_replica) == [',replica="0"', ',replica="1"']
    assert sum(per_replica.values()) == REQUESTS
    assert min(per_replica.values()) >= 1, per_replica
