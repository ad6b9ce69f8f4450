"""No module of the package reaches into another object's private attributes (``obj._name``): only ``self`` and
``cls`` may be followed by an underscore name; dunder names are fine. Cross-module needs go through named
internal APIs (see CLAUDE.md, "Internal APIs").

One exception, the module that owns a class: a function whose parameter is annotated with a class defined in the
same module may read that parameter's private attributes (``internals_of(manager: ManagerCore)`` in the module
of ``ManagerCore``). That is how a class hands its internal collaborators to the rest of the package through one
named function without making them names on the public object."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # reads the sources

PACKAGE = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"
OWN = ("self", "cls")


def own_class_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, own_classes: set[str]) -> set[str]:
    """Parameters of ``function`` annotated with exactly one of ``own_classes`` (a bare name or its string)."""
    names: set[str] = set()
    arguments = function.args
    for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
        annotation = argument.annotation
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotated = annotation.value
        elif isinstance(annotation, ast.Name):
            annotated = annotation.id
        else:
            continue
        if annotated in own_classes:
            names.add(argument.arg)
    return names


def private_accesses(source: str, filename: str) -> list[str]:
    """``file:line: expression`` of every ``x._name`` in ``source`` whose ``x`` is not ``self``, ``cls`` or a
    parameter annotated with a class this module defines."""
    tree = ast.parse(source, filename)
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found: list[str] = []

    def visit(node: ast.AST, allowed: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A nested function's own parameters shadow the outer ones.
            shadowed = {argument.arg for argument in ast.walk(node.args) if isinstance(argument, ast.arg)}
            allowed = frozenset((allowed - shadowed) | own_class_parameters(node, own_classes))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            dunder = node.attr.startswith("__") and node.attr.endswith("__")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if not dunder and owner not in OWN and owner not in allowed:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, allowed)

    visit(tree, frozenset())
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_the_package_has_no_private_reach_through() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40  # the scan really sees the package
    found: list[str] = []
    for path in files:
        found.extend(private_accesses(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent))))
    assert found == []


def test_the_scan_catches_reach_through_and_allows_own_and_dunder_names() -> None:
    source = "def f(cache, self, cls):\n    cache._pages\n    self._pages\n    cls._registry\n    cache.__class__\n    a.b._c\n"
    assert private_accesses(source, "x.py") == ["x.py:2: cache._pages", "x.py:6: a.b._c"]


def test_a_module_may_read_private_attributes_only_of_parameters_typed_with_its_own_classes() -> None:
    source = (
        "class Core:\n    pass\n"
        "def internals_of(core: Core, other: Other, text: 'Core') -> X:\n"
        "    core._internals\n    other._internals\n    text._internals\n"
        "    def inner(core):\n        core._shadowed\n"
        "    y = core\n    y._aliased\n"
        "def later(value):\n    value._kept\n"
        "def optional(core: Core | None):\n    core._union\n"
    )
    assert private_accesses(source, "x.py") == [
        "x.py:5: other._internals",
        "x.py:8: core._shadowed",
        "x.py:10: y._aliased",
        "x.py:12: value._kept",
        "x.py:14: core._union",
    ]
