"""Converting a GGUF once into a Hugging Face directory: faithful, atomic, reused, reported."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import msgspec
import pytest
import torch
import transformers

from openrld.errors import ServerError
from openrld.gpu.gguf_convert import SOURCE_RECORD, GgufConverter
from openrld.gpu.tiny_gguf import rotary_rows_to_gguf
from openrld.model_catalog import ModelCatalog, ModelEntry
from openrld.progress import ProgressBoard, Stage

TEXT = "User: what is two plus two? Assistant: four. <|im_end|>Hello"


def _entry(gguf_file: Path, cache: Path, name: str = "tiny-gguf") -> ModelEntry:
    return ModelCatalog({name: str(gguf_file)}, cache_dir=cache).resolve(name)


@pytest.fixture(scope="module")
def converted(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelEntry, ProgressBoard]:
    entry = _entry(tiny_llama_gguf, tmp_path_factory.mktemp("cache"))
    board = ProgressBoard()
    GgufConverter(board).ensure(entry)
    return entry, board


def test_rotary_rows_interleave_the_two_halves_of_each_head():
    # One head of head_dim 4: HF rows [a0 a1 | b0 b1] rotate a_i with b_i; GGUF stores a0 b0 a1 b1.
    weight = torch.arange(8, dtype=torch.float32).reshape(8, 1).numpy()  # 2 heads x 4 rows
    assert rotary_rows_to_gguf(weight, n_heads=2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_the_converted_model_gives_the_original_logits_exactly(converted, tiny_llama: Path):
    entry, _ = converted
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(entry.directory, dtype=torch.float32)
    ids = transformers.AutoTokenizer.from_pretrained(tiny_llama)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        # float32 in, float32 out, same ops: bit-identical, so no tolerance.
        assert torch.equal(original(ids).logits, loaded(ids).logits)


def test_the_converted_tokenizer_encodes_like_the_original(converted, tiny_llama: Path):
    entry, _ = converted
    original = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    loaded = transformers.AutoTokenizer.from_pretrained(entry.directory)
    assert loaded(TEXT).input_ids == original(TEXT).input_ids
    assert (loaded.eos_token_id, loaded.decode(loaded(TEXT).input_ids)) == (original.eos_token_id, TEXT)


def test_the_converted_config_has_no_gguf_quantization_entry(converted):
    entry, _ = converted
    config = transformers.AutoConfig.from_pretrained(entry.directory)
    assert (hasattr(config, "quantization_config"), config.tie_word_embeddings) == (False, False)


def test_the_directory_records_its_source(converted, tiny_llama_gguf: Path):
    entry, _ = converted
    assert f'"source": "{tiny_llama_gguf.resolve()}"' in (Path(entry.directory) / SOURCE_RECORD).read_text()


def test_the_conversion_reports_each_stage_in_order(tiny_llama_gguf: Path, tmp_path: Path, caplog):
    entry = _entry(tiny_llama_gguf, tmp_path)
    with caplog.at_level("INFO", logger="openrld.progress"):
        GgufConverter(ProgressBoard()).ensure(entry)
    stages = [m.split(" stage=")[1].split()[0] for m in caplog.messages if m.startswith("progress ")]
    assert stages == ["reading", "converting", "writing", "publishing", "ready"]


def test_a_finished_conversion_reads_ready_at_one(converted):
    entry, board = converted
    done = board.get(entry.name)
    assert (done.operation, done.stage, done.fraction) == ("gguf_conversion", Stage.READY, 1.0)


def test_a_second_ensure_reuses_the_directory_and_reports_nothing(converted):
    entry, _ = converted
    inode = Path(entry.directory).stat().st_ino
    fresh = ProgressBoard()
    GgufConverter(fresh).ensure(entry)
    assert (Path(entry.directory).stat().st_ino, fresh.statistics()) == (inode, ())


def test_a_stale_staging_directory_is_removed_by_the_next_conversion(tiny_llama_gguf: Path, tmp_path: Path):
    entry = _entry(tiny_llama_gguf, tmp_path)
    stale = Path(entry.directory).parent / f".staging-{Path(entry.directory).name}-99999-1"
    stale.mkdir(parents=True)
    GgufConverter(ProgressBoard()).ensure(entry)
    assert sorted(p.name for p in Path(entry.directory).parent.iterdir()) == [Path(entry.directory).name]


def test_a_failed_conversion_is_a_server_error_leaving_nothing_behind(tiny_llama_gguf: Path, tmp_path: Path):
    # A valid header with the tensor data cut off: the catalog accepts it, transformers cannot load it.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama_gguf.read_bytes()[: tiny_llama_gguf.stat().st_size // 2])
    entry = _entry(cut, tmp_path / "cache", name="cut")
    board = ProgressBoard()
    with pytest.raises(ServerError, match=r"base_model 'cut': converting .*cut.gguf failed"):
        GgufConverter(board).ensure(entry)
    assert board.get("cut").stage is Stage.FAILED
    assert list(Path(entry.directory).parent.iterdir()) == []


class PausingBoard(ProgressBoard):
    """Holds the first conversion at its first report, and says when the second name starts waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.converting = threading.Event()
        self.release = threading.Event()
        self.queued = threading.Event()

    def report(self, key, operation, stage, fraction, message):
        progress = super().report(key, operation, stage, fraction, message)
        if stage is Stage.READING:
            self.converting.set()
            assert self.release.wait(30), "the test never released the conversion"
        if stage is Stage.QUEUED:
            self.queued.set()
        return progress


