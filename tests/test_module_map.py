"""CLAUDE.md's module map stays true: it names every module of the package and every script of ``tools/``, and
every source path it names still exists (a rename or a new module shows here, not in the next session's search)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kv_cache_manager_v2"


def backticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def names_module(names: set[str], relative: str) -> bool:
    """``relative`` (``sim/cli.py``) is named by its path, its file name, or its bare name in a package row."""
    stem = Path(relative).stem
    return bool({relative, Path(relative).name, stem} & names) or any(
        name.startswith(relative + " ") for name in names
    )


def unnamed_modules(claude_md: str) -> list[str]:
    names = backticked(claude_md)
    package = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"]
    tools = [path.relative_to(REPO).as_posix() for path in (REPO / "tools").glob("*.py")]
    missing = [module for module in package if not names_module(names, module)]
    missing += [tool for tool in tools if Path(tool).name not in names and tool not in names]
    return sorted(missing)


def stale_paths(claude_md: str) -> list[str]:
    """Source paths CLAUDE.md names that exist neither in the checkout nor in the package."""
    paths = set(re.findall(r"`((?:[\w.]+/)+[\w.]+\.(?:py|pyi|cu|cuh|md|txt))`", claude_md))
    return sorted(
        path for path in paths if not (REPO / path).exists() and not (PACKAGE / path).exists() and "../" not in path
    )


def test_claude_md_names_every_module_and_tool() -> None:
    assert unnamed_modules((REPO / "CLAUDE.md").read_text(encoding="utf-8")) == []


def test_claude_md_names_no_missing_path() -> None:
    assert stale_paths((REPO / "CLAUDE.md").read_text(encoding="utf-8")) == []


def test_a_module_left_out_is_caught() -> None:
    text = (REPO / "CLAUDE.md").read_text(encoding="utf-8")
    assert "`bench_eviction.py`" in text
    assert "tools/bench_eviction.py" in unnamed_modules(text.replace("`bench_eviction.py`", "bench"))
    assert stale_paths(text + "\n`_pages/no_such_module.py`\n") == ["_pages/no_such_module.py"]
