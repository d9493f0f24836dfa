"""The job table, driven as the API drives it: job creation and ids, seq_id order per job,
futures and their results, failures as the right errors, lookups, sessions ending, usage.

The group table, its actors, the store and the future table are real; the engines are
stand-ins (tests/actors/stand_in_node.py) that note what ran, in which order.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from openrld import ids
from openrld.actors.checkpoints import MAX_TTL_S, MIN_TTL_S
from openrld.actors.futures import Failed
from openrld.actors.job_registry import session_of
from openrld.actors.jobs import HomeJob, JobInfo
from openrld.actors.trainer import Created, Loaded, Saved
from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, ProvenanceSpan, TrainDatum
from openrld.errors import BadRequest, Conflict, Gone, NotFound, NotSupportedYet
from tests.actors.stand_in_node import (
    ALIAS,
    BROKEN_LOSS,
    LOST_DETAIL,
    LOST_LOSS,
    MAX_LORA_RANK,
    MODEL,
    OTHER_MODEL,
    OWNER,
    REFUSED_LOSS,
    SETTLE_S,
    SPEC,
    Node,
    batch,
    open_node,
    running_node,
    sample_job,
)
from tests.waits import wait_until

FULL = {"openrl.fine_tuning_type": "full"}


@pytest.fixture
async def node(tmp_path):
    async with running_node(tmp_path) as running:
        yield running


# ---------------------------------------------------------------- creating a job


async def test_a_model_id_is_its_session_id_then_train_then_its_model_seq_id(node: Node):
    session_id = await node.session()
    _, model_id = node.create_model(session_id, seq=3)
    assert model_id == f"{session_id}:train:3"


async def test_a_created_lora_job_adds_its_adapter_on_the_base_models_shared_trainer(node: Node):
    session_id = await node.session()
    request_id, model_id = node.create_model(session_id)
    assert await node.completed(request_id) == Created(model_id=model_id)
    assert node.engines.trainer_of(f"{MODEL} trainer").calls == [("add_adapter", model_id, SPEC, "adamw")]


async def test_two_lora_jobs_on_one_base_model_share_one_trainer_and_one_sampler(node: Node):
    first = await node.new_model()
    second = await node.new_model()
    assert [t.label for t in node.engines.trainers] == [f"{MODEL} trainer"]
    assert [s.label for s in node.engines.samplers] == [f"{MODEL} sampler"]
    assert sorted(node.engines.trainers[0].adapters) == sorted([first, second])


async def test_a_retried_create_model_answers_with_the_first_request(node: Node):
    session_id = await node.session()
    first = node.create_model(session_id)
    assert node.create_model(session_id) == first
    await node.completed(first[0])
    assert node.create_model(session_id) == first


async def test_a_created_model_on_a_known_run_that_is_not_resident_is_409(node: Node):
    session_id = await node.session()
    model_id = ids.model_id(session_id, 0)
    node.store.runs.create(  # the run of a job from before a restart
        model_id, session_id=session_id, owner=OWNER, base_model=MODEL, model_dir="/m", lora={"rank": 2},
        settings={}, user_metadata={}, optimizer_config={},
    )
    with pytest.raises(Conflict) as caught:
        node.create_model(session_id)
    assert caught.value.detail == f"model {model_id} already exists"


async def test_a_model_in_another_users_session_is_404(node: Node):
    session_id = await node.session("bob")
    with pytest.raises(NotFound) as caught:
        node.create_model(session_id)
    assert caught.value.detail == f"no session {session_id!r}"


async def test_a_lora_job_without_a_lora_config_is_400(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.create_model(session_id, lora=None)
    assert caught.value.detail == "create_model needs lora_config for a LoRA job (or openrl.fine_tuning_type=full)"


async def test_a_lora_rank_over_the_nodes_max_is_400_with_the_range(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.create_model(session_id, lora=LoraSpec(rank=MAX_LORA_RANK + 1))
    assert caught.value.detail == f"lora_config.rank: expected 1..{MAX_LORA_RANK}, got {MAX_LORA_RANK + 1}"
    assert not node.jobs.is_running(ids.model_id(session_id, 0))


async def test_an_unknown_openrl_key_in_the_models_metadata_is_400_naming_it(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.create_model(session_id, user_metadata={"openrl.no_such_key": "1"})
    assert caught.value.key == "openrl.no_such_key"


async def test_a_base_model_the_node_does_not_serve_is_400_and_no_run_is_recorded(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.jobs.create_model(
            OWNER, session_id=session_id, model_seq_id=0, base_model="no-such-model", lora=SPEC, user_metadata={},
            optimizer_config={},
        )
    assert caught.value.detail.startswith(
        f"base_model 'no-such-model' is not served by this node: it is not in the node's [models] table "
        f"({MODEL}, {ALIAS}, {OTHER_MODEL}),"
    )
    assert node.store.runs.get(ids.model_id(session_id, 0)) is None


async def test_automodel_on_a_node_without_its_environment_is_400_naming_the_key(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.create_model(session_id, user_metadata={"openrl.trainer_backend": "automodel"})
    assert caught.value.key == "openrl.trainer_backend"
    assert node.store.runs.get(ids.model_id(session_id, 0)) is None


async def test_an_architecture_no_engine_of_the_job_holds_is_400_before_any_group_is_built(node: Node, tmp_path):
    directory = tmp_path / "t5"
    directory.mkdir()
    (directory / "config.json").write_text('{"architectures": ["T5ForConditionalGeneration"]}')
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.jobs.create_model(
            OWNER, session_id=session_id, model_seq_id=0, base_model=str(directory), lora=SPEC, user_metadata={},
            optimizer_config={},
        )
    # The wording is model_families' (tests/test_model_families.py); here: refused by key, nothing built.
    assert (caught.value.key, caught.value.detail.split(":")[0]) == (
        "base_model", f"base_model {str(directory)!r} (T5ForConditionalGeneration, T5ForConditionalGeneration)"
    )
    assert (node.engines.trainers, node.store.runs.get(ids.model_id(session_id, 0))) == ([], None)


async def test_a_full_fine_tuning_job_gets_a_trainer_and_sampler_of_its_own_with_no_adapter(node: Node):
    lora_job = await node.new_model()
    full_job = await node.new_model(user_metadata=FULL)
    assert [t.label for t in node.engines.trainers] == [f"{MODEL} trainer", f"{MODEL}/{full_job} full trainer"]
    assert [s.label for s in node.engines.samplers] == [f"{MODEL} sampler", f"{MODEL}/{full_job} full sampler"]
    assert node.engines.trainers[0].adapters == {lora_job: SPEC}
    assert node.engines.trainers[1].adapters == {full_job: None}


async def test_a_full_fine_tuning_job_is_refused_dimuon_naming_optimizer_config(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.create_model(session_id, user_metadata=FULL, optimizer_config={"type": "dimuon"})
    assert caught.value.key == "optimizer_config"


async def test_sampler_replicas_run_on_the_jobs_group_before_create_model_answers(node: Node):
    await node.new_model(user_metadata={"openrl.sampler_replicas": "3"})
    assert [s.label for s in node.engines.samplers] == [f"{MODEL} sampler"] * 3


async def test_a_group_that_cannot_start_fails_create_model_with_a_500_naming_the_error(node: Node):
    node.engines.failing_builds = 1
    session_id = await node.session()
    request_id, model_id = node.create_model(session_id)
    assert await node.failed(request_id) == Failed(
        f"could not load base model {MODEL!r}: no config.json in the model directory", "server"
    )
    status = node.jobs.model_status(OWNER, model_id)
    assert (status.state.value, status.last_error) == ("failed", "OSError: no config.json in the model directory")


async def test_a_clustered_nodes_request_ids_carry_its_node_tag(tmp_path):
    tag = ids.node_tag("node-a")
    async with running_node(tmp_path, id_tag=tag) as node:
        session_id = await node.session()
        request_id, _ = node.create_model(session_id)
        assert (session_id.startswith(f"s-{tag}"), request_id.startswith(f"r-{tag}")) == (True, True)
        await node.completed(request_id)


# ---------------------------------------------------------------- seq_id order and futures


async def test_a_jobs_ops_run_in_seq_id_order_whatever_order_they_arrive_in(node: Node):
    model_id = await node.new_model()
    # Arrival order 3, 2, 1, as the SDK's concurrent chunks of one call arrive (the first one last).
    optim = node.jobs.optim_step(OWNER, model_id, 3, AdamParams(learning_rate=0.5))
    second = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    first = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    for request_id in (optim, second, first):
        await node.completed(request_id)
    trainer = node.engines.trainer_of(f"{MODEL} trainer")
    assert trainer.passes == [[10], [20]]
    assert trainer.calls[1:] == [("optim_step", model_id, 0.5)]


async def test_an_op_waits_for_its_missing_predecessor_and_the_job_does_not_deadlock(node: Node):
    model_id = await node.new_model()
    later = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    assert await node.futures.wait(later, owner=OWNER, hold_s=0.2) is None  # seq_id 1 has not come
    earlier = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    await node.completed(later)
    await node.completed(earlier)
    assert node.engines.trainer_of(f"{MODEL} trainer").passes == [[10], [20]]


async def test_a_retried_seq_id_answers_with_the_first_future_and_runs_once(node: Node):
    model_id = await node.new_model()
    first = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    retry = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    await node.completed(first)
    assert (retry, node.engines.trainer_of(f"{MODEL} trainer").passes) == (first, [[10]])


async def test_a_forward_backward_future_holds_the_engines_result_for_that_batch(node: Node):
    model_id = await node.new_model()
    result = await node.completed(node.jobs.forward_backward(OWNER, model_id, 1, batch(3, 4)))
    assert result.metrics == {"loss:sum": 7.0}
    assert [logprobs.tolist() for logprobs in result.logprobs] == [[-1.0, -1.0], [-1.0, -1.0]]


async def test_a_forward_only_request_is_a_forward_and_a_training_one_a_forward_backward(node: Node):
    model_id = await node.new_model()
    forward = node.jobs.forward_backward(OWNER, model_id, 1, batch(10, forward_only=True))
    training = node.jobs.forward_backward(OWNER, model_id, 2, batch(10))
    assert (node.futures.kind_of(forward), node.futures.kind_of(training)) == ("forward", "forward_backward")


async def test_an_optim_step_future_holds_the_engines_metrics(node: Node):
    model_id = await node.new_model()
    result = await node.completed(node.jobs.optim_step(OWNER, model_id, 1, AdamParams(learning_rate=0.25)))
    assert result.metrics == {"learning_rate:mean": 0.25}


async def test_ops_on_a_model_still_loading_are_409(node: Node):
    session_id = await node.session()
    request_id, model_id = node.create_model(session_id)  # its group starts in a task of its own
    with pytest.raises(Conflict) as caught:
        node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    assert caught.value.detail == f"model {model_id} is still loading; wait for create_model to finish"
    await node.completed(request_id)


# ---------------------------------------------------------------- failures


async def test_an_engine_refusal_fails_that_request_as_a_user_error_and_the_next_seq_id_runs(node: Node):
    model_id = await node.new_model()
    refused = node.jobs.forward_backward(OWNER, model_id, 1, batch(10, loss_fn=REFUSED_LOSS))
    after = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    assert await node.failed(refused) == Failed(f"loss_fn {REFUSED_LOSS!r} is not one this engine knows", "user")
    assert (await node.completed(after)).metrics == {"loss:sum": 20.0}


async def test_an_unexpected_engine_error_is_a_server_error_naming_its_type(node: Node):
    model_id = await node.new_model()
    broken = node.jobs.forward_backward(OWNER, model_id, 1, batch(10, loss_fn=BROKEN_LOSS))
    assert await node.failed(broken) == Failed("ValueError: the engine broke", "server")


async def test_a_rejected_body_fails_its_future_in_its_seq_id_turn_and_frees_the_seq_id(node: Node):
    model_id = await node.new_model()
    after = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    rejected = node.jobs.reject(OWNER, model_id, 1, "forward_backward", BadRequest("target_tokens: expected 2, got 3"))
    assert await node.failed(rejected) == Failed("target_tokens: expected 2, got 3", "user")
    await node.completed(after)
    assert node.engines.trainer_of(f"{MODEL} trainer").passes == [[20]]


async def test_a_stable_reinforce_batch_without_provenance_fails_its_future_not_the_call(node: Node):
    model_id = await node.new_model()
    request_id = node.jobs.forward_backward(OWNER, model_id, 1, batch(10, loss_fn="stable_reinforce"))
    after = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    assert await node.failed(request_id) == Failed(
        "datum 0: stable_reinforce needs provenance on every datum (model_input_spans and loss_fn_input_spans, "
        "from a sampling client created with record_stability_info=True)",
        "user",
    )
    await node.completed(after)


def rl_datum(sequence_id: str, prompt: list[int], sampled: list[int], advantage: float) -> TrainDatum:
    """The cookbook's RL datum over one recorded sequence, with its provenance."""
    p, s = len(prompt), len(sampled)
    tokens = prompt + sampled
    return TrainDatum(
        tokens=np.array(tokens[:-1], np.int64),
        inputs={
            "target_tokens": np.array([0] * (p - 1) + sampled, np.int64),
            "advantages": np.array([0.0] * (p - 1) + [advantage] * s, np.float32),
        },
        model_input_spans=(ProvenanceSpan(sequence_id, 0, p, False), ProvenanceSpan(sequence_id, 0, s - 1, True)),
        loss_fn_input_spans=(ProvenanceSpan(sequence_id, 1, p - 1, False), ProvenanceSpan(sequence_id, 0, s, True)),
    )


