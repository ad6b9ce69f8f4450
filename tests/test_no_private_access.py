"""No module of the package reaches into another object's private attributes (``obj._name``): only ``self`` and
``cls`` may be followed by an underscore name; dunder names are fine. Cross-module needs go through named
internal APIs (see CLAUDE.md, "Internal APIs")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"
OWN = ("self", "cls")


def private_accesses(source: str, filename: str) -> list[str]:
    """``file:line: expression`` of every ``x._name`` in ``source`` whose ``x`` is not ``self`` or ``cls``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in OWN:
            continue
        found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


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
