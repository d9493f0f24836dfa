"""The boundary between actors and engines: actors import nothing of torch or `openrld.gpu`,
and every engine implements its typed interface (`openrld/engine_types.py`) member for member.
Between the engines and the worker the import arrow points one way, worker -> gpu: no module
of `openrld/gpu/` imports `openrld.worker` (an engine takes decoded payloads; the worker decodes).

The import check reads the source (`ast`), so an import inside a function, which runs only
on some code path, fails it as surely as one at the top. The interface check compares each
engine class with its Protocol by name, kind (method or property) and parameter names, so
an engine that drifts from what the actors call fails here, before an actor meets it.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from openrld import engine_types
from openrld.gpu.automodel_trainer import AutomodelTrainer
from openrld.gpu.full_sampler import FullSampler
from openrld.gpu.full_trainer import FullTrainer
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer
from openrld.gpu.vllm_sampler import VllmSampler
from openrld.worker.base import SamplerWorker, TrainerWorker
from openrld.worker.client import RemoteSampler, RemoteTrainer

ACTORS = Path(__file__).resolve().parents[1] / "openrld" / "actors"
GPU = ACTORS.parent / "gpu"
FORBIDDEN = ("torch", "openrld.gpu")
ENGINES = [
    (engine_types.TrainerEngine, TorchTrainer),
    (engine_types.TrainerEngine, FullTrainer),
    (engine_types.TrainerEngine, RemoteTrainer),
    (engine_types.TrainerEngine, AutomodelTrainer),
    (engine_types.TrainerEngine, TrainerWorker),
    (engine_types.SamplerEngine, TorchSampler),
    (engine_types.SamplerEngine, FullSampler),
    (engine_types.SamplerEngine, VllmSampler),
    (engine_types.SamplerEngine, RemoteSampler),
    (engine_types.SamplerEngine, SamplerWorker),
]


def package_of(path: Path) -> str:
    """The package a module under openrld/ belongs to (what a relative import starts from)."""
    parts = path.relative_to(ACTORS.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in `source`, wherever it stands; relative ones resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from openrld import gpu` imports openrld.gpu: name each imported thing too.
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names] + [(node.lineno, base)]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            found += [(node.lineno, arg.value) for arg in node.args[:1] if isinstance(arg, ast.Constant)]
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def is_forbidden(module: str, roots: tuple[str, ...] = FORBIDDEN) -> bool:
    return any(module == root or module.startswith(f"{root}.") for root in roots)


def offences(directory: Path, roots: tuple[str, ...]) -> list[str]:
    """Every import of `roots` in a module under `directory`, as "path:line imports module"."""
    return [
        f"{path.relative_to(ACTORS.parent.parent)}:{line} imports {module}"
        for path in sorted(directory.rglob("*.py"))
        for line, module in imported_modules(path.read_text(), package_of(path))
        if is_forbidden(module, roots)
    ]


def protocol_members(protocol: type) -> dict[str, object]:
    """The members a Protocol declares, its own and those of the Protocols it extends."""
    members: dict[str, object] = {}
    for layer in reversed(protocol.__mro__):
        if layer.__module__ in ("builtins", "typing"):  # object, Protocol, Generic
            continue
        members.update((name, value) for name, value in vars(layer).items() if not name.startswith("_"))
    return members


def drift(protocol: type, engine: type) -> list[str]:
    """How `engine` differs from `protocol`: missing members, wrong kinds, other parameter names."""
    problems: list[str] = []
    for name, wanted in protocol_members(protocol).items():
        try:
            found = inspect.getattr_static(engine, name)
        except AttributeError:
            problems.append(f"{name}: missing")
            continue
        if isinstance(wanted, property):
            if not isinstance(found, property):
                problems.append(f"{name}: a property in {protocol.__name__}, not in {engine.__name__}")
            continue
        if not callable(found) or isinstance(found, (property, staticmethod, classmethod)):
            problems.append(f"{name}: a method in {protocol.__name__}, a {type(found).__name__} here")
            continue
        want = list(inspect.signature(wanted).parameters)  # type: ignore[arg-type]
        have = list(inspect.signature(found).parameters)
        if want != have:
            problems.append(f"{name}: parameters {have}, expected {want}")
    return problems


def test_no_actor_module_imports_torch_or_gpu_anywhere_in_it():
    paths = sorted(ACTORS.rglob("*.py"))
    assert len(paths) > 10, f"found only {len(paths)} actor modules under {ACTORS}"
    assert offences(ACTORS, FORBIDDEN) == []


def test_no_gpu_module_imports_the_worker_anywhere_in_it():
    paths = sorted(GPU.rglob("*.py"))
    assert len(paths) > 10, f"found only {len(paths)} gpu modules under {GPU}"
    assert offences(GPU, ("openrld.worker",)) == []


@pytest.mark.parametrize(
    "source",
    [
        "from openrld.worker.values import local_payload",
        "def f():\n    from openrld.worker import builtin",
        "from openrld import worker",
        "from ..worker import hosting",
    ],
    ids=["top-level", "inside-a-function", "from-package", "relative"],
)
def test_the_gpu_import_check_catches(source):
    imports = [module for _, module in imported_modules(source, "openrld.gpu")]
    assert any(is_forbidden(module, ("openrld.worker",)) for module in imports), imports


def test_gpu_modules_import_without_loading_the_worker():
    code = (
        "import importlib, pkgutil, sys, openrld.gpu as gpu\n"
        "for m in pkgutil.walk_packages(gpu.__path__, 'openrld.gpu.'): importlib.import_module(m.name)\n"
        "print(sorted(k for k in sys.modules if k.startswith('openrld.worker')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "source",
    [
        "import torch",
        "def f():\n    from openrld.gpu.full_io import load_sampler_weights",
        "from openrld import gpu",
        "from ..gpu import peft_export",
        "import importlib\nimportlib.import_module('openrld.gpu.peft_export')",
    ],
    ids=["top-level", "inside-a-function", "from-package", "relative", "import_module"],
)
def test_the_import_check_catches(source):
    imports = [module for _, module in imported_modules(source, "openrld.actors")]
    assert any(is_forbidden(module) for module in imports), imports


def test_actors_import_without_loading_torch():
    code = (
        "import importlib, pkgutil, sys, openrld.actors as actors\n"
        "for m in pkgutil.walk_packages(actors.__path__, 'openrld.actors.'): importlib.import_module(m.name)\n"
        "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('openrld.gpu')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("protocol, engine", ENGINES, ids=[engine.__name__ for _, engine in ENGINES])
def test_engine_implements_its_protocol(protocol, engine):
    assert drift(protocol, engine) == []


def test_the_interface_check_catches_a_drifting_engine():
    class Drifted:
        def load_version(self, version, tensors, spec): ...  # renamed parameter
        def step(self): ...
        last_sync = None  # not a property
        @property
        def close(self): ...  # a property where a method is wanted

    problems = drift(engine_types.SamplerEngine, Drifted)
    assert "load_version: parameters ['self', 'version', 'tensors', 'spec'], expected " \
        "['self', 'version', 'payload', 'spec']" in problems
    assert "last_sync: a property in SamplerEngine, not in Drifted" in problems
    assert "close: a method in SamplerEngine, a property here" in problems
    assert "has_work: missing" in problems and "step: missing" not in problems


def test_protocols_name_exactly_what_the_actors_call():
    trainer = set(protocol_members(engine_types.TrainerEngine))
    sampler = set(protocol_members(engine_types.SamplerEngine))
    assert trainer == {
        "add_adapter", "drop_adapter", "has_adapter", "forward_backward", "forward_backward_many",
        "forward_backward_then_step", "optim_step", "adapter_tensors", "sampler_payload", "export_adapter",
        "sampler_checkpoint", "save_state", "snapshot_state", "load_state", "park", "resume", "is_parked", "last_sync",
        "close",
    }
    assert sampler == {
        "load_version", "load_checkpoint", "drop_version", "versions_in_use", "add", "cancel", "has_work", "step",
        "park", "resume", "is_parked", "last_sync", "close",
    }
