"""The applications on top of the manager stay untangled: ``sim`` and ``models`` never import each other; both
may use ``batching`` and ``cli``'s shared parts, which import neither; only ``__main__.py`` sees both apps."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kv_cache_manager_v2"


def imported_packages(path: Path) -> set[str]:
    """The first component below ``kv_cache_manager_v2`` of every module ``path`` imports (relative or not)."""
    found: set[str] = set()
    depth = len(path.relative_to(PACKAGE).parts) - 1  # how many folders below the package
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0:
                names = [module]
            elif node.level == depth + 1:  # relative to the package root
                names = [f"kv_cache_manager_v2.{module}" if module else "kv_cache_manager_v2"]
                if not module:
                    names += [f"kv_cache_manager_v2.{alias.name}" for alias in node.names]
            else:
                names = [f"kv_cache_manager_v2.{path.relative_to(PACKAGE).parts[0]}"]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kv_cache_manager_v2" and len(parts) > 1:
                found.add(parts[1])
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("sim", {"models"}),
        ("models", {"sim"}),
        ("batching", {"sim", "models", "cli"}),
    ],
)
def test_an_app_does_not_import_the_other(package: str, forbidden: set[str]) -> None:
    for path in modules_of(package):
        wrong = imported_packages(path) & forbidden
        assert not wrong, f"{path.relative_to(PACKAGE)} imports {sorted(wrong)}"


def test_only_the_command_lines_top_imports_the_apps() -> None:
    assert {"sim", "models"} <= imported_packages(PACKAGE / "__main__.py")
    for path in modules_of("cli"):
        wrong = imported_packages(path) & {"sim", "models", "batching"}
        assert not wrong, f"{path.relative_to(PACKAGE)} imports {sorted(wrong)}"


def test_the_batcher_uses_the_public_api() -> None:
    """Private modules only where no public name exists (argument checks)."""
    for path in modules_of("batching"):
        private = {name for name in imported_packages(path) if name.startswith("_")}
        assert private <= {"_base"}, f"{path.relative_to(PACKAGE)} imports {sorted(private)}"
