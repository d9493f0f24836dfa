"""stable_reinforce end to end with the real SDK: record at sampling, train on provenance.

Sampling clients are made with `record_stability_info=True`; datums are built as the
cookbook's single-turn `rl_loop.py` builds them (prompt length P, S sampled tokens):
model_input_spans = [Prompt(id, 0, P), Sampled(id, 0, S−1)] and
loss_fn_input_spans = [Prompt(id, 1, P−1), Sampled(id, 0, S)].
"""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

API_KEY = "tml-test"
PROMPT = [7, 8, 9, 10, 11]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])


@pytest.fixture(scope="module")
def service(shared_daemon):
    client = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def training(service):
    return service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()


def rl_datum(
    sequence: types.SampledSequence, advantage: float, client_logprob: float | None = None,
    prompt_advantage: float = 0.0,
) -> types.Datum:
    """One datum per sampled sequence; `client_logprob` replaces the sampler logprobs the client sends,
    `prompt_advantage` the 0 the cookbook puts on prompt positions."""
    tokens = PROMPT + list(sequence.tokens)
    p, s = len(PROMPT), len(sequence.tokens)
    sent = list(sequence.logprobs) if client_logprob is None else [client_logprob] * s
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * (p - 1) + tokens[p:],  # rl_loop.py sends 0 at prompt targets
            "logprobs": [0.0] * (p - 1) + sent,
            "advantages": [prompt_advantage] * (p - 1) + [advantage] * s,
        },
    )
    sid = sequence.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=p),
                     types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=s - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=s)],
    )


def sample(sampler: tinker.SamplingClient, num_samples: int = 2) -> list[types.SampledSequence]:
    prompt = types.ModelInput.from_ints(PROMPT)
    return sampler.sample(prompt, num_samples=num_samples, sampling_params=PARAMS).result().sequences


def test_loss_uses_the_recorded_sampler_logprobs_not_the_clients(training):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = sample(sampler)
    advantages = [1.0, -0.5]
    # The client claims logprob −5 for every sampled token; the server must use what it recorded.
    data = [rl_datum(seq, a, client_logprob=-5.0) for seq, a in zip(sequences, advantages)]
    result = training.forward_backward(data, "stable_reinforce").result()
    expected = 0.0
    for out, seq, a in zip(result.loss_fn_outputs, sequences, advantages):
        lp = np.asarray(out["logprobs"].tolist(), np.float64)[len(PROMPT) - 1 :]
        ratio = np.exp(lp - np.asarray(seq.logprobs, np.float64))
        expected += float(np.sum(-np.minimum(ratio, 4.0) * a * lp))
        # Same weights sampled and trained: the ratios are 1 up to the 1e-3 sampler/trainer agreement.
        np.testing.assert_allclose(ratio, 1.0, atol=1e-3)
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert result.metrics["tokens:sum"] == sum(len(s.tokens) for s in sequences)
    assert result.metrics["kl:sum"] == pytest.approx(0.0, abs=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_training_again_on_the_same_sequences_still_resolves_them(training):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = sample(sampler, num_samples=1)
    first = training.forward([rl_datum(sequences[0], 1.0)], "stable_reinforce").result()
    again = training.forward([rl_datum(sequences[0], 1.0)], "stable_reinforce").result()
    assert again.metrics["loss:sum"] == first.metrics["loss:sum"]


def test_unknown_sequence_id_fails_naming_the_datum_and_the_id(training):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    good = sample(sampler, num_samples=1)[0]
    missing = dataclasses.replace(good, sequence_id="no-such-sequence")
    with pytest.raises(tinker.TinkerError, match=r"datum 1: model_input_spans names sequence_id 'no-such-sequence'"):
        training.forward_backward([rl_datum(good, 1.0), rl_datum(missing, 1.0)], "stable_reinforce").result()
    # The failed request consumed its seq_id: the client's next request runs.
    assert "loss:sum" in training.forward([rl_datum(good, 1.0)], "stable_reinforce").result().metrics


def test_sequence_sampled_without_recording_is_refused(training):
    sampler = training.save_weights_and_get_sampling_client().result()
    sequence = sample(sampler, num_samples=1)[0]
    with pytest.raises(tinker.TinkerError, match="not sampled with record_stability_info=True in this session"):
        training.forward_backward([rl_datum(sequence, 1.0)], "stable_reinforce").result()


def test_another_sessions_sequence_is_refused(training, shared_daemon):
    other = tinker.ServiceClient(base_url=shared_daemon.url, api_key=API_KEY)
    try:
        other_training = other.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
        sampler = other_training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        foreign = sample(sampler, num_samples=1)[0]
        assert "loss:sum" in other_training.forward([rl_datum(foreign, 1.0)], "stable_reinforce").result().metrics
        with pytest.raises(tinker.TinkerError, match=f"names sequence_id '{foreign.sequence_id}', which this session"):
            training.forward([rl_datum(foreign, 1.0)], "stable_reinforce").result()
    finally:
        other.close("success").result()


def test_nonzero_advantage_on_the_prompt_is_refused(training):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    bad = rl_datum(sample(sampler, num_samples=1)[0], 1.0, prompt_advantage=1.0)
    with pytest.raises(tinker.TinkerError, match=r"datum 0: loss_fn_inputs\['advantages'\] is 1 at position 0"):
        training.forward_backward([bad], "stable_reinforce").result()


def test_metrics_count_the_recorded_sequences(training, shared_daemon):
    def records() -> float:
        text = httpx.get(f"{shared_daemon.url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
        [line] = [line for line in text.splitlines() if line.startswith("openrld_stability_records ")]
        return float(line.split()[1])

    before = records()
    sample(training.save_weights_and_get_sampling_client(record_stability_info=True).result(), num_samples=3)
    unrecorded = training.save_weights_and_get_sampling_client().result()
    sample(unrecorded, num_samples=2)
    assert records() == before + 3
