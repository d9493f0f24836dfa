"""The repository's text points only at what a clone holds.

The engineers' design notes and the Tinker spec excerpts they work from live beside the
repository, not in it; a reader of a clone who is sent to `DESIGN.md` or `losses.md §3.7`
finds nothing. So no product file (the package, recipes, benches, docs, config, the README, the
Makefile) and no test names them: a fact they hold is stated where it is used.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["openrld", "recipes", "bench", "docs", "config", "tests", "README.md", "Makefile"]
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".sh", ""}
# The files outside the repository, by the names the engineers' notes use.
OUTSIDE = re.compile(
    r"shared/spec|shared/DESIGN|DESIGN\.md|STYLE\.md|tinker-protocol|tinker-methods\.txt"
    r"|\b(?:losses|sampling|optimizers|cookbook-usage)\.md\b"
)


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        files += [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return files


def outside_pointers(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def test_the_pattern_finds_each_kind_of_pointer() -> None:
    text = "see shared/spec/x, DESIGN.md, STYLE.md §3, losses.md §1.6 and sampling.md 1.3"
    assert outside_pointers(text) == ["shared/spec", "DESIGN.md", "STYLE.md", "losses.md", "sampling.md"]


def test_no_file_of_the_repository_points_outside_it() -> None:
    this = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}: {hit}"
        for path in scanned_files() if path.resolve() != this
        for hit in outside_pointers(path.read_text(errors="replace"))
    ]
    assert found == []
