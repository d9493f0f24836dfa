"""Sampling sessions, driven as the API drives them: creation and ids, which sampler and which
weights serve each session, seq_id memory, limits, restarts, cancels and usage.

The group table, its actors, the store and the future table are real; the engines are
stand-ins (tests/actors/stand_in_node.py) that note which request reached which sampler
with which weights version.
"""

from __future__ import annotations

import threading

import pytest
import trio.testing

from openrld.actors.futures import Completed, Failed
from openrld.actors.job_registry import session_of
from openrld.actors.sampling_sessions import SamplerInfo
from openrld.errors import BadRequest, Gone, NotFound, TooManyRequests
from tests.actors.stand_in_node import (
    MAX_CONTEXT,
    MODEL,
    OWNER,
    SETTLE_S,
    Node,
    batch,
    open_node,
    running_node,
    sample_job,
)
from tests.waits import wait_until


@pytest.fixture
async def node(tmp_path):
    async with running_node(tmp_path) as running:
        yield running


async def base_session(node: Node, owner: str = OWNER, seq: int = 0) -> str:
    session_id = await node.session(owner)
    return node.sampling.create(owner, session_id=session_id, sampling_session_seq_id=seq, base_model=MODEL, model_path=None)


async def sampled_tokens(node: Node, request_id: str) -> list[list[int]]:
    result = await node.completed(request_id)
    return [sequence.tokens.tolist() for sequence in result.sequences]


async def saved_for_sampler(node: Node, *, name: str | None, seq: int = 0, **create: object) -> tuple[str, object]:
    """A new job that saved its weights for sampling: (its model id, what the save answered)."""
    model_id = await node.new_model(**create)
    saved = await node.completed(
        node.jobs.save_weights_for_sampler(
            OWNER, model_id, 1, name=name, sampling_session_seq_id=None if name is not None else seq,
            kind="snapshot", ttl_seconds=None, user_metadata={},
        )
    )
    return model_id, saved


# ---------------------------------------------------------------- creating a session


async def test_a_sampling_session_id_is_its_session_id_then_sample_then_its_seq_id(node: Node):
    session_id = await node.session()
    sampler_id = node.sampling.create(
        OWNER, session_id=session_id, sampling_session_seq_id=2, base_model=MODEL, model_path=None
    )
    assert sampler_id == f"{session_id}:sample:2"
    assert node.sampling.info(OWNER, sampler_id) == SamplerInfo(sampler_id=sampler_id, base_model=MODEL, model_path=None)


async def test_a_retried_create_answers_with_the_same_session(node: Node):
    session_id = await node.session()
    first = node.sampling.create(OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None)
    again = node.sampling.create(OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None)
    assert again == first


async def test_creating_a_session_loads_its_group_before_the_first_sample(node: Node):
    await base_session(node)
    await wait_until(lambda: node.groups.all_groups() != [], within_s=SETTLE_S, poll_s=0.01)
    assert [s.label for s in node.engines.samplers] == [f"{MODEL} sampler"]


async def test_a_session_needs_a_base_model_or_a_model_path(node: Node):
    session_id = await node.session()
    with pytest.raises(BadRequest) as caught:
        node.sampling.create(OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=None, model_path=None)
    assert caught.value.detail == "create_sampling_session needs base_model or model_path"


async def test_a_sampling_session_in_another_users_session_is_404(node: Node):
    session_id = await node.session("bob")
    with pytest.raises(NotFound) as caught:
        node.sampling.create(OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=MODEL, model_path=None)
    assert caught.value.detail == f"no session {session_id!r}"


async def test_another_users_sampling_session_is_404_as_if_it_did_not_exist(node: Node):
    sampler_id = await base_session(node)
    with pytest.raises(NotFound) as caught:
        node.sampling.sample("bob", sampler_id, 0, sample_job([5]))
    assert caught.value.detail == f"no sampling session {sampler_id!r}"
    with pytest.raises(NotFound):
        node.sampling.info("bob", sampler_id)


# ---------------------------------------------------------------- which sampler, which weights


async def test_a_base_model_session_samples_the_base_weights_on_the_lora_groups_sampler(node: Node):
    sampler_id = await base_session(node)
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5, 9]))
    assert await sampled_tokens(node, request_id) == [[9, 0]]
    assert node.engines.sampler_of(f"{MODEL} sampler").added == [(request_id, None)]


