"""Tiny random Llama and Qwen3 models with real tokenizers, built offline.

Tests and benchmarks cannot download anything, so they build their models here:
a byte-level BPE tokenizer trained on a fixed corpus (so stop strings can span
token boundaries, as with real tokenizers) and a randomly initialised
transformers model of a few hundred thousand parameters. The same arguments
always build the same files. This module never touches the network.
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


def _config(arch: str, vocab_size: int, eos_id: int) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; expected 'llama' or 'qwen3'")


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
