"""A long-running server opens and closes caches, managers and connections for weeks: nothing a request or a
manager leaves behind may accumulate (objects, descriptors, threads). Counts, never timings
(``tests/steady_state.py``)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from kv_cache_manager_v2 import DiskCacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import MIB, attention, compute_prompt, make_config, seeded_prompt
from tests.steady_state import grown_after, open_descriptors

needs_proc_fd = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")


def disk_manager(directory: Path) -> KVCacheManager:
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(4 * MIB),
        HostCacheTierConfig(4 * MIB),
        DiskCacheTierConfig(4 * MIB, str(directory)),
    ]
    return KVCacheManager(make_config([attention(0), attention(1, window=64)], tiers=tiers))


@needs_proc_fd
def test_a_manager_dropped_without_shutdown_closes_its_disk_pool_files(tmp_path: Path) -> None:
    """Before: each disk pool's descriptor stayed open once its manager was collected without ``shutdown``
    (an unlinked file: its disk blocks were never given back); three managers left 3 ``(deleted)`` pool files open."""
    gc.collect()
    before = open_descriptors()
    for seed in range(3):
        manager = disk_manager(tmp_path)
        compute_prompt(manager, FakeEngine(manager), seeded_prompt(seed)).close()
        del manager
        gc.collect()
    assert open_descriptors() == before
