"""The CPU threads of one engine call, from the size of its work (gpu/call_threads.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from openrld.batches import ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import call_threads
from openrld.gpu.call_threads import WORK_PER_THREAD, threads_for
from openrld.gpu.devices import apply_cpu_threads
from openrld.gpu.tiny_models import build_tiny_model
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

CPU = torch.device("cpu")
SMOLLM2_WEIGHTS = 134_515_008  # SmolLM2-135M: every parameter, its head tied to the embedding


@pytest.fixture
def ceiling_of_two():
    """This process's ceiling at 2 for the test; the earlier ceiling and torch's count after it."""
    before_ceiling, before_threads = call_threads._ceiling, torch.get_num_threads()
    call_threads.set_ceiling(2)
    yield
    call_threads.set_ceiling(before_ceiling)
    torch.set_num_threads(before_threads)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)


def test_a_call_takes_one_thread_per_work_per_thread_multiply_adds():
    assert [threads_for(work, 16) for work in (0, WORK_PER_THREAD - 1, WORK_PER_THREAD, 3 * WORK_PER_THREAD + 5)] == [
        1, 1, 1, 3,
    ]


def test_a_call_never_takes_more_than_the_ceiling():
    assert [threads_for(100 * WORK_PER_THREAD, ceiling) for ceiling in (1, 2, 16)] == [1, 2, 16]


def test_the_tiny_llamas_calls_stay_on_one_thread(llama_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    weights = call_threads.weights(model)
    assert weights == 98_624  # 2 layers of width 64 (36,992 each), the final norm, a head of 384 x 64
    assert threads_for(weights * 8 * 128, 2) == 1  # an SFT step of 8 x 128
    assert threads_for(weights * 8, 2) == 1  # a decode step of 8 rows


def test_smollm2s_decode_of_8_rows_takes_every_core_and_of_one_row_one():
    assert threads_for(SMOLLM2_WEIGHTS * 8, 2) == 2
    assert threads_for(SMOLLM2_WEIGHTS * 8 * 128, 2) == 2
    assert threads_for(SMOLLM2_WEIGHTS, 2) == 1


def test_a_tied_head_is_counted_once_and_the_embedding_not_at_all():
    config = dict(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False))
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=True))
    # q 256, k 128, v 128, o 256, gate/up/down 512 each, 2 norms 32, final norm 16, head 1,600
    assert call_threads.weights(untied) == call_threads.weights(tied) == 3_952


def test_without_a_ceiling_torch_keeps_its_count():
    before_ceiling, before_threads = call_threads._ceiling, torch.get_num_threads()
    call_threads.set_ceiling(None)
    try:
        torch.set_num_threads(2)
        call_threads.compute_on(1, 1)
        assert torch.get_num_threads() == 2
    finally:
        call_threads.set_ceiling(before_ceiling)
        torch.set_num_threads(before_threads)


def test_small_work_runs_on_one_thread_and_large_work_on_the_ceiling(ceiling_of_two):
    call_threads.compute_on(1000, 8)
    assert torch.get_num_threads() == 1
    call_threads.compute_on(SMOLLM2_WEIGHTS, 8)
    assert torch.get_num_threads() == 2


def test_an_inproc_engines_build_keeps_the_daemons_ceiling(ceiling_of_two):
    apply_cpu_threads(None)  # worker/builtin.py's build of an inproc engine: Start.threads is None
    assert call_threads._ceiling == 2


def test_a_training_pass_of_the_tiny_llama_runs_on_one_thread(llama_dir: Path, ceiling_of_two):
    trainer = TorchTrainer(llama_dir, CPU)
    trainer.add_adapter("job", LoraSpec(rank=8), "adamw")
    ids = np.arange(1, 33, dtype=np.int64)
    datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(31, np.float32)})
    torch.set_num_threads(2)
    trainer.forward_backward("job", ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=False))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("fused", [True, False])
def test_a_sample_of_the_tiny_llama_runs_on_one_thread(llama_dir: Path, ceiling_of_two, fused: bool):
    sampler = TorchSampler(llama_dir, CPU, fused_forward=fused)
    torch.set_num_threads(2)
    job = SampleJob(prompt=np.arange(1, 9, dtype=np.int32), num_samples=2, params=SamplingSpec(max_tokens=4, seed=1))
    assert len(sampler.sample(None, job).sequences) == 2
    assert torch.get_num_threads() == 1
