"""Every tinker SDK release in the matrix runs the short loop against one default node.

Each release runs tests/e2e/sdk_loop.py in its own venv (tests/sdk_venvs.py;
`make install-test` builds them, a missing one is built here), in its own
process, against one daemon shared by the whole matrix and started from the
project's venv. The releases are `openrld.sdk_support.TESTED_RELEASES` and any
newer one the last `make install-test` found on the package index; once a new
release passes it goes into TESTED_RELEASES, and the node's stated range and
the README take it from there.

What a release must see, whichever wire form it speaks (JSON bodies and JSON
results for 0.16, protobuf results for samples from 0.18, protobuf
forward_backward from 0.21 when the client config says so, from 0.25 always):
the same first loss as the current SDK gets on the same data (a new LoRA
adapter starts as the base model), a training state that restores bit for bit,
a sampler that scores the prompt as the trainer does, greedy samples, and both
checkpoints listed by the REST client.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from sdk_venvs import matrix, run_loop
from tinker import types

from openrld.sdk_support import TESTED_RELEASES

BASE_MODEL = "tiny-llama"  # shared_daemon's name for the tiny Llama
TOKENS = list(range(40, 60))  # as sdk_loop.TOKENS
MAX_TOKENS = 4  # as sdk_loop.MAX_TOKENS
# Trainer and sampler score the prompt with different kernels (one batched forward
# against a KV-cached prefill), both in float32: they agree to a few ulps of |logprob| ~ 5.
SCORE_ATOL = 1e-5


@pytest.fixture(scope="module")
def base_loss(shared_daemon) -> float:
    """loss:sum of a new LoRA adapter on the loop's datum, through the project's own SDK."""
    service = tinker.ServiceClient(base_url=shared_daemon.url, api_key="tml-reference")
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], dtype=np.int64)},
    )
    return training.forward([datum], "cross_entropy").result().metrics["loss:sum"]


@pytest.mark.parametrize("release", matrix())
def test_sdk_release_runs_the_whole_loop(release: str, shared_daemon, base_loss: float) -> None:
    result = run_loop(release, shared_daemon.url, BASE_MODEL)

    assert result["sdk"] == release
    # A new adapter's B is zero, so its first loss is the base model's: the same bits in any wire form.
    assert result["losses"][0] == base_loss
    assert result["losses"][1] < result["losses"][0]
    assert result["restored_loss"] == result["trained_loss"]
    prompt = result["sampler_prompt_logprobs"]
    assert prompt[0] is None  # the first prompt token has no context to be scored from
    np.testing.assert_allclose(prompt[1:], result["trainer_prompt_logprobs"], rtol=0, atol=SCORE_ATOL)
    first, second = result["sampled_tokens"]
    # Greedy: two samples, one answer, of MAX_TOKENS or fewer where it picks EOS (the loop's LoRA is
    # unseeded, so its trained answer differs run to run: one run's was [200, 151, EOS]).
    assert (second, 1 <= len(first) <= MAX_TOKENS) == (first, True)
    assert result["sampled_logprobs"] == [[0.0] * len(first)] * 2  # log q of a greedy pick is log 1
    assert result["checkpoints"] == [["sampler", "sampler_weights/sampler-a"], ["training", "weights/state-a"]]


def test_node_counts_requests_under_the_sdk_release_that_sent_them(shared_daemon) -> None:
    oldest = TESTED_RELEASES[0]
    with httpx.Client(base_url=shared_daemon.url, timeout=30) as http:
        before = _sdk_requests(http.get("/metrics").text, oldest)
        for _ in range(3):
            http.get("/api/v1/healthz", headers={"X-Stainless-Package-Version": oldest})
        after = _sdk_requests(http.get("/metrics").text, oldest)
    assert after - before == 3


def _sdk_requests(metrics: str, release: str) -> int:
    prefix = f'openrld_sdk_requests_total{{sdk_version="{release}"}} '
    return next((int(line.removeprefix(prefix)) for line in metrics.splitlines() if line.startswith(prefix)), 0)
