"""Package-level facts: the mode in use, the public surface, the ``python -m kv_cache_manager_v2`` entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2.config import manager_config
from kv_cache_manager_v2._manager import manager as manager_module

REPO = Path(__file__).resolve().parent.parent


def test_compiled_flag_matches_the_imported_modules() -> None:
    compiled = os.environ.get("KV_CACHE_MANAGER_V2_MODE", "fast") == "compiled"
    assert kv_cache_manager_v2.COMPILED is compiled
    assert str(manager_module.__file__).endswith(".so") is compiled
    assert str(manager_config.__file__).endswith(".so") is compiled


def test_only_a_compiled_run_skips_the_mode_independent_tests(request: pytest.FixtureRequest) -> None:
    """``tests/conftest.py`` skips them compiled, saying why; the fast run must run them, as nothing else does."""
    marked = [item for item in request.session.items if item.get_closest_marker("mode_independent") is not None]
    if not marked:
        pytest.skip("this run collected no mode_independent test")
    skipped = [
        item for item in marked
        if any("the fast run covers it" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skip"))
    ]
    assert len(skipped) == (len(marked) if kv_cache_manager_v2.COMPILED else 0), (len(skipped), len(marked))


def test_public_names_are_importable_from_the_package() -> None:
    for name in ("KVCacheManager", "KVCacheManagerConfig", "PageIndexConverter", "ScratchDesc", "HalfOpenRange",
                 "OutOfPagesError", "PageIndexMode", "GPU_LEVEL", "BAD_PAGE_INDEX", "DEFAULT_BEAM_INDEX"):
        assert hasattr(kv_cache_manager_v2, name), name
    assert issubclass(kv_cache_manager_v2.OutOfPagesError, MemoryError)
    assert kv_cache_manager_v2.BAD_PAGE_INDEX == -1


def test_simulate_prints_the_planned_layout(tmp_path: Path) -> None:
    """Runs from an empty directory: from the repository root, ``-m`` would import the sources even in compiled mode."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    result = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--gpu-mib", "64",
         "--host-mib", "0", "--requests", "4"],
        capture_output=True, text=True, env=env, check=True, cwd=tmp_path,
    )
    assert "pool group 1" in result.stdout and "layer group 1" in result.stdout
    assert ("compiled" if kv_cache_manager_v2.COMPILED else "interpreted") in result.stdout  # the same mode ran
