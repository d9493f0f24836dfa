"""The client of the throughput benches: the real tinker SDK in a process of its own.

`python bench/_sdk_loop.py URL MODEL VOCAB` connects to the daemon at URL and answers
requests (bench/_lines.py), doing the work of `bench/_bare_loop.py` through the API on the
same token rows (`_workload`):

- sft_steps {rows, tokens, count, pipelined}: the seconds of each of `count` SFT steps
  (forward_backward with cross_entropy, then optim_step) of a LoRA training client (rank 8,
  seed 0). Lock-step: each step's two calls are submitted together and both results read
  before the next step. Pipelined: the next step is submitted before the previous one's
  results are read, as tinker-cookbook's pipelined supervised loop does; a step's time is
  the interval between consecutive completions;
- sample {batch, new_tokens, lora}: the seconds of one `sample` of `batch` samples of
  `new_tokens` tokens each (stop=[], temperature 1) from `_workload.prompt`, by the base
  model's sampling client, or by the training client's latest weights when `lora`;
- clients {clients, repeats, new_tokens}: total tokens/s of `clients` ServiceClients (a
  thread each) that each have `repeats` batch-1 samples of the base model in flight at once;
- rl_iteration: save_weights_and_get_sampling_client, sample 8 x 32, an importance_sampling
  forward_backward on the 8 sequences with their sampling logprobs, optim_step; its seconds;
- rl_iterations {count}: that many RL iterations, untimed (a long run's steady state).

It never imports openrld.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lines import serve
from _workload import LR, PROMPT_TOKENS, RANK, batch_tokens, prompt

API_KEY = "tml-bench"
RL_SAMPLES, RL_NEW_TOKENS = 8, 32  # as _bare_loop.py's sample


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def resolved(client):
    """From 0.38 the create_* methods return a future of the client (the client itself before: 0.25, which
    bench/skyrl_peer.py drives SkyRL's server with, since SkyRL's sampling fails with 0.38)."""
    return client.result() if hasattr(client, "result") else client


def close(service: tinker.ServiceClient) -> None:
    """Ends the session; releases before ServiceClient.close (0.25) end it with the process."""
    if hasattr(service, "close"):
        service.close("success").result()


def params(new_tokens: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[])


class SdkLoop:
    def __init__(self, url: str, model: str, vocab: int, user_metadata: dict[str, str] | None = None) -> None:
        self.url, self.model, self.vocab = url, model, vocab
        self.user_metadata = user_metadata  # the training job's, e.g. its openrl.* settings
        self.service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        self.prompt = prompt(vocab)
        self.adam = types.AdamParams(learning_rate=LR)
        self._base: tinker.SamplingClient | None = None
        self._training: tinker.TrainingClient | None = None
        self._lora: tinker.SamplingClient | None = None

    @property
    def base(self) -> tinker.SamplingClient:
        if self._base is None:
            self._base = resolved(self.service.create_sampling_client(base_model=self.model))
        return self._base

    @property
    def training(self) -> tinker.TrainingClient:
        if self._training is None:
            self._training = resolved(self.service.create_lora_training_client(
                base_model=self.model, rank=RANK, seed=0, user_metadata=self.user_metadata
            ))
        return self._training

    def _sample(self, sampling: tinker.SamplingClient, batch: int, new_tokens: int) -> types.SampleResponse:
        result = sampling.sample(types.ModelInput.from_ints(self.prompt), batch, params(new_tokens)).result()
        assert sum(len(s.tokens) for s in result.sequences) == batch * new_tokens
        return result

    def sample(self, batch: int, new_tokens: int, lora: bool) -> float:
        if lora and self._lora is None:
            self._lora = resolved(self.training.save_weights_and_get_sampling_client())
        sampling = self._lora if lora else self.base
        return seconds(lambda: self._sample(sampling, batch, new_tokens))

    def _train(self, data: list[types.Datum], loss: str) -> tuple:
        return self.training.forward_backward(data, loss), self.training.optim_step(self.adam)

    def sft_steps(self, rows: int, tokens: int, count: int, pipelined: bool) -> list[float]:
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={"target_tokens": row[1:].tolist()},
            )
            for row in batch_tokens(rows, tokens, self.vocab)
        ]

        def wait(futures: tuple) -> None:
            for future in futures:
                future.result()

        if not pipelined:
            return [seconds(lambda: wait(self._train(data, "cross_entropy"))) for _ in range(count)]
        times = []
        in_flight = self._train(data, "cross_entropy")
        wait_started = time.perf_counter()
        for _ in range(count):
            following = self._train(data, "cross_entropy")
            wait(in_flight)
            done = time.perf_counter()
            times.append(done - wait_started)
            in_flight, wait_started = following, done
        wait(in_flight)
        return times

    def clients(self, clients: int, repeats: int, new_tokens: int) -> float:
        services = [tinker.ServiceClient(base_url=self.url, api_key=API_KEY) for _ in range(clients)]
        samplers = [resolved(s.create_sampling_client(base_model=self.model)) for s in services]
        for sampling in samplers:
            self._sample(sampling, 1, new_tokens)  # connections warm
        counts = [0] * clients
        barrier = threading.Barrier(clients + 1)

        def run(index: int) -> None:
            barrier.wait()
            model_input = types.ModelInput.from_ints(self.prompt)
            futures = [samplers[index].sample(model_input, 1, params(new_tokens)) for _ in range(repeats)]
            counts[index] = sum(len(f.result().sequences[0].tokens) for f in futures)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        for service in services:
            close(service)
        assert sum(counts) == clients * repeats * new_tokens, counts
        return sum(counts) / elapsed

    def rl_iteration(self) -> float:
        def iteration() -> None:
            sampling = resolved(self.training.save_weights_and_get_sampling_client())
            result = self._sample(sampling, RL_SAMPLES, RL_NEW_TOKENS)
            data = []
            for advantage, sequence in zip(np.linspace(-1.0, 1.0, RL_SAMPLES), result.sequences):
                tokens = self.prompt + list(sequence.tokens)
                new = len(sequence.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (PROMPT_TOKENS - 1) + list(sequence.logprobs or []),
                        "advantages": [0.0] * (PROMPT_TOKENS - 1) + [float(advantage)] * new,
                    },
                ))
            for future in self._train(data, "importance_sampling"):
                future.result()

        return seconds(iteration)

    def rl_iterations(self, count: int) -> None:
        for _ in range(count):
            self.rl_iteration()


def main(url: str, model: str, vocab: int, user_metadata: dict[str, str] | None = None) -> None:
    loop = SdkLoop(url, model, vocab, user_metadata)
    serve({
        "sft_steps": loop.sft_steps,
        "sample": loop.sample,
        "clients": loop.clients,
        "rl_iteration": loop.rl_iteration,
        "rl_iterations": loop.rl_iterations,
    })
    close(loop.service)


if __name__ == "__main__":
    # An optional fourth argument: the training job's user_metadata, as JSON (e.g. its openrl.* settings).
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]) if len(sys.argv) > 4 else None)
