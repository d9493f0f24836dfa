"""A `tinker` CLI session against a daemon: the console script the SDK installs, as a user types it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tinker
from tinker import types

TINKER = str(Path(sys.executable).with_name("tinker"))


def _cli(daemon_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, TINKER_BASE_URL=daemon_url, TINKER_API_KEY="tml-cli", TINKER_TELEMETRY="0", PYTHONFAULTHANDLER="1"
    )
    done = subprocess.run([TINKER, "--format", "json", *args], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode == -signal.SIGABRT and _whole_json(done.stdout):
        # tinker 0.38's console script once died by SIGABRT as it exited, after printing its whole
        # answer, with nothing on stderr (CI, `checkpoint delete`; not reproduced in 210 runs here):
        # the SDK's process ending, not the daemon. The answer is what these tests check.
        warnings.warn(f"tinker {' '.join(args[:2])} aborted after its answer: {done.stderr[-2000:]}", stacklevel=2)
        done.returncode = 0
    return done


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def saved(shared_daemon):
    """One run with a state checkpoint and a sampler checkpoint, made through the SDK."""
    service = tinker.ServiceClient(base_url=shared_daemon.url, api_key="tml-cli")
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]), loss_fn_inputs={"target_tokens": [6, 7, 8, 9]}
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    state = training.save_state("cli-state").result().path
    sampler = training.save_weights_for_sampler("cli-sampler").result().path
    doomed = training.save_weights_for_sampler("cli-doomed").result().path
    service.close("success").result()
    return training.model_id, state, sampler, doomed


def test_run_list_shows_the_run(shared_daemon, saved):
    run_id = saved[0]
    result = _cli(shared_daemon.url, "run", "list")
    assert result.returncode == 0, result.stderr
    assert run_id in {run["training_run_id"] for run in json.loads(result.stdout)["runs"]}


def test_run_info_names_the_base_model(shared_daemon, saved):
    run_id = saved[0]
    result = _cli(shared_daemon.url, "run", "info", run_id)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["base_model"] == "tiny-llama"


def test_checkpoint_list_shows_the_checkpoints_of_the_run(shared_daemon, saved):
    run_id, state, sampler, doomed = saved
    result = _cli(shared_daemon.url, "checkpoint", "list", "--run-id", run_id)
    assert result.returncode == 0, result.stderr
    paths = {c["tinker_path"] for c in json.loads(result.stdout)["checkpoints"]}
    assert {state, sampler} <= paths <= {state, sampler, doomed}


def test_checkpoint_publish_then_info_reports_it_public(shared_daemon, saved):
    state = saved[1]
    published = _cli(shared_daemon.url, "checkpoint", "publish", state)
    assert published.returncode == 0, published.stderr
    info = _cli(shared_daemon.url, "checkpoint", "info", state)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["public"] is True


def test_checkpoint_delete_removes_it(shared_daemon, saved):
    run_id, _, _, doomed = saved
    deleted = _cli(shared_daemon.url, "checkpoint", "delete", doomed, "-y")
    assert deleted.returncode == 0, deleted.stderr
    listed = _cli(shared_daemon.url, "checkpoint", "list", "--run-id", run_id)
    assert doomed not in {c["tinker_path"] for c in json.loads(listed.stdout)["checkpoints"]}
