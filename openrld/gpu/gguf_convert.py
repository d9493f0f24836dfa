"""Converting a GGUF model once into a Hugging Face directory (safetensors, config, tokenizer).

transformers reads GGUF (through the `gguf` package) by dequantizing every
tensor at load time: ~40 s for SmolLM2-135M on 2 busy cores, paid again at
every load and by both the trainer and the sampler. `GgufConverter.ensure`
pays it once per file: it loads the GGUF with transformers, writes float32
safetensors, the config (without GGUF's quantization entry, so later loads
are plain) and the tokenizer files into a staging directory next to the
target, fsyncs them and renames the staging directory into place. A crash
leaves only a staging directory, which the next conversion removes; the
target directory existing means it is complete, and a second daemon start
reuses it.

Float32 because a dequantized Q4/Q8 value (an fp16 scale times a small
integer plus an fp16 offset) is exact in float32 and not always in bf16;
the engines pick their compute dtype per device when they load it.

transformers parses the file's header anew for the tokenizer, the config and
the weights; with gguf's reader that is ~14 s each for Gemma 3's 262k-token
vocabulary on 2 cores, two thirds of it numpy's memmap subclass running Python
code on each of the million slices the parse takes. `_parsed_once` makes the
three share one parse, read through a plain ndarray view of the mapping
(`_PlainReader`: 4.7 s); no library offers either.

Progress goes to a `ProgressBoard` under the model's name, one report per
stage with the fraction of the whole done. This module never imports trio;
callers run `ensure` in a worker thread. Concurrent callers for the same
target (the trainer and the sampler starting together) wait on one lock
and the second finds the work done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from openrld.errors import ServerError
from openrld.gpu.checkpoint import fsync_directory
from openrld.model_catalog import ModelEntry, assemble_gguf, is_converted
from openrld.progress import ProgressBoard, Stage

logger = logging.getLogger(__name__)

OPERATION = "gguf_conversion"
SOURCE_RECORD = "openrld-gguf-source.json"  # written next to the weights: what they were converted from
_STAGING_PREFIX = ".staging-"

# The share of the whole each stage ends at, measured on SmolLM2-135M here:
# the dequantizing load dominates, writing ~0.5 GB of float32 comes next.
_TOKENIZER_DONE = 0.15
_WEIGHTS_DONE = 0.75
_WRITTEN = 0.95


_READER = gguf.GGUFReader  # the class, kept before `_shared_reader` stands in for it


class _PlainReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its read-only mapping: the same bytes, the
    same fields and tensors, without memmap's per-slice Python hooks."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)  # the view keeps the mapping alive through .base


_SHARED_READERS: dict[str, gguf.GGUFReader] = {}  # GGUF path -> its one parse, while a conversion reads it
_SHARED_LOCK = threading.Lock()


def _shared_reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
    """gguf.GGUFReader for transformers' loads: the shared parse of a file being converted, else a new one."""
    shared = _SHARED_READERS.get(os.path.realpath(path))
    return shared if shared is not None and mode == "r" else _READER(path, mode)


@contextlib.contextmanager
def _parsed_once(source: Path) -> Iterator[None]:
    """Within, every read-only GGUFReader of `source` is one parse of it (transformers makes three).

    transformers imports the reader class from `gguf` at each load, so the stand-in is set on the
    module; it stays set, answering for files nobody converts exactly as the class does."""
    parsed = _PlainReader(source, "r")  # seconds of parsing: outside the lock other conversions take
    with _SHARED_LOCK:
        gguf.GGUFReader = _shared_reader
        _SHARED_READERS[os.path.realpath(source)] = parsed
    try:
        yield
    finally:
        with _SHARED_LOCK:
            _SHARED_READERS.pop(os.path.realpath(source), None)  # a second conversion of it may have ended first


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fsync_directory(root)