async def recorded_sequence(node: Node, session_id: str, prompt: list[int]) -> str:
    """A sequence sampled in `session_id` with record_stability_info; its id."""
    sampler_id = node.sampling.create(
        OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None
    )
    request_id, (sequence_id,) = node.sampling.sample(
        OWNER, sampler_id, 0, sample_job(prompt), record_stability_info=True
    )
    await node.completed(request_id)
    return sequence_id


async def test_stable_reinforce_gets_the_samplers_recorded_logprobs_at_sampled_targets(node: Node):
    model_id = await node.new_model()
    sequence_id = await recorded_sequence(node, session_of(model_id), [5, 9])  # the stand-in samples [9, 0]
    data = [rl_datum(sequence_id, [5, 9], [9, 0], advantage=1.0)]
    stable = ForwardBackwardBatch(data=data, loss_fn="stable_reinforce", loss_config={}, forward_only=False)
    await node.completed(node.jobs.forward_backward(OWNER, model_id, 1, stable))
    (datum,) = node.engines.trainer_of(f"{MODEL} trainer").batches[-1].data
    # Targets [0, 9, 0]: the first is the prompt's (NaN), the next two the sampled tokens' logprobs.
    np.testing.assert_array_equal(datum.recorded_logprobs, np.array([np.nan, -0.5, -0.5], np.float32))


