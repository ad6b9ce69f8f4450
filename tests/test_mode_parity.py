"""Interpreted and compiled mode answer alike: ``tools/mode_parity.py``'s scenarios, short, one subprocess per mode
each, every return value compared with its type, every exception with its message (mypyc's own ``TypeError`` for
a wrong concrete type is the one accepted difference, ``tests/test_bad_inputs.py``). Collected only in compiled mode
(``tests/conftest.py``), whose build (``build/compiled`` or ``KV_CACHE_MANAGER_V2_BUILD_DIR``) it compares; skipped
outside CI when that build is older than the sources (a source differing from the build's copy: rebuild it)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tools.mode_parity import SCENARIOS, check_scenario, compare, compiled_dir
from tools.parity.describe import describe

REPO = Path(__file__).resolve().parent.parent


def compiled_build_is_stale() -> bool:
    """A source differs from the copy the build put beside its compiled module (or has none there)."""
    root = REPO / "kv_cache_manager_v2"
    built = compiled_dir() / "kv_cache_manager_v2"
    return any(
        not (built / path.relative_to(root)).is_file() or (built / path.relative_to(root)).read_bytes() != path.read_bytes()
        for path in root.rglob("*.py")
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_both_modes_answer_alike(scenario: str) -> None:
    if compiled_build_is_stale() and not os.environ.get("CI"):
        pytest.skip(f"the compiled build under {compiled_dir()} is older than a source: rebuild it")
    differences = check_scenario(scenario, ["--seed", "0", "--operations", "200"])
    assert differences == [], "\n".join(differences)


def test_the_comparison_sees_types_and_accepts_only_mypycs_type_error() -> None:
    """The check can fail: a NumPy bool for a bool, a list for a tuple, another message; mypyc's wording of a
    TypeError is accepted only where the interpreted mode raised a TypeError too."""
    assert describe(True) != describe(np.bool_(True)) and describe(3) != describe(np.int64(3))
    assert describe((1, 2)) != describe([1, 2])
    same: list[object] = [["call", ["returned", describe(True)]]]
    assert compare(same, same) == []
    assert compare(same, [["call", ["returned", describe(np.bool_(True))]]]) != []
    fast: list[object] = [["call", ["raised", "builtins.TypeError", "role must be a str, got 1"]]]
    by_mypyc: list[object] = [["call", ["raised", "builtins.TypeError", "str object expected; got int"]]]
    value_error: list[object] = [["call", ["raised", "builtins.ValueError", "bad role"]]]
    other_message: list[object] = [["call", ["raised", "builtins.TypeError", "role must be a str, got 2"]]]
    assert compare(fast, by_mypyc) == []
    assert compare(value_error, by_mypyc) != [] and compare(fast, other_message) != []
