"""With a shared checkpoint root, a surviving node resumes a dead node's job (issue 7, "Failure").

Two real daemons, not clustered, each with its own data dir, both with the same
`checkpoint_root` and the same two users. On A, Alice trains a LoRA job two
steps, saves its state, records what the job computes after the save, and A
is killed with SIGKILL. B never saw the run: it adopts the checkpoint from the
manifest in its directory, and `create_training_client_from_state[_with_optimizer]`
on B resumes the job exactly where A left it. Bob, on B, gets 404 as for any
checkpoint of someone else's.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import tinker
from conftest import Daemon, write_api_keys, write_config
from tinker import types

ALICE = "tml-alice-key"
BOB = "tml-bob-key"
ADAM = types.AdamParams(learning_rate=1e-2)
# Both daemons run the same code on the same CPU with the same thread count, so
# the same step is bit-identical; 1e-6 only allows for a reordered reduction.
STEP_TOLERANCE = 1e-6


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


DATA = [_datum(list(range(40, 60))), _datum(list(range(70, 82)))]


def _logprobs(client: tinker.TrainingClient) -> list[list[float]]:
    output = client.forward(DATA, "cross_entropy").result()
    return [row["logprobs"].tolist() for row in output.loss_fn_outputs]


class DeadNode(msgspec.Struct, frozen=True):
    """What A left behind, and what its job computed, recorded before the kill."""

    state_path: str
    sampler_path: str
    logprobs_at_save: list[list[float]]  # a forward right after save_state
    loss_of_next_step: float  # forward_backward's loss:sum on the step after the save
    logprobs_after_next_step: list[list[float]]
    checkpoints: list[dict[str, object]]  # GET .../checkpoints on A
    run: dict[str, object]  # GET /api/v1/training_runs/<run> on A


def _start(root: Path, name: str, models: dict[str, Path], keys: Path, shared: Path) -> Daemon:
    config = write_config(
        root / f"{name}.toml", root / name, models,
        f'longpoll_s = 3.0\napi_keys_file = "{keys}"\ncheckpoint_root = "{shared}"',
    )
    return Daemon(root / name, config, root / f"{name}.log").start()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("shared-root")
    keys = write_api_keys(root / "keys.toml", {ALICE: "alice", BOB: "bob"})
    shared = root / "checkpoints"
    shared.mkdir()
    models = {"tiny-llama": tiny_llama}
    a = _start(root, "a", models, keys, shared)
    b = None
    try:
        service = tinker.ServiceClient(base_url=a.url, api_key=ALICE)
        training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3).result()
        for _ in range(2):
            training.forward_backward(DATA, "cross_entropy").result()
            training.optim_step(ADAM).result()
        state_path = training.save_state("s1").result().path
        sampler_path = training.save_weights_for_sampler("s1").result().path
        at_save = _logprobs(training)
        loss = training.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
        training.optim_step(ADAM).result()
        after_step = _logprobs(training)
        run_id = training.get_info().model_id
        with httpx.Client(base_url=a.url, headers={"X-API-Key": ALICE}, timeout=60) as http:
            checkpoints = http.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
            run = http.get(f"/api/v1/training_runs/{run_id}").json()
        service.close("success").result()
        a.kill()
        b = _start(root, "b", models, keys, shared)
        yield b, DeadNode(state_path, sampler_path, at_save, loss, after_step, checkpoints, run)
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.fixture
def alice_on_b(nodes):
    b, _ = nodes
    service = tinker.ServiceClient(base_url=b.url, api_key=ALICE)
    yield service
    service.close("success").result()


def test_state_with_optimizer_resumes_exactly_where_the_dead_node_left_off(nodes, alice_on_b) -> None:
    _, dead = nodes
    resumed = alice_on_b.create_training_client_from_state_with_optimizer(dead.state_path).result()
    assert _logprobs(resumed) == dead.logprobs_at_save


def test_one_more_step_on_the_surviving_node_matches_the_dead_nodes_next_step(nodes, alice_on_b) -> None:
    _, dead = nodes
    resumed = alice_on_b.create_training_client_from_state_with_optimizer(dead.state_path).result()
    loss = resumed.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
    resumed.optim_step(ADAM).result()
    after = _logprobs(resumed)
    assert loss == pytest.approx(dead.loss_of_next_step, abs=STEP_TOLERANCE)
    assert [pytest.approx(row, abs=STEP_TOLERANCE) for row in dead.logprobs_after_next_step] == after


def test_state_without_optimizer_resumes_the_weights(nodes, alice_on_b) -> None:
    _, dead = nodes
    resumed = alice_on_b.create_training_client_from_state(dead.state_path).result()
    assert _logprobs(resumed) == dead.logprobs_at_save


def test_the_dead_nodes_checkpoints_list_on_the_surviving_node(nodes) -> None:
    b, dead = nodes
    run_id = dead.state_path.removeprefix("tinker://").split("/", 1)[0]
    with httpx.Client(base_url=b.url, headers={"X-API-Key": ALICE}, timeout=60) as http:
        listed = http.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    assert listed == dead.checkpoints


def test_the_dead_nodes_run_shows_on_the_surviving_node(nodes) -> None:
    b, dead = nodes
    with httpx.Client(base_url=b.url, headers={"X-API-Key": ALICE}, timeout=60) as http:
        run = http.get(f"/api/v1/training_runs/{dead.run['training_run_id']}").json()
    # last_request_time is left out: on B it is the first checkpoint's time, the last B knows of.
    assert {key: value for key, value in run.items() if key != "last_request_time"} == {
        key: value for key, value in dead.run.items() if key != "last_request_time"
    }


def test_a_sampling_client_on_the_surviving_node_reads_the_dead_nodes_sampler_weights(nodes, alice_on_b) -> None:
    _, dead = nodes
    prompt = types.ModelInput.from_ints(list(range(40, 60)))  # DATA[0]'s input and its last target
    logprobs = alice_on_b.create_sampling_client(model_path=dead.sampler_path).result().compute_logprobs(prompt).result()
    # None for the first token, then DATA[0]'s target logprobs. The sampler engine computes them on its
    # own fp32 code path (not the trainer's), so they agree to float rounding, not bit for bit.
    assert logprobs[0] is None
    assert [pytest.approx(value, abs=1e-5) for value in dead.logprobs_at_save[0]] == logprobs[1:]


def test_another_user_gets_404_on_the_surviving_node(nodes) -> None:
    b, dead = nodes
    with httpx.Client(base_url=b.url, headers={"X-API-Key": BOB}, timeout=60) as http:
        info = http.post("/api/v1/weights_info", json={"tinker_path": dead.state_path})
    assert (info.status_code, info.json()) == (404, {"detail": f"no checkpoint {dead.state_path}"})
    bob = tinker.ServiceClient(base_url=b.url, api_key=BOB)
    try:
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(dead.state_path).result()
    finally:
        bob.close("success").result()