async def test_stable_reinforce_refuses_a_sequence_recorded_in_another_session(node: Node):
    model_id = await node.new_model()
    sequence_id = await recorded_sequence(node, await node.session(), [5, 9])
    data = [rl_datum(sequence_id, [5, 9], [9, 0], advantage=1.0)]
    stable = ForwardBackwardBatch(data=data, loss_fn="stable_reinforce", loss_config={}, forward_only=False)
    failed = await node.failed(node.jobs.forward_backward(OWNER, model_id, 1, stable))
    assert failed == Failed(
        f"datum 0: model_input_spans names sequence_id {sequence_id!r}, which this session has no stability record "
        "of: it was not sampled with record_stability_info=True in this session, or its record expired (one day "
        "after its last use)",
        "user",
    )


# ---------------------------------------------------------------- lookups


async def test_another_users_model_is_404_as_if_it_did_not_exist(node: Node):
    model_id = await node.new_model()
    with pytest.raises(NotFound) as caught:
        node.jobs.forward_backward("bob", model_id, 1, batch(10))
    assert caught.value.detail == f"no model {model_id!r}"


async def test_a_model_not_resident_after_a_restart_is_410_pointing_at_a_restore(node: Node, tmp_path):
    model_id = await node.new_model()
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")  # the same store, nothing resident
    with pytest.raises(Gone) as caught:
        restarted.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    assert caught.value.detail == (
        f"model {model_id} is not resident (the daemon restarted); resume it with "
        "create_training_client_from_state from its last checkpoint"
    )
    assert (restarted.jobs.is_running(model_id), restarted.jobs.has_run(model_id)) == (False, True)