def _remove_stale_staging(target: Path) -> None:
    """Staging directories of this target left by a crashed conversion (one daemon per data dir)."""
    for stale in target.parent.glob(f"{_STAGING_PREFIX}{target.name}-*"):
        logger.warning("removing stale gguf staging directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _write_plain_model(model: torch.nn.Module, staging: Path) -> None:
    """save_pretrained without GGUF's quantization entry (which would make every load re-read GGUF)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(staging, safe_serialization=True)
    written = json.loads((staging / "config.json").read_text())
    assert "quantization_config" not in written, f"config still names a quantization: {written['quantization_config']}"


def convert_gguf(source: Path, target: Path, *, key: str, board: ProgressBoard) -> None:
    """Write `source`'s model and tokenizer to `target` in Hugging Face layout, atomically.

    Args:
        source: a GGUF file transformers can load.
        target: the directory to publish; must not exist yet.
        key: the name progress is reported under (the base model as clients name it).
        board: where each stage is reported.

    Raises:
        Whatever transformers raises for a file it cannot load; the staging
        directory is removed and `target` is left absent.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    staging = target.parent / f"{_STAGING_PREFIX}{target.name}-{os.getpid()}-{threading.get_ident()}"
    staging.mkdir()
    started = time.monotonic()
    try:
        board.report(key, OPERATION, Stage.READING, 0.0, f"reading tokenizer from {source.name}")
        with _parsed_once(source):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            board.report(key, OPERATION, Stage.CONVERTING, _TOKENIZER_DONE, "dequantizing weights to float32")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(source.parent), gguf_file=source.name, dtype=torch.float32
            )
        n_params = sum(p.numel() for p in model.parameters())
        board.report(key, OPERATION, Stage.WRITING, _WEIGHTS_DONE, f"writing {n_params} parameters as safetensors")
        _write_plain_model(model, staging)
        tokenizer.save_pretrained(staging)
        stat = source.stat()
        record = {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        board.report(key, OPERATION, Stage.PUBLISHING, _WRITTEN, f"publishing {target.name}")
        _fsync_tree(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    board.report(
        key, OPERATION, Stage.READY, 1.0, f"converted in {time.monotonic() - started:.1f} s to {target}"
    )


class GgufConverter:
    """Makes a GGUF entry's directory exist, converting at most once per target."""

    def __init__(self, board: ProgressBoard) -> None:
        self._board = board
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def _lock_for(self, directory: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(directory, threading.Lock())

    def ensure(self, entry: ModelEntry) -> None:
        """Return once `entry.directory` holds a loadable model; convert it first if needed.

        Raises:
            ServerError: the conversion failed; the message names the file and the cause,
                and the board shows `failed` with the same message.
        """
        if is_converted(entry):
            return
        lock = self._lock_for(entry.directory)
        current = self._board.get(entry.name)
        if lock.locked() and (current is None or current.is_final):
            # Another name for the same file is converting it; this name waits for that one.
            self._board.report(entry.name, OPERATION, Stage.QUEUED, 0.0, "waiting for a conversion of the same file")
        with lock:
            if is_converted(entry):
                waited = self._board.get(entry.name)
                if waited is not None and not waited.is_final:  # it reported QUEUED above
                    self._board.report(entry.name, OPERATION, Stage.READY, 1.0, f"converted to {entry.directory}")
                return
            try:
                if entry.gguf_parts and not Path(entry.gguf_file).is_file():
                    self._board.report(
                        entry.name, OPERATION, Stage.READING, 0.0, f"assembling {entry.gguf_file} from its parts"
                    )
                    assemble_gguf(entry)
                convert_gguf(Path(entry.gguf_file), Path(entry.directory), key=entry.name, board=self._board)
            except Exception as exc:  # the boundary: any load failure becomes this request's error
                logger.exception("gguf conversion failed model=%s source=%s", entry.name, entry.gguf_file)
                message = f"converting {entry.gguf_file} failed: {type(exc).__name__}: {exc}"
                self._board.report(entry.name, OPERATION, Stage.FAILED, 0.0, message)
                raise ServerError(f"base_model {entry.name!r}: {message}") from exc
