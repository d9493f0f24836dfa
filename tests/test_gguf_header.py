"""Reading a GGUF header's architecture and context length without loading the file."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest

from openrld.gguf_header import GgufFormatError, GgufHeader, read_gguf_header


def test_tiny_llama_gguf_header_names_llama_and_its_context(tiny_llama_gguf: Path):
    # tiny_models._config sets max_position_embeddings=1024
    assert read_gguf_header(tiny_llama_gguf) == GgufHeader(
        architecture="llama", transformers_arch="LlamaForCausalLM", context_length=1024
    )


def test_a_file_that_is_not_gguf_is_refused_naming_its_first_bytes(tmp_path: Path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04not a gguf")
    with pytest.raises(GgufFormatError, match=r"not a GGUF file: it starts with b'PK\\x03\\x04'"):
        read_gguf_header(path)


def test_an_unsupported_version_is_refused_naming_it(tmp_path: Path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GgufFormatError, match=r"GGUF version 1; openrld reads versions \(2, 3\)"):
        read_gguf_header(path)


def test_a_truncated_header_is_refused(tiny_llama_gguf: Path, tmp_path: Path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_llama_gguf.read_bytes()[:40])
    with pytest.raises(GgufFormatError, match="truncated"):
        read_gguf_header(path)


def test_an_architecture_transformers_cannot_convert_is_refused_naming_it(tmp_path: Path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GgufFormatError, match="architecture 'bert' is not one openrld converts"):
        read_gguf_header(path)


def test_a_header_without_context_length_is_refused(tmp_path: Path):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b"])  # an array before the end: skipped element by element
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(GgufFormatError, match=r"no llama\.context_length key"):
        read_gguf_header(path)