async def test_job_info_gives_the_runs_base_model_tokenizer_arch_lora_and_optimizer(node: Node):
    model_id = await node.new_model(optimizer_config={"type": "adamw"})
    assert node.jobs.job_info(OWNER, model_id) == JobInfo(
        model_id=model_id, base_model=MODEL, tokenizer_id=MODEL, arch="LlamaForCausalLM", lora=SPEC,
        optimizer_config={"type": "adamw"},
    )
    with pytest.raises(NotFound):
        node.jobs.job_info("bob", model_id)


async def test_home_jobs_describe_each_resident_job_for_the_clusters_gossip(node: Node):
    lora_job = await node.new_model()
    full_job = await node.new_model(user_metadata=FULL)
    assert sorted(node.jobs.home_jobs(), key=lambda job: job.fine_tuning_type) == [
        HomeJob(full_job, OWNER, MODEL, "full", False, None),
        HomeJob(lora_job, OWNER, MODEL, "lora", False, None),
    ]


async def test_a_resident_jobs_status_counts_its_steps(node: Node):
    model_id = await node.new_model()
    await node.completed(node.jobs.optim_step(OWNER, model_id, 1, AdamParams()))
    status = node.jobs.model_status(OWNER, model_id)
    assert (status.state.value, status.step, status.fine_tuning_type, status.last_error) == ("ready", 1, "lora", None)
    with pytest.raises(NotFound):
        node.jobs.model_status("bob", model_id)
    assert node.jobs.model_status("bob", model_id, sees_all=True).model_id == model_id


