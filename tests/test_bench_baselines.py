"""The benches' baselines and SDK clients are what a user's own scripts would be: they never import openrld.

A baseline (`bench/_bare_*.py`, `bench/_hf_*.py`) is the loop a researcher writes, and a client
(`bench/_sdk_*.py`) is the real SDK; both run in processes of their own (bench/_daemon.py). The
check reads each script's imports with `ast`, anywhere in the file, and follows the bench helpers
it imports (a module `bench/<name>.py`) to theirs, so that openrld coming in through a helper
counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
BASELINES = sorted([*BENCH.glob("_bare_*.py"), *BENCH.glob("_hf_*.py")])
CLIENTS = sorted(BENCH.glob("_sdk_*.py"))


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports: import statements, and calls of
    `importlib.import_module` or `__import__` with a literal name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value.split(".")[0])
    return names


def reachable_files(script: Path) -> set[Path]:
    """`script` and every module of its folder that it imports, directly or through another."""
    seen: set[Path] = set()
    pending = [script]
    while pending:
        path = pending.pop()
        if path not in seen:
            seen.add(path)
            pending += [script.parent / f"{name}.py" for name in imported_modules(path)
                        if (script.parent / f"{name}.py").exists()]
    return seen


def reachable_imports(script: Path) -> set[str]:
    return set().union(*(imported_modules(path) for path in reachable_files(script)))


def started_scripts(path: Path) -> set[str]:
    """The scripts a bench starts through `_daemon.child` or `_daemon.Child`: their first argument."""
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("child", "Child")
        and node.args and isinstance(node.args[0], ast.Constant)
    }


def test_the_known_baselines_are_found_by_their_prefix() -> None:
    # a subset: a new bench's baseline joins the checks below by its name alone
    assert {"_bare_long_step.py", "_bare_loop.py", "_hf_generate.py"} <= {path.name for path in BASELINES}


def test_the_known_clients_are_found_by_their_prefix() -> None:
    assert {"_sdk_long_steps.py", "_sdk_loop.py"} <= {path.name for path in CLIENTS}


@pytest.mark.parametrize("script", BASELINES, ids=lambda path: path.name)
def test_baseline_never_imports_openrld(script: Path) -> None:
    assert "openrld" not in reachable_imports(script)


@pytest.mark.parametrize("script", CLIENTS, ids=lambda path: path.name)
def test_client_never_imports_openrld(script: Path) -> None:
    assert "openrld" not in reachable_imports(script)


def test_the_bare_loop_is_followed_into_its_helpers() -> None:
    names = {path.name for path in reachable_files(BENCH / "_bare_loop.py")}
    assert names == {"_bare_loop.py", "_lines.py", "_workload.py"}


@pytest.mark.parametrize("bench", ["rl_throughput.py", "sample_throughput.py", "train_throughput.py"])
def test_throughput_bench_starts_a_baseline_and_an_sdk_client(bench: str) -> None:
    started = started_scripts(BENCH / bench)
    assert started == {"_hf_generate.py" if bench == "sample_throughput.py" else "_bare_loop.py", "_sdk_loop.py"}


def test_every_child_a_bench_starts_is_a_baseline_or_a_client() -> None:
    started = set().union(*(started_scripts(path) for path in BENCH.glob("*.py")))
    assert {name for name in started if not name.startswith(("_bare_", "_hf_", "_sdk_"))} == set()


def test_openrld_imported_by_a_helper_inside_a_function_counts(tmp_path: Path) -> None:
    (tmp_path / "_bare_x.py").write_text("import json\nfrom _helper import run\n")
    (tmp_path / "_helper.py").write_text("def run():\n    from openrld.gpu import models\n    return models\n")
    assert reachable_imports(tmp_path / "_bare_x.py") == {"json", "_helper", "openrld"}


def test_openrld_imported_by_name_counts(tmp_path: Path) -> None:
    (tmp_path / "_bare_x.py").write_text("import importlib\nconfig = importlib.import_module('openrld.config')\n")
    assert reachable_imports(tmp_path / "_bare_x.py") == {"importlib", "openrld"}


def test_clean_env_drops_thread_wait_malloc_and_openrld_settings() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from _daemon import clean_env
    finally:
        sys.path.remove(str(BENCH))
    environ = {
        "PATH": "/usr/bin", "HOME": "/root", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2", "KMP_BLOCKTIME": "0", "GOMP_SPINCOUNT": "0",
        "MALLOC_ARENA_MAX": "2", "OPENRLD_CPU_THREADS": "1",
    }
    assert clean_env(environ) == {"PATH": "/usr/bin", "HOME": "/root"}
