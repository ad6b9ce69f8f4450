"""A long-running server opens and closes caches, managers and connections for weeks: nothing a request or a
manager leaves behind may accumulate (objects, descriptors, threads). Counts, never timings
(``tests/steady_state.py``)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Sequence

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheEvent,
    KVCacheEventManager,
    KVCacheManager,
    KVCacheRemovedData,
    KVCacheStoredBlockData,
)
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


@pytest.mark.parametrize("gather", [None, "failing"], ids=["never_flushed", "gather_always_failing"])
def test_events_waiting_for_a_flush_are_bounded_like_the_delivered_ones(gather: str | None) -> None:
    """Before: ``KVCacheEventManager`` kept every event recorded since the last successful flush, without bound
    (an engine that never flushes, a rank that stays unreachable): the second 500 events grew KVCacheEvent by
    500 (gather_always_failing: the same) and KVCacheRemovedData by 500. A flush delivers at most
    ``max_kv_event_entries`` of them (the newest), so only those wait."""

    def unreachable(mine: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
        raise ConnectionError("a rank is unreachable")

    events = KVCacheEventManager(
        10, attention_dp_rank=0 if gather else None, attention_dp_gather=unreachable if gather else None
    )
    recorded = [0]

    def record(count: int) -> None:
        for _ in range(count):
            events.add_removed_event(recorded[0].to_bytes(32, "big"))
            recorded[0] += 1
        if gather:
            with pytest.raises(ConnectionError):
                events.flush_iteration_events()

    assert grown_after(record, 500) == {}
    if gather:
        return
    events.flush_iteration_events()
    latest = events.get_latest_events()
    assert [event.event_id for event in latest] == list(range(990, 1000))  # the newest, as before
    assert [event.data for event in latest] == [KVCacheRemovedData([i.to_bytes(32, "big")]) for i in range(990, 1000)]


class FailingStoredHook(KVCacheEventManager):
    def add_stored_event(
        self, parent_hash: bytes | None, blocks: Sequence[KVCacheStoredBlockData], layer_group_id: int | None = None
    ) -> None:
        raise RuntimeError("the hook failed")


def live_objects_named(name: str) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj).__name__ == name)


def test_a_hook_error_kept_for_the_next_flush_keeps_no_manager_alive() -> None:
    """Before: the kept error's traceback held the frames of the call it interrupted and, through ``f_back``,
    their callers': the ``KVCache`` handle that committed and the manager stayed alive as long as the (user's)
    event manager did without a flush (1 KVCacheManager and 1 KVCache live after both were dropped)."""
    events = FailingStoredHook(100)
    managers_before, handles_before = live_objects_named("KVCacheManager"), live_objects_named("KVCache")
    manager = KVCacheManager(make_config([attention(0)]), event_manager=events)
    cache = compute_prompt(manager, FakeEngine(manager), seeded_prompt(0))  # the commit's hook call raised
    cache.close()
    manager.shutdown()
    del manager, cache
    assert (live_objects_named("KVCacheManager"), live_objects_named("KVCache")) == (managers_before, handles_before)
    with pytest.raises(RuntimeError, match="the hook failed") as raised:
        events.flush_iteration_events()  # still raised by the next flush, still saying where it came from
    if sys.version_info >= (3, 11):
        assert "in add_stored_event" in "\n".join(getattr(raised.value, "__notes__", []))