@pytest.mark.parametrize("metadata", [None, FULL], ids=["lora", "full"])
async def test_a_job_whose_session_finished_still_reports_its_steps(node: Node, metadata: dict[str, str] | None):
    model_id = await node.new_model(user_metadata=metadata)
    await node.completed(node.jobs.optim_step(OWNER, model_id, 1, AdamParams()))
    node.jobs.finish_session(OWNER, session_of(model_id), "user_requested", None)
    status = node.jobs.model_status(OWNER, model_id)
    assert (status.state.value, status.waiting_for, status.step, status.workers) == ("finished", None, 1, [])


async def test_a_job_gone_with_a_restart_is_lost_and_its_status_names_its_last_checkpoint(node: Node, tmp_path):
    model_id = await node.new_model()
    path = await save(node, model_id, 1, "step-1")
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")
    status = restarted.jobs.model_status(OWNER, model_id)
    assert (status.state.value, status.last_checkpoint, status.workers) == ("lost", path, [])


# ---------------------------------------------------------------- sessions ending, lost engines


async def test_a_finished_session_ends_its_lora_and_full_jobs_and_their_later_calls_are_410(node: Node):
    session_id = await node.session()
    lora_request, lora_job = node.create_model(session_id, 0)
    full_request, full_job = node.create_model(session_id, 1, user_metadata=FULL)
    await node.completed(lora_request)
    await node.completed(full_request)
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)
    assert (node.jobs.is_running(lora_job), node.jobs.is_running(full_job)) == (False, False)
    details = []
    for model_id in (lora_job, full_job):
        with pytest.raises(Gone) as caught:
            node.jobs.optim_step(OWNER, model_id, 1, AdamParams())
        details.append(caught.value.detail)
    assert details == [f"model {m} has stopped: its session {session_id} has finished" for m in (lora_job, full_job)]


@pytest.mark.parametrize("metadata", [None, FULL], ids=["lora", "full"])
async def test_a_finished_sessions_job_fails_the_ops_it_still_held(node: Node, metadata: dict[str, str] | None):
    session_id = await node.session()
    request_id, model_id = node.create_model(session_id, user_metadata=metadata)
    await node.completed(request_id)
    waiting = node.jobs.forward_backward(OWNER, model_id, 2, batch(20))  # seq_id 1 never comes
    await trio.testing.wait_all_tasks_blocked()  # the trainer has queued it
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)
    assert await node.failed(waiting) == Failed(
        f"model {model_id} has stopped: its session {session_id} has finished (user_requested)", "user"
    )