def test_a_second_name_for_the_same_file_waits_for_the_first_conversion(tiny_llama_gguf: Path, tmp_path: Path):
    first = _entry(tiny_llama_gguf, tmp_path, name="first")
    second = msgspec.structs.replace(first, name="second")
    board = PausingBoard()
    converter = GgufConverter(board)
    threads = [threading.Thread(target=converter.ensure, args=(e,)) for e in (first, second)]
    threads[0].start()
    assert board.converting.wait(30)
    threads[1].start()
    assert board.queued.wait(30)
    board.release.set()
    for thread in threads:
        thread.join(60)
    assert [(p.key, p.stage) for p in board.statistics()] == [("first", Stage.READY), ("second", Stage.READY)]
    assert board.get("second").message == f"converted to {first.directory}"


def _in_parts(gguf_file: Path, tmp_path: Path, sha256: str) -> ModelEntry:
    """An entry for `gguf_file` as a package ships one in parts: three pieces, assembled into the cache."""
    data = gguf_file.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = [tmp_path / f"tiny.gguf.part{i:02d}" for i in range(3)]
    for part, start, end in zip(parts, cuts, cuts[1:]):
        part.write_bytes(data[start:end])
    return ModelEntry(
        name="parted", directory=str(tmp_path / "cache" / "gguf" / "tiny"), arch="LlamaForCausalLM", max_context=1024,
        gguf_file=str(tmp_path / "cache" / "packaged" / "tiny.gguf"), gguf_parts=tuple(map(str, parts)),
        gguf_sha256=sha256,
    )


def test_a_gguf_in_parts_is_assembled_then_converted(tiny_llama_gguf: Path, tmp_path: Path, caplog):
    entry = _in_parts(tiny_llama_gguf, tmp_path, hashlib.sha256(tiny_llama_gguf.read_bytes()).hexdigest())
    with caplog.at_level("INFO", logger="openrld.progress"):
        GgufConverter(ProgressBoard()).ensure(entry)
    stages = [m.split(" stage=")[1].split()[0] for m in caplog.messages if m.startswith("progress ")]
    assert stages == ["reading", "reading", "converting", "writing", "publishing", "ready"]  # assembling, then as any
    assert Path(entry.gguf_file).read_bytes() == tiny_llama_gguf.read_bytes()
    assert f'"source": "{entry.gguf_file}"' in (Path(entry.directory) / SOURCE_RECORD).read_text()


def test_parts_that_do_not_assemble_to_their_sha256_fail_the_conversion(tiny_llama_gguf: Path, tmp_path: Path):
    entry = _in_parts(tiny_llama_gguf, tmp_path, "0" * 64)
    board = ProgressBoard()
    with pytest.raises(ServerError, match=r"base_model 'parted': converting .*tiny.gguf failed: ValueError: tiny.gguf"):
        GgufConverter(board).ensure(entry)
    assert board.get("parted").stage is Stage.FAILED
    assert list((tmp_path / "cache" / "packaged").iterdir()) == []


def test_the_file_is_parsed_once_for_tokenizer_config_and_weights(
    tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from openrld.gpu import gguf_convert

    parsed: list[str] = []

    class CountingReader(gguf_convert._PlainReader):
        def __init__(self, path, mode="r"):  # type: ignore[no-untyped-def]
            parsed.append(str(path))
            super().__init__(path, mode)

    def other_reader(path, mode="r"):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a second parse of {path}")

    monkeypatch.setattr(gguf_convert, "_PlainReader", CountingReader)
    monkeypatch.setattr(gguf_convert, "_READER", other_reader)
    GgufConverter(ProgressBoard()).ensure(_entry(tiny_llama_gguf, tmp_path))
    assert parsed == [str(tiny_llama_gguf)]


def test_the_plain_reader_reads_the_same_fields_and_tensors_as_ggufs(tiny_llama_gguf: Path):
    import gguf
    import numpy as np

    from openrld.gpu.gguf_convert import _PlainReader

    plain, mapped = _PlainReader(tiny_llama_gguf, "r"), gguf.GGUFReader(tiny_llama_gguf, "r")
    assert type(plain.data) is np.ndarray
    assert [f.name for f in plain.fields.values()] == [f.name for f in mapped.fields.values()]
    assert [f.parts[-1].tobytes() for f in plain.fields.values()] == [f.parts[-1].tobytes() for f in mapped.fields.values()]
    assert [(t.name, t.data.tobytes()) for t in plain.tensors] == [(t.name, t.data.tobytes()) for t in mapped.tensors]