async def test_a_sample_names_one_sequence_id_per_sample_after_its_session_and_seq_id(node: Node):
    sampler_id = await base_session(node)
    request_id, sequence_ids = node.sampling.sample(OWNER, sampler_id, 4, sample_job([5], num_samples=3))
    assert sequence_ids == [f"{sampler_id}:4:0", f"{sampler_id}:4:1", f"{sampler_id}:4:2"]
    assert await sampled_tokens(node, request_id) == [[5, 0], [5, 1], [5, 2]]


async def test_unnamed_weights_saved_for_a_session_are_the_version_it_samples(node: Node):
    model_id, saved = await saved_for_sampler(node, name=None, seq=3)
    sampler_id = saved.sampling_session_id
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await node.completed(request_id)
    sampler = node.engines.sampler_of(f"{MODEL} sampler")
    assert sampler.added == [(request_id, sampler_id)]
    assert sampler.versions[sampler_id] == f"{model_id} weights as {sampler_id}"  # the trainer's payload


async def test_a_checkpoint_session_samples_the_checkpoint_read_from_its_directory(node: Node):
    model_id, saved = await saved_for_sampler(node, name="for-sampling")
    session_id = await node.session()
    sampler_id = node.sampling.create(
        OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=None, model_path=saved.path
    )
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await node.completed(request_id)
    sampler = node.engines.sampler_of(f"{MODEL} sampler")
    assert sampler.added == [(request_id, saved.path)]
    assert sampler.versions[saved.path] == f"{model_id} for sampling"  # what the trainer wrote there
    assert node.sampling.info(OWNER, sampler_id).model_path == saved.path


async def test_a_full_runs_unnamed_weights_sample_on_that_runs_own_sampler(node: Node):
    model_id, saved = await saved_for_sampler(node, name=None, user_metadata={"openrl.fine_tuning_type": "full"})
    request_id, _ = node.sampling.sample(OWNER, saved.sampling_session_id, 0, sample_job([5]))
    await node.completed(request_id)
    assert node.engines.sampler_of(f"{MODEL}/{model_id} full sampler").added == [
        (request_id, saved.sampling_session_id)
    ]


async def test_a_checkpoint_of_another_user_is_404_to_sample(node: Node):
    _, saved = await saved_for_sampler(node, name="for-sampling")
    session_id = await node.session("bob")
    with pytest.raises(NotFound) as caught:
        node.sampling.create("bob", session_id=session_id, sampling_session_seq_id=0, base_model=None, model_path=saved.path)
    assert caught.value.detail == f"no checkpoint {saved.path}"


# ---------------------------------------------------------------- seq_id memory, limits, failures


async def test_a_retried_seq_id_answers_with_the_first_request_and_sequence_ids(node: Node):
    sampler_id = await base_session(node)
    first = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5], num_samples=2))
    assert node.sampling.sample(OWNER, sampler_id, 0, sample_job([5], num_samples=2)) == first
    await node.completed(first[0])
    assert node.engines.sampler_of(f"{MODEL} sampler").added == [(first[0], None)]


async def test_a_prompt_as_long_as_the_context_is_400_naming_both_lengths(node: Node):
    sampler_id = await base_session(node)
    with pytest.raises(BadRequest) as caught:
        node.sampling.sample(OWNER, sampler_id, 0, sample_job(list(range(MAX_CONTEXT))))
    assert caught.value.detail == f"prompt has {MAX_CONTEXT} tokens; the model's context is {MAX_CONTEXT}"


async def test_a_sample_past_the_sampler_queue_limit_is_429_and_its_seq_id_can_be_sent_again(tmp_path):
    async with running_node(tmp_path, sample_queue_limit=1) as node:
        sampler_id = await base_session(node)
        await wait_until(lambda: node.groups.all_groups() != [], within_s=SETTLE_S, poll_s=0.01)
        gate = node.engines.samplers[0].gate = threading.Event()  # the first sample holds the engine
        first, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
        with pytest.raises(TooManyRequests) as caught:
            node.sampling.sample(OWNER, sampler_id, 1, sample_job([6]))
        assert caught.value.detail == "sampler queue is full (1 requests); retry shortly"
        gate.set()
        await node.completed(first)
        # The refused seq_id was not remembered: sent again once there is room, it runs.
        await node.completed(node.sampling.sample(OWNER, sampler_id, 1, sample_job([6]))[0])


async def test_a_first_sample_starts_the_group_itself_when_none_runs(node: Node, tmp_path):
    sampler_id = await base_session(node)
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")  # no group runs there
    request_id, _ = restarted.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    assert await sampled_tokens(restarted, request_id) == [[5, 0]]


async def test_a_group_that_cannot_start_fails_the_sample_with_a_500(node: Node, tmp_path):
    sampler_id = await base_session(node)
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")  # the sample starts the group
    restarted.engines.failing_builds = 1
    request_id, _ = restarted.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    assert await restarted.failed(request_id) == Failed(
        f"could not load base model {MODEL!r}: no config.json in the model directory", "server"
    )