async def test_a_full_job_whose_session_finishes_while_it_is_created_fails_its_create_and_starts_no_group(
    node: Node,
):
    session_id = await node.session()
    request_id, model_id = node.create_model(session_id, user_metadata=FULL)
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)  # before its group has started
    assert await node.failed(request_id) == Failed(
        f"model {model_id} has stopped: its session {session_id} has finished", "user"
    )
    await trio.testing.wait_all_tasks_blocked()
    assert (node.groups.all_groups(), node.engines.trainers) == ([], [])


async def test_a_model_in_a_finished_session_is_410_and_no_group_starts_for_it(node: Node):
    session_id = await node.session()
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)
    with pytest.raises(Gone) as caught:
        node.create_model(session_id, user_metadata=FULL)
    assert caught.value.detail == f"session {session_id} has finished"
    with pytest.raises(Gone, match=f"^session {session_id} has finished$"):
        node.jobs.load_into_new_model(
            OWNER, session_id=session_id, model_seq_id=1, path="tinker://s-x:train:0/weights/a", with_optimizer=False,
            optimizer_config=None,
        )
    await trio.testing.wait_all_tasks_blocked()
    assert (node.groups.all_groups(), node.store.runs.get(ids.model_id(session_id, 0))) == ([], None)


async def test_a_create_model_retried_after_its_session_finished_is_410_as_its_job_ended_with_it(node: Node):
    session_id = await node.session()
    first = node.create_model(session_id)
    await node.completed(first[0])
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)
    with pytest.raises(Gone) as caught:
        node.create_model(session_id)
    assert caught.value.detail == f"session {session_id} has finished"


async def test_finishing_another_users_session_is_404(node: Node):
    session_id = await node.session()
    with pytest.raises(NotFound):
        node.jobs.finish_session("bob", session_id, "user_requested", None)
    assert node.sessions.is_finished(session_id) is False


async def test_a_job_whose_own_groups_trainer_is_lost_is_over_and_its_later_calls_are_410_with_the_cause(node: Node):
    model_id = await node.new_model(user_metadata={"openrl.exclusive": "true"})
    lost = node.jobs.forward_backward(OWNER, model_id, 1, batch(10, loss_fn=LOST_LOSS))
    assert await node.failed(lost) == Failed(LOST_DETAIL, "server")
    await wait_until(lambda: not node.jobs.is_running(model_id), within_s=SETTLE_S, poll_s=0.01)
    with pytest.raises(Gone) as caught:
        node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    assert caught.value.detail == f"{LOST_DETAIL}; it saved no checkpoint"
    assert len(node.engines.trainers) == 1  # not rebuilt: the job is over


async def test_a_lost_jobs_410_names_its_last_checkpoint_to_resume_from(node: Node):
    model_id = await node.new_model(user_metadata={"openrl.exclusive": "true"})
    await save(node, model_id, 1, "first")
    last = await save(node, model_id, 2, "second")
    await node.failed(node.jobs.forward_backward(OWNER, model_id, 3, batch(10, loss_fn=LOST_LOSS)))
    await wait_until(lambda: not node.jobs.is_running(model_id), within_s=SETTLE_S, poll_s=0.01)
    with pytest.raises(Gone) as caught:
        node.jobs.forward_backward(OWNER, model_id, 4, batch(20))
    assert caught.value.detail == f"{LOST_DETAIL}; its last checkpoint is {last}"


async def test_a_lora_job_whose_trainer_is_lost_stays_resident_on_a_rebuilt_trainer(node: Node):
    model_id = await node.new_model()
    await node.failed(node.jobs.forward_backward(OWNER, model_id, 1, batch(10, loss_fn=LOST_LOSS)))
    await wait_until(lambda: len(node.engines.trainers) == 2, within_s=SETTLE_S, poll_s=0.01)
    assert (node.jobs.is_running(model_id), node.engines.trainers[1].label) == (True, f"{MODEL} trainer")
    # Its adapter went with the lost engine: its ops fail with the loss until it loads a state.
    assert await node.failed(node.jobs.optim_step(OWNER, model_id, 2, AdamParams())) == Failed(LOST_DETAIL, "server")


# ---------------------------------------------------------------- usage


