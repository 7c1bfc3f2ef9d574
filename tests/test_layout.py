"""The layout of ssu-core and the backends: every import goes down the layers of
docs/architecture.md, no module reaches back to one that imports it, and the old module paths
still give the modules at their new places."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

import ssu
from ssu._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core" / "ssu"
#: the packages of ssu-core, lowest first; a module imports only from its own package or from a
#: lower one (docs/architecture.md, "Layers")
LAYERS = {
    "ssu._moved": 0,
    "ssu.contract": 1,
    "ssu.state": 2,
    "ssu.measure": 2,
    "ssu.plugins": 3,
    "ssu.runtime": 4,
    "ssu.reference": 5,
    "ssu.dropin": 5,
    "ssu.checking": 5,
    "ssu.conformance": 6,
    "ssu.integrations": 6,
    "ssu.quality": 6,
    "ssu.testing": 7,
    "ssu.bench": 7,
    "ssu.cli": 8,
    "ssu": 9,
    "ssu.__main__": 9,
}
#: the backends' import packages, each its own house
BACKENDS = {
    "ssu_backend_triton": ROOT / "backends" / "triton_ssu" / "ssu_backend_triton",
    "ssu_backend_flashinfer": ROOT / "backends" / "flashinfer_ssu" / "ssu_backend_flashinfer",
    "ssu_backend_flashinfer_replayssm": ROOT / "backends" / "flashinfer_replayssm" / "ssu_backend_flashinfer_replayssm",
}


def _modules(package: str, folder: Path) -> dict[str, Path]:
    found = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def _imports(module: str, path: Path, known: dict) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its file (lazy imports and
    imports for type checking included: each is a dependency all the same)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from package import module`` needs the module; ``from module import name``, the module
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != module:
                found.add(target)
    return found


def _graph(package: str, folder: Path) -> dict[str, set[str]]:
    known = _modules(package, folder)
    return {module: _imports(module, path, known) for module, path in known.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    circles = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _package(module: str) -> str:
    """The package of ``LAYERS`` a module belongs to."""
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return module


@pytest.mark.parametrize("package", ["ssu", *BACKENDS])
def test_no_module_imports_one_that_imports_it(package):
    graph = _graph(package, CORE if package == "ssu" else BACKENDS[package])
    assert _circles(graph) == []


def test_the_triton_backend_imports_nothing_of_triton_replay():
    """``ssu_backend_triton`` holds the ``triton`` backend and what both share; ``replay`` builds on it."""
    graph = _graph("ssu_backend_triton", BACKENDS["ssu_backend_triton"])
    replay = "ssu_backend_triton.replay"
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if not (module + ".").startswith(replay + ".")
        for target in sorted(targets)
        if (target + ".").startswith(replay + ".")
    ]
    assert any(module.startswith(replay + ".") for module in graph) and upward == []


def test_every_import_goes_down_the_layers():
    graph = _graph("ssu", CORE)
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if _package(module) != _package(target) and LAYERS[_package(target)] >= LAYERS[_package(module)]
    ]
    assert upward == []


def test_every_package_of_the_core_has_a_layer_and_says_its_job():
    packages = sorted(
        "ssu." + path.parent.name for path in CORE.glob("*/__init__.py") if path.parent.name != "__pycache__"
    )
    assert [p for p in packages if p not in LAYERS] == []
    for package in packages:
        doc = importlib.import_module(package).__doc__
        assert doc and doc.splitlines()[0].strip().endswith("."), f"{package}: no one-line docstring of its job"
    assert [path.name for path in CORE.glob("*.py")] and sorted(path.name for path in CORE.glob("*.py")) == [
        "__init__.py",
        "__main__.py",
        "_moved.py",
    ]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_gives_the_module_at_its_new_place(old):
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]
    assert getattr(ssu, old.split(".")[1]) is module
    assert not (CORE / (old.split(".")[1] + ".py")).exists()


def test_the_paths_third_parties_use_are_where_they_were():
    from ssu.contract import CommitFn, PackedStepFn, StepFn, VerifyStepFn, check_step  # noqa: F401
    from ssu.dropin import selective_state_update
    from ssu.testing import assert_conformant  # noqa: F401

    assert ssu.selective_state_update is selective_state_update
    assert callable(ssu.hookimpl)


def _python_files():
    for top in ("core", "backends", "tests", "benchmarks", "scripts"):
        for path in (ROOT / top).rglob("*.py"):
            if ".device" not in path.parts and "dist" not in path.parts:
                yield path


def test_the_repository_uses_no_old_module_path():
    old = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            old += [f"{os.path.relpath(path, ROOT)}: {n}" for n in names if n in MOVED]
    assert old == []
