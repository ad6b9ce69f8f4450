"""Mooncake for the remote-tier tests (the store itself: ``kv_cache_manager_v2.testing.mooncake_cluster``).

Without the ``mooncake`` extra the tests skip, unless ``CI`` is set (``.ci/run`` installs it): then they fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from kv_cache_manager_v2.testing.mooncake_cluster import MooncakeCluster, free_port, mooncake_bin_dir

__all__ = ["MooncakeCluster", "cluster", "free_port", "require_mooncake"]


def require_mooncake() -> Path:
    """The directory holding ``mooncake_master``; skips (fails under CI) when Mooncake is not installed."""
    problem = ""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        problem = f"the mooncake extra is not installed ({error})"
    bin_dir = mooncake_bin_dir()
    if not problem and not (bin_dir / "mooncake_master").exists():
        problem = f"no mooncake_master in {bin_dir}"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs Mooncake (.ci/run), yet {problem}")
        pytest.skip(problem)
    return bin_dir


@pytest.fixture(scope="module")
def cluster() -> Iterator[MooncakeCluster]:
    """A Mooncake master (metadata server included) on loopback, shared by one test module and stopped after it; a
    module takes it by importing this fixture."""
    running = MooncakeCluster(require_mooncake())
    try:
        yield running
    finally:
        running.stop()