# ---------------------------------------------------------------- restarts and ended jobs


async def test_a_base_model_session_is_served_again_after_a_restart(node: Node, tmp_path):
    sampler_id = await base_session(node)
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")
    assert restarted.sampling.is_home_to(sampler_id) is True
    request_id, _ = restarted.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await restarted.completed(request_id)


async def test_unnamed_weights_are_410_after_a_restart(node: Node, tmp_path):
    _, saved = await saved_for_sampler(node, name=None)
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")
    with pytest.raises(Gone) as caught:
        restarted.sampling.sample(OWNER, saved.sampling_session_id, 0, sample_job([5]))
    assert caught.value.detail == (
        f"sampling session {saved.sampling_session_id} held unnamed weights lost in a restart; save them again"
    )


@pytest.mark.parametrize("metadata", [{}, {"openrl.fine_tuning_type": "full"}], ids=["lora", "full"])
async def test_a_jobs_unnamed_weights_are_410_once_its_session_finished(node: Node, metadata: dict[str, str]):
    model_id, saved = await saved_for_sampler(node, name=None, user_metadata=metadata)
    session_id = session_of(model_id)
    node.jobs.finish_session(OWNER, session_id, "user_requested", None)
    with pytest.raises(Gone) as caught:
        node.sampling.sample(OWNER, saved.sampling_session_id, 0, sample_job([5]))
    assert caught.value.detail == (
        f"sampling session {saved.sampling_session_id} held unnamed weights of model {model_id}, which stopped "
        f"when its session {session_id} finished"
    )



async def test_a_finished_lora_job_leaves_the_shared_trainer_and_sampler_and_its_path_still_samples(node: Node):
    ended, unnamed = await saved_for_sampler(node, name=None)
    named = await node.completed(
        node.jobs.save_weights_for_sampler(
            OWNER, ended, 2, name="final", sampling_session_seq_id=None, kind="snapshot", ttl_seconds=None,
            user_metadata={},
        )
    )
    kept, kept_unnamed = await saved_for_sampler(node, name=None)
    other_session = session_of(kept)
    by_path = node.sampling.create(
        OWNER, session_id=other_session, sampling_session_seq_id=5, base_model=None, model_path=named.path
    )
    for sampler_id in (unnamed.sampling_session_id, by_path, kept_unnamed.sampling_session_id):
        await node.completed(node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))[0])
    trainer, sampler = node.engines.trainer_of(f"{MODEL} trainer"), node.engines.sampler_of(f"{MODEL} sampler")
    assert sorted(sampler.versions) == sorted([unnamed.sampling_session_id, named.path, kept_unnamed.sampling_session_id])
    node.jobs.finish_session(OWNER, session_of(ended), "user_requested", None)
    await wait_until(lambda: list(trainer.adapters) == [kept], within_s=SETTLE_S, poll_s=0.01)
    await wait_until(lambda: list(sampler.versions) == [kept_unnamed.sampling_session_id], within_s=SETTLE_S, poll_s=0.01)
    (group,) = node.groups.all_groups()
    assert (group.trainer.statistics().adapters_loaded, group.sampler.statistics().host_versions) == (1, 1)
    # The checkpoint's version loads again from its files for the client made from its path.
    assert await sampled_tokens(node, node.sampling.sample(OWNER, by_path, 1, sample_job([5]))[0]) == [[5, 0]]
    assert sorted(sampler.versions) == sorted([kept_unnamed.sampling_session_id, named.path])


async def test_a_sample_running_on_a_finished_jobs_weights_keeps_them_until_it_is_done(node: Node):
    model_id, saved = await saved_for_sampler(node, name=None)
    await wait_until(lambda: node.groups.all_groups() != [], within_s=SETTLE_S, poll_s=0.01)
    sampler = node.engines.sampler_of(f"{MODEL} sampler")
    gate = sampler.gate = threading.Event()
    sampler.unfinished_steps = 1  # the request runs over two steps; the job ends during the first
    request_id, _ = node.sampling.sample(OWNER, saved.sampling_session_id, 0, sample_job([7]))
    await wait_until(lambda: sampler.added != [], within_s=SETTLE_S, poll_s=0.01)  # in the engine, its step held
    node.jobs.finish_session(OWNER, session_of(model_id), "user_requested", None)
    await trio.testing.wait_all_tasks_blocked()
    assert list(sampler.versions) == [saved.sampling_session_id]
    gate.set()
    assert await sampled_tokens(node, request_id) == [[7, 0]]
    await wait_until(lambda: sampler.versions == {}, within_s=SETTLE_S, poll_s=0.01)


