"""A tiny GGUF file written from a tiny Hugging Face Llama, for tests of the GGUF path.

Tests cannot download a GGUF, and the real one (SmolLM2) takes a minute to
convert, so this writes the tiny Llama of `tiny_models` as a float32 GGUF
with its byte-level BPE tokenizer. The layout follows the GGUF conventions
that transformers' reader undoes: llama.cpp's tensor names (`blk.N.attn_q`),
and the q/k rows permuted from Hugging Face's rotary layout (halves) to
GGUF's (interleaved pairs). Loading the file back must give the original
model's logits; the tests check exactly that. Float32 tensors, so nothing is
lost. This module never touches the network and never imports trio.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_NORMAL_TOKEN = 1
_CONTROL_TOKEN = 3


def rotary_rows_to_gguf(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder a q/k projection's rows per head from halves (HF) to interleaved pairs (GGUF).

    weight: (n_heads * head_dim, hidden). Within a head, HF rotates row i with
    row i + head_dim/2; GGUF stores them as rows 2i and 2i + 1.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    prefix, layer, rest = hf_name.split(".", 3)[1], hf_name.split(".")[2], hf_name.split(".", 3)[3]
    assert prefix == "layers" and rest in _LAYER_TENSORS, f"no GGUF name for {hf_name}"
    return f"blk.{layer}.{_LAYER_TENSORS[rest]}"


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, config: dict) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    special = {added["content"]: added["id"] for added in tokenizer["added_tokens"]}
    tokens = [""] * (max([*vocab.values(), *special.values()]) + 1)
    for token, index in (vocab | special).items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL_TOKEN if t in special else _NORMAL_TOKEN for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])


def write_tiny_llama_gguf(model_dir: Path, out_file: Path) -> Path:
    """Write the float32 Llama in `model_dir` (HF layout, one safetensors file) as GGUF at `out_file`."""
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama", f"expected a llama model, got {config['model_type']!r}"
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(out_file), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _write_tokenizer(writer, model_dir, config)
    for hf_name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        array = tensor.astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            array = rotary_rows_to_gguf(array, n_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = rotary_rows_to_gguf(array, n_kv)
        writer.add_tensor(_gguf_name(hf_name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file