async def test_training_tokens_are_counted_once_per_seq_id_a_retry_adds_none(node: Node):
    model_id = await node.new_model()
    node.jobs.forward_backward(OWNER, model_id, 1, batch(10, 20))  # two datums of two tokens
    node.jobs.forward_backward(OWNER, model_id, 1, batch(10, 20))
    node.jobs.forward_backward(OWNER, model_id, 2, batch(30, forward_only=True))
    assert node.usage_rows() == [(session_of(model_id), "training", 6)]  # 2 * 2 tokens, then 1 * 2


# ---------------------------------------------------------------- saving and loading


async def save(node: Node, model_id: str, seq_id: int, name: str) -> str:
    """save_weights as `name`; the checkpoint's tinker:// path."""
    saved = await node.completed(
        node.jobs.save_weights(OWNER, model_id, seq_id, name=name, overwrite=False, ttl_seconds=None, user_metadata={})
    )
    return saved.path


async def test_save_weights_answers_with_the_checkpoints_tinker_path(node: Node):
    model_id = await node.new_model()
    assert await save(node, model_id, 1, "step-1") == f"tinker://{model_id}/weights/step-1"


async def test_a_checkpoint_name_that_could_leave_the_data_dir_is_400(node: Node):
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.save_weights(OWNER, model_id, 1, name="../x", overwrite=False, ttl_seconds=None, user_metadata={})
    assert caught.value.detail == "checkpoint name: must not contain '/' or '\\', got '../x'"


async def test_a_ttl_under_the_minimum_is_400_before_anything_is_written(node: Node):
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.save_weights(OWNER, model_id, 1, name="a", overwrite=False, ttl_seconds=0, user_metadata={})
    assert caught.value.detail == f"ttl_seconds: expected {MIN_TTL_S}..{MAX_TTL_S}, got 0"


async def test_a_new_model_from_a_checkpoint_loads_its_state_on_the_base_models_trainer(node: Node):
    source = await node.new_model()
    path = await save(node, source, 1, "step-1")
    session_id = await node.session()
    request_id, model_id = node.jobs.load_into_new_model(
        OWNER, session_id=session_id, model_seq_id=0, path=path, with_optimizer=True, optimizer_config=None
    )
    assert await node.completed(request_id) == Loaded(model_id=model_id, path=path)
    trainer = node.engines.trainer_of(f"{MODEL} trainer")
    assert trainer.calls[-1] == ("load_state", model_id, f"{source} state", True)
    assert node.jobs.job_info(OWNER, model_id).lora == SPEC  # the checkpoint's


async def test_a_new_model_with_optimizer_state_from_a_sampler_checkpoint_is_400(node: Node):
    source = await node.new_model()
    saved = await node.completed(
        node.jobs.save_weights_for_sampler(
            OWNER, source, 1, name="for-sampling", sampling_session_seq_id=None, kind="snapshot", ttl_seconds=None,
            user_metadata={},
        )
    )
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.jobs.load_into_new_model(
            OWNER, session_id=session_id, model_seq_id=0, path=saved.path, with_optimizer=True, optimizer_config=None
        )
    assert caught.value.detail == (
        f"{saved.path}: checkpoint has no optimizer state; load a weights/ path or pass optimizer=false"
    )


async def test_another_users_checkpoint_is_404_to_load(node: Node):
    path = await save(node, await node.new_model(), 1, "step-1")
    session_id = await node.session("bob")
    with pytest.raises(NotFound) as caught:
        node.jobs.load_into_new_model(
            "bob", session_id=session_id, model_seq_id=0, path=path, with_optimizer=False, optimizer_config=None
        )
    assert caught.value.detail == f"no checkpoint {path}"


async def test_load_weights_in_place_runs_in_its_seq_id_turn(node: Node):
    model_id = await node.new_model()
    path = await save(node, model_id, 1, "step-1")
    loaded = node.jobs.load_weights(OWNER, model_id, 3, path=path, with_optimizer=False)
    node.jobs.forward_backward(OWNER, model_id, 2, batch(20))
    assert await node.completed(loaded) == Loaded(model_id=model_id, path=path)
    trainer = node.engines.trainer_of(f"{MODEL} trainer")
    assert (trainer.passes, trainer.calls[-1]) == ([[20]], ("load_state", model_id, f"{model_id} state", False))


