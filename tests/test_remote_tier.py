"""The shared remote tier on a real Mooncake Store (master and storage node on loopback, started per module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import kv_cache_manager_v2
from tests.mooncake_helpers import MooncakeCluster, require_mooncake

SCENARIOS = str(Path(__file__).with_name("remote_scenarios.py"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[MooncakeCluster]:
    running = MooncakeCluster(require_mooncake())
    try:
        yield running
    finally:
        running.stop()


def child_env() -> dict[str, str]:
    """The environment that makes a child import the package this run tests (sources or compiled build)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    return env


def run_instance(role: str, cluster: MooncakeCluster) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, SCENARIOS, role, cluster.master_address, cluster.metadata_url],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )
    assert result.returncode == 0, f"{role}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    figures: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def test_second_process_reuses_the_system_prompt_the_first_computed(cluster: MooncakeCluster) -> None:
    first = run_instance("compute", cluster)
    assert first["reused"] == 0 and first["stored_pages"] > 0 and first["warnings"] == 0
    second = run_instance("reuse", cluster)
    # A fresh process has nothing locally: all 10 system-prompt blocks came from the store, content checked.
    assert second["reused"] == 160
    assert second["fetched_pages"] > 0 and second["checked"] >= 160 and second["warnings"] == 0
