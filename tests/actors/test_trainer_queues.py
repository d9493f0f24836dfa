"""TrainerQueues: per-job seq_id order, fair turns, and which forward_backward ops share a pass."""

from __future__ import annotations

import numpy as np

from openrld.actors.trainer import ForwardBackward, OptimStep, TrainerQueues
from openrld.batches import AdamParams, ForwardBackwardBatch, TrainDatum


def _fb(model_id: str, seq_id: int, tokens: int = 10, forward_only: bool = False) -> ForwardBackward:
    datum = TrainDatum(tokens=np.arange(tokens), inputs={"target_tokens": np.arange(tokens)})
    batch = ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=forward_only)
    return ForwardBackward(model_id, seq_id, f"r-{model_id}-{seq_id}", batch)


def _step(model_id: str, seq_id: int) -> OptimStep:
    return OptimStep(model_id, seq_id, f"r-{model_id}-{seq_id}", AdamParams())


def _seq_ids(run) -> list[int]:
    return [op.seq_id for op in run]


def test_consecutive_forward_backwards_of_a_job_pop_as_one_run_ending_with_the_optim_step():
    queues = TrainerQueues()
    queues.open_job("m")
    for op in (_fb("m", 2), _step("m", 3), _fb("m", 0), _fb("m", 1), _fb("m", 4)):
        queues.push(op)
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [0, 1, 2, 3]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [4]
    assert queues.pop_ready(max_combined_tokens=1000) == []


def test_an_optim_step_alone_pops_alone():
    queues = TrainerQueues()
    queues.open_job("m")
    queues.push(_step("m", 0))
    queues.push(_step("m", 1))
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [0]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [1]


def test_a_run_stops_at_a_gap_in_seq_ids():
    queues = TrainerQueues()
    queues.open_job("m")
    for op in (_fb("m", 0), _fb("m", 2)):
        queues.push(op)
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [0]
    assert queues.pop_ready(max_combined_tokens=1000) == []


def test_a_run_keeps_its_tokens_within_the_budget():
    queues = TrainerQueues()
    queues.open_job("m")
    for seq_id in range(4):
        queues.push(_fb("m", seq_id, tokens=10))
    # 10 + 10 + 10 = 30 fits a budget of 35; the fourth op would make 40.
    assert _seq_ids(queues.pop_ready(max_combined_tokens=35)) == [0, 1, 2]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=35)) == [3]


def test_forward_only_and_forward_backward_never_share_a_run():
    queues = TrainerQueues()
    queues.open_job("m")
    queues.push(_fb("m", 0, forward_only=True))
    queues.push(_fb("m", 1))
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [0]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=1000)) == [1]


def test_a_zero_budget_never_combines():
    queues = TrainerQueues()
    queues.open_job("m")
    queues.push(_fb("m", 0))
    queues.push(_fb("m", 1))
    queues.push(_step("m", 2))
    assert _seq_ids(queues.pop_ready(max_combined_tokens=0)) == [0]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=0)) == [1]
    assert _seq_ids(queues.pop_ready(max_combined_tokens=0)) == [2]


def test_runs_never_mix_jobs_and_jobs_take_turns():
    queues = TrainerQueues()
    queues.open_job("a")
    queues.open_job("b")
    for op in (_fb("a", 0), _fb("a", 1), _fb("b", 0), _fb("b", 1)):
        queues.push(op)
    first = queues.pop_ready(max_combined_tokens=1000)
    second = queues.pop_ready(max_combined_tokens=1000)
    assert [(op.model_id, op.seq_id) for op in first] == [("a", 0), ("a", 1)]
    assert [(op.model_id, op.seq_id) for op in second] == [("b", 0), ("b", 1)]
