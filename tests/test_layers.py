"""The package's layers, checked from its import statements (those made only for types count too).

Every module belongs to the layer of its first package component; it may import from its own subpackage and from
lower layers only, never from a higher layer or from a different package of the same layer (``models`` and ``sim``
are independent applications). No cycle of imports between modules, anywhere. The table is the architecture of
README.md's "Architecture" section; moving a module means moving it here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # reads the sources

PACKAGE = "kv_cache_manager_v2"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Bottom first. The package's own ``__init__`` (the public facade) sits above the core and below the applications,
# which use the manager through it like any user.
LAYERS: dict[str, int] = {
    "_base": 0,
    "config": 1,
    "_model": 2,
    "kernels": 3,
    "_storage": 4,
    "_observe": 5,
    "_pages": 6,
    "_remote": 7,
    "_cache": 8,
    "_manager": 9,
    "_handoff": 10,
    "kv_events": 10,
    "disagg": 11,
    "": 12,  # kv_cache_manager_v2/__init__.py
    "_introspection": 12,  # TensorRT-LLM's inspection module, kept at the top under its upstream name
    "testing": 13,
    "batching": 14,
    "cli": 15,
    "models": 16,
    "sim": 16,
    "__main__": 17,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (a ``from package import name`` that names a submodule counts as
    importing the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets.append((target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            targets.extend((alias.name, []) for alias in node.names)
        for target, names in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            submodules = [f"{target}.{item}" for item in names if f"{target}.{item}" in modules]
            found.update(submodules or [target])
    found.discard(name)
    return found


def layer_key(module: str) -> str:
    inner = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    return inner.split(".")[0]


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({layer_key(name) for name in all_modules()} - set(LAYERS))
    assert unplaced == [], f"add these to LAYERS (and README's Architecture section): {unplaced}"


def test_no_import_reaches_up_or_across() -> None:
    wrong = []
    for module, imports in import_graph().items():
        here = layer_key(module)
        for target in imports:
            there = layer_key(target)
            if there == here:
                continue
            if LAYERS[there] > LAYERS[here]:
                wrong.append(f"{module} imports {target}, a higher layer")
            elif LAYERS[there] == LAYERS[here]:
                wrong.append(f"{module} imports {target}, a peer of the same layer")
    assert wrong == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (import cycles), iterative so deep chains cannot overflow."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, set())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    assert strongly_connected(import_graph()) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert strongly_connected(graph) == expected


def test_no_module_is_over_500_lines() -> None:
    """The package, its tests and tools, and the CUDA sources: one concept per file keeps each under 500 lines."""
    repository = ROOT.parent
    sources = [
        *ROOT.rglob("*.py"),
        *(repository / "tests").rglob("*.py"),
        *(repository / "tools").rglob("*.py"),
        *(repository / "kernels").glob("*.cu*"),
    ]
    long = {
        str(path.relative_to(repository)): lines
        for path in sources
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > 500
    }
    assert long == {}
