"""CLAUDE.md's module map stays true: it names every module of the package and every script of ``tools/``, and
every source path and code name it names still exists (a rename or a new module shows here, not in the next
session's search)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # reads CLAUDE.md and the sources

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


# Names CLAUDE.md takes from outside the repository: an environment variable of UCX, a libnl symbol, typing's.
OUTSIDE_NAMES = {"UCX_TLS", "rtnl_tc_unregister", "runtime_checkable"}


def repository_text() -> str:
    """The sources a name in CLAUDE.md may come from, and the file names under them (``test_readme``)."""
    roots = [REPO / name for name in ("kv_cache_manager_v2", "tests", "tools", "kernels")]
    files = [path for root in roots for path in root.rglob("*") if path.suffix in (".py", ".pyi", ".cu", ".cuh")]
    files += [REPO / "setup_mypyc.py", REPO / "pyproject.toml", REPO / ".ci" / "run"]
    return "\n".join([path.read_text(encoding="utf-8") for path in files] + [path.stem for path in files])


def unknown_identifiers(claude_md: str, sources: str) -> list[str]:
    """Code names (``snake_case`` with an inner underscore, ``CamelCase``, ``UPPER_CASE``) CLAUDE.md puts in
    backticks that no source file contains: a renamed or removed function, class or constant."""
    names = set()
    for quoted in backticked(claude_md):
        for name in re.findall(r"[A-Za-z_]\w*", quoted):
            if len(name) > 3 and ("_" in name.strip("_") or re.match(r"[A-Z][a-z]+[A-Z]", name)):
                names.add(name)
    return sorted(name for name in names - OUTSIDE_NAMES if name not in sources)


def test_claude_md_names_only_existing_identifiers() -> None:
    sources = repository_text()
    assert unknown_identifiers((REPO / "CLAUDE.md").read_text(encoding="utf-8"), sources) == []
    made_up = "_".join(["never", "defined", "anywhere"])  # not spelled out: this file is one of the sources
    assert unknown_identifiers(f"`PageStore.{made_up}`, `PageStore.flush`", sources) == [made_up]
