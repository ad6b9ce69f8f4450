"""Selects fast (interpreted) or production (mypyc-compiled) mode for the whole suite.

``KV_CACHE_MANAGER_V2_MODE=compiled`` imports the package from ``build/compiled`` (built by
``python setup_mypyc.py build --build-lib build/compiled --build-temp build/temp``; another directory with
``KV_CACHE_MANAGER_V2_BUILD_DIR``) and asserts it really is the compiled one; anything else imports the sources.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The real-model tests (tests/test_models_*.py) multiply small matrices; on two cores shared with other work, a
# second OpenBLAS thread made them up to 10x slower (measured). Set before NumPy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
MODE = os.environ.get("KV_CACHE_MANAGER_V2_MODE", "fast")
if MODE not in ("fast", "compiled"):
    raise RuntimeError(f"KV_CACHE_MANAGER_V2_MODE must be 'fast' or 'compiled', got {MODE!r}")
sys.path.insert(0, str(REPO))
if MODE == "compiled":
    sys.path.insert(0, os.environ.get("KV_CACHE_MANAGER_V2_BUILD_DIR", str(REPO / "build" / "compiled")))

import kv_cache_manager_v2  # noqa: E402
from kv_cache_manager_v2._manager import manager as _manager  # noqa: E402

assert kv_cache_manager_v2.COMPILED == (MODE == "compiled"), (
    f"asked for {MODE} mode but imported {_manager.__file__}; build the compiled mode first"
)
if MODE == "compiled":
    assert str(_manager.__file__).endswith(".so"), _manager.__file__
# The parity check compares the compiled build with the sources, so only a compiled run (which has the build) collects
# it: the README's test command, in fast mode on a fresh machine, has nothing to compare and must not skip for it.
collect_ignore = [] if MODE == "compiled" else ["test_mode_parity.py"]

MODE_INDEPENDENT_SKIP = "mode-independent (sources or an install, not the imported package): the fast run covers it"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A compiled run skips the ``mode_independent`` tests: they check the sources or an install (mypy, pyright, AST
    rules), never the imported package, so they answer as in the fast run, which runs them."""
    if MODE != "compiled":
        return
    skip = pytest.mark.skip(reason=MODE_INDEPENDENT_SKIP)
    for item in items:
        if item.get_closest_marker("mode_independent") is not None:
            item.add_marker(skip)