async def test_load_weights_of_another_lora_shape_is_400_naming_both(node: Node):
    path = await save(node, await node.new_model(lora=LoraSpec(rank=4)), 1, "rank-4")
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.load_weights(OWNER, model_id, 1, path=path, with_optimizer=False)
    assert caught.value.detail == (
        f"{path}: its LoRA config {LoraSpec(rank=4)} differs from model {model_id}'s LoRA config {SPEC}"
    )


async def test_load_weights_with_optimizer_state_of_another_family_is_400_naming_optimizer(node: Node):
    path = await save(node, await node.new_model(optimizer_config={"type": "dimuon"}), 1, "dimuon")
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.load_weights(OWNER, model_id, 1, path=path, with_optimizer=True)
    assert (caught.value.key, caught.value.detail) == (
        "optimizer",
        f"{path}: its optimizer state is 'dimuon'; model {model_id} uses 'adamw' (load it with optimizer=false, "
        "or into a new model)",
    )


async def test_unnamed_sampler_weights_become_the_sampling_session_the_client_named(node: Node):
    model_id = await node.new_model()
    saved = await node.completed(
        node.jobs.save_weights_for_sampler(
            OWNER, model_id, 1, name=None, sampling_session_seq_id=5, kind="snapshot", ttl_seconds=None,
            user_metadata={},
        )
    )
    sampler_id = f"{session_of(model_id)}:sample:5"
    assert saved == Saved(sampling_session_id=sampler_id)
    assert node.sampling.info(OWNER, sampler_id).base_model == MODEL


@pytest.mark.parametrize(
    ("kwargs", "detail"),
    [
        ({"kind": "later"}, "kind: expected 'snapshot' or 'inflight', got 'later'"),
        ({"kind": "snapshot"}, "save_weights_for_sampler needs a path or a sampling_session_seq_id"),
    ],
    ids=["unknown-kind", "neither-name-nor-session"],
)
async def test_save_weights_for_sampler_refuses_with_400(node: Node, kwargs, detail):
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.save_weights_for_sampler(
            OWNER, model_id, 1, name=None, sampling_session_seq_id=None, ttl_seconds=None, user_metadata={}, **kwargs
        )
    assert caught.value.detail == detail


async def test_a_full_job_refuses_inflight_sampler_weights_and_external_weights_as_not_supported_yet(node: Node):
    model_id = await node.new_model(user_metadata=FULL)
    with pytest.raises(NotSupportedYet) as inflight:
        node.jobs.save_weights_for_sampler(
            OWNER, model_id, 1, name=None, sampling_session_seq_id=0, kind="inflight", ttl_seconds=None,
            user_metadata={},
        )
    assert inflight.value.detail == "save_weights_for_sampler kind='inflight' is not supported yet for full fine-tuning"
    with pytest.raises(NotSupportedYet) as external:
        node.jobs.save_weights_external(OWNER, model_id, 1, name="peft", ttl_seconds=None)
    assert external.value.detail.startswith("save_weights_external is not supported yet for full fine-tuning; ")


async def test_external_weights_are_written_under_their_own_kind(node: Node):
    model_id = await node.new_model()
    saved = await node.completed(node.jobs.save_weights_external(OWNER, model_id, 1, name="peft", ttl_seconds=None))
    assert saved == Saved(path=f"tinker://{model_id}/external_weights/peft")


async def test_load_weights_trained_on_another_base_model_is_400_naming_both(node: Node):
    path = await save(node, await node.new_model(base_model=OTHER_MODEL), 1, "other")
    model_id = await node.new_model()
    with pytest.raises(BadRequest) as caught:
        node.jobs.load_weights(OWNER, model_id, 1, path=path, with_optimizer=False)
    assert caught.value.detail == (
        f"{path}: it was trained on {OTHER_MODEL!r}; model {model_id} is {MODEL!r} (load it into a new model of "
        "its base model)"
    )


async def test_load_weights_trained_on_another_name_of_the_same_base_model_loads(node: Node):
    path = await save(node, await node.new_model(base_model=ALIAS), 1, "alias")
    model_id = await node.new_model()
    loaded = node.jobs.load_weights(OWNER, model_id, 1, path=path, with_optimizer=False)
    assert await node.completed(loaded) == Loaded(model_id=model_id, path=path)
