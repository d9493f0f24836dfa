"""FullSampler fed by FullTrainer's weight sync, on a tiny random Llama.

The sync is bit-exact, so weights are compared with torch.equal and greedy samples of the
same version with ==.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import delta
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.tiny_models import build_tiny_model

CPU = torch.device("cpu")
TOKENS = np.arange(30, 46, dtype=np.int64)
DATA = [TrainDatum(tokens=TOKENS[:-1], inputs={"target_tokens": TOKENS[1:]})]
PROMPT = np.array([40, 41, 42, 43], dtype=np.int64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def step(trainer: FullTrainer) -> None:
    batch = ForwardBackwardBatch(data=DATA, loss_fn="cross_entropy", loss_config={}, forward_only=False)
    trainer.forward_backward("job", batch)
    trainer.optim_step("job", AdamParams(learning_rate=1e-3))


def greedy(max_tokens: int = 6) -> SampleJob:
    return SampleJob(prompt=PROMPT, num_samples=1, params=SamplingSpec(max_tokens=max_tokens, temperature=0.0))


def scored() -> SampleJob:
    """The prompt's log-probs under the version: what its weights say, with nothing drawn."""
    return SampleJob(prompt=PROMPT, num_samples=1, params=SamplingSpec(max_tokens=0), prompt_logprobs=True)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(delta.bits(a[k]), delta.bits(b[k])) for k in a)


@pytest.mark.parametrize("sync", ["delta", "full"])
def test_sampler_weights_equal_the_trainers_bit_for_bit_after_every_sync(model_dir: Path, sync: str) -> None:
    trainer = FullTrainer(model_dir, CPU, weight_sync=sync)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU)
    for version in ("v1", "v2", "v3"):
        step(trainer)
        payload = trainer.sampler_payload("job", version)
        assert payload.mode == sync
        sampler.load_version(version, payload)
        assert same_bits(sampler.live_weights(), trainer.live_tensors("job"))
    stats = sampler.statistics().last_sync
    assert stats is not None and stats.mode == sync and stats.bytes_moved == payload.bytes_moved


def test_a_corrupted_delta_fails_loudly_and_the_version_is_not_loaded(model_dir: Path) -> None:
    trainer = FullTrainer(model_dir, CPU)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU)
    step(trainer)
    payload = trainer.sampler_payload("job", "v1")
    first = payload.tensors[0]
    bad = first.values.clone()
    bad.view(-1)[0] = bad.view(-1)[0] + 1.0
    corrupted = payload.__class__(**{f: getattr(payload, f) for f in payload.__struct_fields__})
    corrupted.tensors[0] = delta.TensorDelta(name=first.name, indices=first.indices, values=bad)
    with pytest.raises(delta.WeightMismatch, match=r"sampler digest .* != trainer digest"):
        sampler.load_version("v1", corrupted)
    assert not sampler.has_version("v1")


def test_an_older_version_still_samples_its_own_weights_after_a_delta(model_dir: Path) -> None:
    trainer = FullTrainer(model_dir, CPU)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU)
    for _ in range(3):  # enough steps for greedy outputs to move
        step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    first = sampler.sample("v1", scored()).prompt_logprobs.tolist()
    for _ in range(3):
        step(trainer)
    sampler.load_version("v2", trainer.sampler_payload("job", "v2"))
    newer = sampler.sample("v2", scored()).prompt_logprobs.tolist()
    assert newer[1:] != first[1:]
    assert sampler.sample("v1", scored()).prompt_logprobs.tolist()[1:] == first[1:]
    assert sampler.statistics().switches == 1


def test_a_delta_arriving_mid_request_waits_for_the_batch_to_drain(model_dir: Path) -> None:
    trainer = FullTrainer(model_dir, CPU)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU)
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    alone = sampler.sample("v1", greedy(8)).sequences[0].tokens.tolist()
    for _ in range(3):
        step(trainer)
    sampler.add("r1", "v1", greedy(8))
    sampler.step()
    sampler.load_version("v2", trainer.sampler_payload("job", "v2"))
    sampler.add("r2", "v2", greedy(8))
    finished = {}
    while sampler.has_work():
        finished.update({f.request_id: f.result for f in sampler.step()})
    assert finished["r1"].sequences[0].tokens.tolist() == alone
    assert same_bits(sampler.live_weights(), trainer.live_tensors("job"))
    assert sorted(finished) == ["r1", "r2"]


def test_the_delta_chain_survives_sampling_a_checkpoint_and_dropping_its_base(model_dir: Path) -> None:
    """The actor may evict the last synced version while a named checkpoint is sampled; the
    next delta still applies to it, because the sampler keeps the chain's head."""
    trainer = FullTrainer(model_dir, CPU)
    trainer.add_adapter("job")
    sampler = FullSampler(model_dir, CPU)
    step(trainer)
    sampler.load_version("v1", trainer.sampler_payload("job", "v1"))
    sampler.load_version("checkpoint", trainer.adapter_tensors("job"))  # as read from model.safetensors
    step(trainer)
    sampler.load_version("other", trainer.adapter_tensors("job"))
    sampler.sample("other", scored())  # the live weights leave v1
    sampler.drop_version("v1")
    step(trainer)
    sampler.load_version("v2", trainer.sampler_payload("job", "v2"))
    assert same_bits(sampler.live_weights(), trainer.live_tensors("job"))
    assert sampler.statistics().versions_held == 2  # "checkpoint" and "other"; v1 freed once v2 took over