# ---------------------------------------------------------------- cancel_future


async def test_cancelling_a_running_sample_fails_its_future_as_cancelled_by_the_client(node: Node):
    sampler_id = await base_session(node)
    await wait_until(lambda: node.groups.all_groups() != [], within_s=SETTLE_S, poll_s=0.01)
    sampler = node.engines.samplers[0]
    gate = sampler.gate = threading.Event()
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await wait_until(lambda: sampler.added != [], within_s=SETTLE_S, poll_s=0.01)
    node.sampling.cancel(OWNER, request_id)
    assert await node.failed(request_id) == Failed("sample cancelled by the client (cancel_future)", "user")
    gate.set()


async def test_cancelling_a_finished_sample_leaves_its_result(node: Node):
    sampler_id = await base_session(node)
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await node.completed(request_id)
    node.sampling.cancel(OWNER, request_id)
    assert isinstance(await node.outcome(request_id), Completed)


async def test_cancelling_another_users_request_is_404(node: Node):
    sampler_id = await base_session(node)
    request_id, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    with pytest.raises(NotFound) as caught:
        node.sampling.cancel("bob", request_id)
    assert caught.value.detail == f"no request {request_id!r}"


async def test_cancelling_a_training_request_is_400(node: Node):
    model_id = await node.new_model()
    request_id = node.jobs.forward_backward(OWNER, model_id, 1, batch(10))
    with pytest.raises(BadRequest) as caught:
        node.sampling.cancel(OWNER, request_id)
    assert caught.value.detail == f"request {request_id} is not a sample; only samples can be cancelled"


# ---------------------------------------------------------------- usage


async def test_a_samples_prompt_tokens_are_counted_when_it_is_queued_and_once_per_seq_id(node: Node):
    sampler_id = await base_session(node)
    node.sampling.sample(OWNER, sampler_id, 0, sample_job([5, 6, 7]))
    node.sampling.sample(OWNER, sampler_id, 0, sample_job([5, 6, 7]))
    assert node.usage_rows() == [(session_of(sampler_id), "sampling_prefill", 3)]


async def test_cancelling_a_sample_that_waits_for_its_group_to_start_fails_it_and_runs_nothing(node: Node, tmp_path):
    sampler_id = await base_session(node)
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")  # the sample starts the group
    request_id, _ = restarted.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    restarted.sampling.cancel(OWNER, request_id)
    assert await restarted.failed(request_id) == Failed("sample cancelled by the client (cancel_future)", "user")
    await wait_until(lambda: restarted.groups.all_groups() != [], within_s=SETTLE_S, poll_s=0.01)
    await trio.testing.wait_all_tasks_blocked()
    assert restarted.engines.samplers[0].added == []


async def test_an_inflight_session_samples_its_models_newest_published_weights(node: Node):
    model_id = await node.new_model()

    async def publish(seq_id: int) -> str:
        saved = await node.completed(
            node.jobs.save_weights_for_sampler(
                OWNER, model_id, seq_id, name=None, sampling_session_seq_id=0, kind="inflight", ttl_seconds=None,
                user_metadata={},
            )
        )
        return saved.sampling_session_id

    sampler_id = await publish(1)
    first, _ = node.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await node.completed(first)
    assert await publish(2) == sampler_id  # the same session, new weights
    second, _ = node.sampling.sample(OWNER, sampler_id, 1, sample_job([5]))
    await node.completed(second)
    assert node.engines.sampler_of(f"{MODEL} sampler").added == [
        (first, f"{model_id}/inflight/1"), (second, f"{model_id}/inflight/2"),
    ]


async def test_a_full_runs_checkpoint_session_samples_on_that_runs_own_sampler_after_a_restart(node: Node, tmp_path):
    model_id, saved = await saved_for_sampler(node, name="full", user_metadata={"openrl.fine_tuning_type": "full"})
    session_id = await node.session()
    sampler_id = node.sampling.create(
        OWNER, session_id=session_id, sampling_session_seq_id=0, base_model=None, model_path=saved.path
    )
    restarted = await open_node(node.store, node.nursery, tmp_path / "models")
    request_id, _ = restarted.sampling.sample(OWNER, sampler_id, 0, sample_job([5]))
    await restarted.completed(request_id)
    sampler = restarted.engines.sampler_of(f"{MODEL}/{model_id} full sampler")
    assert (sampler.added, sampler.versions) == ([(request_id, saved.path)], {saved.path: f"{model_id} for sampling"})
