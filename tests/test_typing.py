"""The public API's types: ``tests/typing/`` type-checks with ``mypy --strict`` (including the lines that must
fail), and every token sequence form the types accept works at run time, in both modes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import KVCache, KVCacheManager, KVCacheRequest, Token, TokenSequence, _KVCache
from tests.helpers import attention, make_config

REPO = Path(__file__).resolve().parent.parent
TPB = 4


def run_mypy(*paths: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` from the repository root, so ``kv_cache_manager_v2`` is this checkout's sources."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--warn-unused-ignores", "--no-error-summary", *map(str, paths)],
        capture_output=True, text=True, cwd=REPO,
    )


@pytest.mark.mode_independent
def test_typed_usage_checks_with_mypy_strict() -> None:
    """Passes only when the accepted calls type-check and each refused one (a ``str`` as tokens, ...) fails with
    exactly the error code its ``type: ignore`` names."""
    files = sorted((REPO / "tests" / "typing").glob("*.py"))
    assert files
    result = run_mypy(*files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.mode_independent
def test_a_loosened_token_type_fails_the_typed_usage_check(tmp_path: Path) -> None:
    """The check can fail: a call that mypy accepts under a ``type: ignore`` is reported as an unused ignore."""
    probe = tmp_path / "loose.py"
    probe.write_text(
        "from kv_cache_manager_v2 import KVCacheManager\n"
        "def f(manager: KVCacheManager) -> None:\n"
        "    manager.create_kv_cache(None, [1, 2])  # type: ignore[arg-type]\n"
    )
    result = run_mypy(probe)
    assert result.returncode == 1
    assert 'Unused "type: ignore" comment' in result.stdout


DOWNSTREAM = REPO / "tests" / "typing" / "downstream" / "engine.py"


@pytest.mark.mode_independent
def test_downstream_sample_checks_with_mypy_strict_without_ignores() -> None:
    """The engine-shaped sample (issue #39) uses the public API as a strict project would: no ignore comments."""
    assert "type: ignore" not in DOWNSTREAM.read_text()
    result = run_mypy(DOWNSTREAM)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.mode_independent
def test_downstream_sample_checks_with_pyright_strict(tmp_path: Path) -> None:
    """The same sample, copied into a project of its own, under pyright's strict mode with ignore comments
    disabled, against this checkout's sources (``extraPaths``). Needs the ``test`` extra's pyright; CI (``CI``
    set) fails instead of skipping."""
    if importlib.util.find_spec("pyright") is None:
        assert not os.environ.get("CI"), "pyright is missing: the test extra installs pyright[nodejs]"
        pytest.skip("pyright is not installed (the test extra's pyright[nodejs])")
    (tmp_path / DOWNSTREAM.name).write_text(DOWNSTREAM.read_text())
    config = tmp_path / "pyrightconfig.json"
    config.write_text(json.dumps({
        "include": [DOWNSTREAM.name], "extraPaths": [str(REPO)], "typeCheckingMode": "strict",
        "enableTypeIgnoreComments": False, "reportMissingTypeStubs": "error",
    }))
    result = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, "-p", str(config), "--outputjson"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    report = json.loads(result.stdout)
    problems = [f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in report["generalDiagnostics"]]
    assert report["summary"]["filesAnalyzed"] == 1 and problems == [], "\n".join(problems)


def test_public_names_for_the_cache_and_its_tokens() -> None:
    assert _KVCache is KVCache and KVCache.__name__ == "KVCache"
    assert kv_cache_manager_v2.Token is Token and kv_cache_manager_v2.TokenSequence is TokenSequence
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=TPB))
    cache = manager.create_kv_cache(None, [1, 2, 3])
    assert isinstance(cache, KVCache) and repr(cache).startswith("KVCache(id=")
    cache.close()
    manager.shutdown()


def test_the_config_signatures_unions_are_public_at_the_top() -> None:
    """``KVCacheManagerConfig(layers: list[LayerConfig], cache_tiers: list[CacheTierConfig])``: an engine annotating
    the lists it builds imports both names from where it imports the config."""
    from kv_cache_manager_v2 import config

    assert kv_cache_manager_v2.LayerConfig is config.LayerConfig
    assert kv_cache_manager_v2.CacheTierConfig is config.CacheTierConfig
    tiers: list[kv_cache_manager_v2.CacheTierConfig] = [kv_cache_manager_v2.GpuCacheTierConfig(1 << 20)]
    layers: list[kv_cache_manager_v2.LayerConfig] = [attention(0)]
    manager = KVCacheManager(kv_cache_manager_v2.KVCacheManagerConfig(tokens_per_block=TPB, layers=layers,
                                                                      cache_tiers=tiers))
    manager.shutdown()


ACCEPTED: list[tuple[str, TokenSequence]] = [
    ("list", list(range(100, 110))),
    ("tuple", tuple(range(100, 110))),
    ("range", range(100, 110)),
    ("array('q')", array("q", range(100, 110))),
    ("int64 array", np.arange(100, 110, dtype=np.int64)),
    ("int32 array", np.arange(100, 110, dtype=np.int32)),
    ("uint16 array", np.arange(100, 110, dtype=np.uint16)),
    ("NumPy ints in a list", [np.int64(token) for token in range(100, 110)]),  # type: ignore[misc]
]


@pytest.mark.parametrize("form", [tokens for _, tokens in ACCEPTED], ids=[name for name, _ in ACCEPTED])
def test_every_typed_token_form_is_accepted_at_run_time(form: TokenSequence) -> None:
    """The same ten tokens in each form give the same reuse, commits and batch requests as a list of ints."""
    manager = KVCacheManager(make_config([attention(0)], tokens_per_block=TPB))
    first = manager.create_kv_cache(None, form)
    assert first.resume() and first.resize(10)
    first.commit(form)
    first.close()
    # close() published the trailing partial block too: all ten tokens are reusable.
    assert manager.probe_reuse(None, form) == manager.probe_reuse(None, list(range(100, 110))) == 10
    second = manager.create_kv_cache(None, form)
    assert second.num_committed_tokens == 10
    second.close()
    [batched] = manager.create_kv_cache_batch([KVCacheRequest(form, capacity=12)])
    assert batched is not None and batched.num_committed_tokens == 10 and batched.capacity == 12
    batched.close()
    multimodal: list[Token] = [b"digest", *range(100, 109)]
    assert manager.probe_reuse(None, multimodal) == 0
    manager.shutdown()
