"""docs/architecture.md names every module of openrld/, each where it belongs.

A module at the top (`openrld/ids.py`) is named in the layer tree, the code block at the top of
the page; a module of a layer (`openrld/actors/jobs.py`, `openrld/actors/membership/node.py`) is
named in that layer's bullet ("- **actors/**") by its path below the layer (`jobs.py`,
`membership/node.py`), so that `peer_client.py` names `actors/peer_client.py` and not
`actors/membership/peer_client.py`. Package `__init__.py` files are left out: a package is
named by its directory.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> list[tuple[str, ...]]:
    """Every module of openrld/ but the packages' __init__.py, as its path parts below openrld/."""
    package = ROOT / "openrld"
    return sorted(p.relative_to(package).parts for p in package.rglob("*.py") if p.name != "__init__.py")


def unnamed(doc: str, paths: list[tuple[str, ...]]) -> list[str]:
    """The modules `doc` does not name where they belong, as paths below openrld/."""
    tree = doc.split("```")[1]  # the layer tree, the page's first code block
    missing = []
    for parts in paths:
        text = tree if len(parts) == 1 else _layer_bullet(doc, parts[0])
        name = "/".join(parts[1:]) or parts[0]
        # Not inside a longer path: `membership/peer_client.py` does not name `peer_client.py`.
        if re.search(r"(?<![\w/])" + re.escape(name), text) is None:
            missing.append("/".join(parts))
    return missing


def _layer_bullet(doc: str, layer: str) -> str:
    """The text of "- **<layer>/**", up to the next bullet at the start of a line or heading."""
    match = re.search(rf"^- \*\*{re.escape(layer)}/\*\*(.*?)(?=^- |^#|\Z)", doc, re.S | re.M)
    return match.group(1) if match else ""


def test_architecture_md_names_every_module_where_it_belongs():
    assert unnamed(ARCHITECTURE.read_text(), modules()) == []


def test_a_module_is_named_by_its_path_below_its_layer_in_that_layers_bullet():
    doc = (
        "```\nopenrld/\n  ids.py  ids\n```\n"
        "- **actors/** `jobs.py`, and gossip's own `membership/peer_client.py`.\n"
        "- **store/** `sessions.py`.\n"
    )
    paths = [("ids.py",), ("actors", "jobs.py"), ("actors", "peer_client.py"), ("actors", "membership", "peer_client.py"),
             ("actors", "sessions.py"), ("store", "sessions.py"), ("cli.py",)]
    assert unnamed(doc, paths) == ["actors/peer_client.py", "actors/sessions.py", "cli.py"]
