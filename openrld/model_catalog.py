"""Which base models this node can serve, and where their files are.

A client names a base model by a Hugging Face id, a name from the node config's
`[models]` table, or a local directory. This module turns that name into a
`ModelEntry` with a local directory in Hugging Face layout, or refuses it with
a 400 that says why. It reads the filesystem only (the Hugging Face cache with
`local_files_only`, so nothing is ever downloaded at request time) and never
imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from openrld.errors import BadRequest


class ModelEntry(msgspec.Struct, frozen=True):
    name: str  # as the client names it; also the tokenizer id the SDK loads
    directory: str  # absolute path of the HF-layout directory
    arch: str
    max_context: int


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


class ModelCatalog:
    """Name -> ModelEntry, from the config table, local directories and the HF cache."""

    def __init__(self, configured: dict[str, str], *, allow_local_paths: bool = True) -> None:
        self._configured = dict(configured)
        self._allow_local_paths = allow_local_paths
        self._cache: dict[str, ModelEntry] = {}

    def configured(self) -> list[ModelEntry]:
        """The models this node lists in get_server_capabilities."""
        entries = []
        for name in self._configured:
            try:
                entries.append(self.resolve(name))
            except BadRequest:
                continue  # a configured model whose files are missing is not served
        return entries

    def resolve(self, name: str) -> ModelEntry:
        if not name or len(name) > 1024 or "\x00" in name:
            raise BadRequest(f"base_model: expected a model name or directory, got {name!r}")
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        if name in self._configured:
            entry = _describe(name, Path(self._configured[name]))
        elif self._allow_local_paths and Path(name).is_dir():
            entry = _describe(name, Path(name))
        else:
            snapshot = _from_hf_cache(name)
            if snapshot is None:
                served = ", ".join(sorted(self._configured)) or "none configured"
                raise BadRequest(
                    f"base_model {name!r} is not served by this node: it is not in the node's "
                    f"[models] table ({served}), not a local model directory, and not in the "
                    f"Hugging Face cache (this node never downloads at request time)"
                )
            entry = _describe(name, snapshot)
        self._cache[name] = entry
        return entry
