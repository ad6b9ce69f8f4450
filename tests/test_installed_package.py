"""The package as a user's code sees it after an editable install of this checkout, whichever is installed now:
``mypy --strict`` on a script outside the repository finds its types, and the installed package finds its CUDA
sources. ``.ci/run`` runs it after the README's install (setuptools' strict editable mode) and again after a
default ``pip install -e .``; a compiled run skips it (``mode_independent``: the install is of the sources).

Runs only where this checkout is installed editable in the running interpreter's environment (CI's fresh venv
does so with the README's command); elsewhere (not installed, or installed from another directory) it skips
with the reason, unless ``KV_CACHE_MANAGER_V2_REQUIRE_INSTALL=1`` (set by ``.ci/run``) makes that a failure. The check runs from an empty directory with no ``PYTHONPATH``/``MYPYPATH``, so the installed
package is the only way mypy and Python can find ``kv_cache_manager_v2``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent

REPO = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("KV_CACHE_MANAGER_V2_REQUIRE_INSTALL", "") not in ("", "0")

USER_SCRIPT = '''\
from typing import assert_type

from kv_cache_manager_v2 import (AttentionLayerConfig, BufferConfig, GpuCacheTierConfig, KVCache, KVCacheManager,
                                 KVCacheManagerConfig)


def serve(prompt: list[int]) -> int:
    layers = [AttentionLayerConfig(0, [BufferConfig("key", 4096), BufferConfig("value", 4096)])]
    manager = KVCacheManager(KVCacheManagerConfig(tokens_per_block=16, layers=layers, backend="cpu",
                                                  cache_tiers=[GpuCacheTierConfig(1 << 20)]))
    cache = assert_type(manager.create_kv_cache(None, prompt), KVCache)
    manager.create_kv_cache(None, "not tokens")  # type: ignore[arg-type]
    return cache.capacity
'''


def clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MYPYPATH")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def outside(tmp_path: Path, code: str) -> str:
    """Stdout of ``code`` run from an empty directory; a failure names the fix (a strict editable install's links
    live in ``build/__editable__*`` and cover only the modules that existed at install time)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, f"{result.stderr}\n(reinstall with the README's test command)"
    return result.stdout


@pytest.fixture
def editable_install_of_this_checkout(tmp_path: Path) -> None:
    """Skip unless the running environment has this checkout installed editable."""
    found = outside(
        tmp_path,
        "import importlib.metadata as m\n"
        "try:\n"
        "    print(m.distribution('kv_cache_manager_v2').read_text('direct_url.json') or '{}')\n"
        "except m.PackageNotFoundError:\n"
        "    print('null')\n",
    )
    direct_url = json.loads(found)
    reason = None
    if direct_url is None:
        reason = "kv_cache_manager_v2 is not installed in this environment"
    else:
        location = str(direct_url.get("url", ""))
        if location != REPO.as_uri() or not direct_url.get("dir_info", {}).get("editable", False):
            reason = f"kv_cache_manager_v2 is installed from {location or 'an index'}, not editable from {REPO}"
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"{reason} (KV_CACHE_MANAGER_V2_REQUIRE_INSTALL is set)")
        pytest.skip(reason)


@pytest.mark.usefixtures("editable_install_of_this_checkout")
def test_mypy_strict_on_user_code_finds_the_installed_package(tmp_path: Path) -> None:
    script = tmp_path / "user_code.py"
    script.write_text(USER_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(script)],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.usefixtures("editable_install_of_this_checkout")
def test_the_installed_package_finds_its_cuda_sources(tmp_path: Path) -> None:
    found = outside(
        tmp_path,
        "import os, kv_cache_manager_v2\n"
        "from kv_cache_manager_v2.kernels._source import kernel_directory\n"
        "print(os.path.realpath(kv_cache_manager_v2.__file__))\n"
        "print(kernel_directory())\n",
    ).splitlines()
    assert Path(found[0]).is_relative_to(REPO)  # the install imports this checkout's sources
    assert (Path(found[1]) / "page_copy.cu").is_file()
