"""Tiny random models of every family openrld serves, with real tokenizers, built offline.

Tests and benchmarks cannot download anything, so they build their models here:
a byte-level BPE tokenizer trained on a fixed corpus (so stop strings can span
token boundaries, as with real tokenizers) and a randomly initialised
transformers model of a few hundred thousand parameters. The same arguments
always build the same files. This module never touches the network.

`FAMILIES` names each family's tiny build. Where a family mixes layer kinds, the
tiny build keeps the mix at a small scale: Gemma 3 and 4 have sliding-window
layers (window 8, so that a 48-token test sequence crosses it) beside global
ones, Gemma 4 also shares KV across its last layers and feeds per-layer inputs,
Qwen3.5 has linear-attention (Gated DeltaNet) layers between full ones, and the
MoE families route each token to 2 of 4 experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "User: what is two plus two? Assistant: four. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000. "
    "Reinforcement learning rewards answers that are correct; training makes them likely. "
    "Hello world! Hello there, general. The answer is 42.\n\nUser: and now?\n\n"
)


def build_tokenizer(vocab_size: int = 384) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: every string encodes, and merges make multi-byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


SLIDING_WINDOW = 8  # the tiny sliding-window families' window: shorter than a test's sequence


def _config(arch: str, vocab_size: int, eos_id: int) -> transformers.PretrainedConfig:
    tokens = dict(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id)
    common = dict(
        tokens,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    four_layers = dict(common, num_hidden_layers=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    linear = dict(
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "olmo2":
        return transformers.Olmo2Config(**common)
    if arch == "phi3":
        return transformers.Phi3Config(**common)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **four_layers,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        )
    if arch == "gemma4":
        return transformers.Gemma4TextConfig(
            **four_layers,
            head_dim=16,
            global_head_dim=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
        )
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**four_layers, head_dim=16, **linear)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, **moe)
    if arch == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(
            **{k: v for k, v in four_layers.items() if k != "intermediate_size"},
            head_dim=16,
            shared_expert_intermediate_size=32,
            **moe,
            **linear,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {', '.join(FAMILIES)}")


# Every family a tiny model is built for, in the order the README's table lists them.
FAMILIES = (
    "llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3",
    "gemma3", "gemma4", "qwen3_5", "qwen3_moe", "qwen3_5_moe",
)  # fmt: skip


def build_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random `arch` model and its tokenizer to `out_dir`; return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _config(arch, len(tokenizer), tokenizer.eos_token_id)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
