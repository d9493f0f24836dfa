"""The short training loop every tinker SDK release must run against a node; prints one JSON line.

Run by tests/e2e/test_sdk_matrix.py with the Python of one release's own venv
(tests/sdk_venvs.py), so it imports nothing of openrld or of the test suite,
and calls only names that every SDK since 0.16 has:

    python sdk_loop.py URL BASE_MODEL

create a LoRA training client; forward_backward + optim_step twice; forward;
save_weights_for_sampler and a sampling client on that path; sample;
compute_logprobs; save_state and create_training_client_from_state; forward
with the new client; list the run's checkpoints through the REST client.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

import numpy as np
import tinker
from tinker import types

API_KEY = "tml-sdk-matrix"  # an open-mode node takes any key; the SDK insists on the prefix
TOKENS = list(range(40, 60))
PROMPT = [40, 41, 42, 43]
MAX_TOKENS = 4


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


def resolved(client):
    """From 0.38 the create_* methods return a future of the client (the client itself before)."""
    return client.result() if hasattr(client, "result") else client


def logprobs_of(output: types.ForwardBackwardOutput) -> list[float]:
    return [float(v) for v in output.loss_fn_outputs[0]["logprobs"].to_numpy().ravel()]


def main(url: str, base_model: str) -> dict:
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    training = resolved(service.create_lora_training_client(base_model=base_model, rank=4))
    train = [datum(TOKENS)]
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward(train, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = training.forward(train, "cross_entropy").result()
    prompt_forward = training.forward([datum(PROMPT)], "cross_entropy").result()

    sampler_path = training.save_weights_for_sampler("sampler-a").result().path
    sampler = resolved(service.create_sampling_client(model_path=sampler_path))
    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=greedy).result()
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()

    state_path = training.save_state("state-a").result().path
    restored = resolved(service.create_training_client_from_state(state_path))
    restored_forward = restored.forward(train, "cross_entropy").result()

    listed = service.create_rest_client().list_checkpoints(training.model_id).result()
    return {
        "sdk": metadata.version("tinker"),
        "losses": losses,
        "trained_loss": trained.metrics["loss:sum"],
        "restored_loss": restored_forward.metrics["loss:sum"],
        "trainer_prompt_logprobs": logprobs_of(prompt_forward),
        "sampler_prompt_logprobs": prompt_logprobs,
        "sampled_tokens": [list(s.tokens) for s in sampled.sequences],
        "sampled_logprobs": [list(s.logprobs) for s in sampled.sequences],
        "checkpoints": sorted([c.checkpoint_type, c.checkpoint_id] for c in listed.checkpoints),
        "paths": [sampler_path, state_path],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
