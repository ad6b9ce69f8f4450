"""Eviction across tiers (SPEC §4, §8): priority-LRU, offload to host and disk, onboarding, quota changes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from kv_cache_manager_v2 import (
    DiskCacheTierConfig,
    GpuCacheTierConfig,
    HostCacheTierConfig,
    KVCacheManager,
    LifeCycle,
    Priority,
)
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config

TPB = 32
SLOT = 2 * 8 * KIB  # one layer, K and V of 8 KiB per block


def tokens_of(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(length)]


def fixed_priority(priority: int) -> Callable[[int, LifeCycle], Priority]:
    """A priority callback that gives every block the same priority."""

    def callback(_block: int, _life_cycle: LifeCycle) -> Priority:
        return Priority(priority)

    return callback


def tiered_manager(tmp_path: Path, gpu_slots: int, host_slots: int, disk_slots: int = 0) -> KVCacheManager:
    tiers: list[GpuCacheTierConfig | HostCacheTierConfig | DiskCacheTierConfig] = [
        GpuCacheTierConfig(gpu_slots * SLOT),
        HostCacheTierConfig(host_slots * SLOT),
    ]
    if disk_slots:
        tiers.append(DiskCacheTierConfig(disk_slots * SLOT, str(tmp_path)))
    return KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))


def test_suspended_caches_move_to_host_and_disk_and_come_back_intact(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path, gpu_slots=8, host_slots=8, disk_slots=16)
    engine = FakeEngine(manager)
    caches = []
    for seed in range(4):
        tokens = tokens_of(seed, 6 * TPB)
        cache = manager.create_kv_cache()
        assert cache.resume()
        assert cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.resize(len(tokens), len(tokens))
        cache.suspend()
        caches.append((cache, tokens))
    # 24 held pages for 8 GPU slots: the older caches went to host, then disk.
    levels = [manager.get_storage_statistics(level)[0] for level in range(3)]
    assert [stat.total - stat.free for stat in levels] == [8, 8, 8]
    for cache, tokens in caches:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()
    for cache, _ in caches:
        cache.close()
    assert [manager.get_storage_statistics(level)[0].free for level in range(3)] == [8, 8, 16]
    manager.shutdown()


def test_held_pages_that_fit_nowhere_make_resume_and_resize_fail_cleanly(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path, gpu_slots=4, host_slots=4)
    first = manager.create_kv_cache()
    assert first.resume() and first.resize(4 * TPB)
    first.suspend()
    second = manager.create_kv_cache()
    assert second.resume() and second.resize(4 * TPB)  # first's pages offloaded to host
    assert not second.resize(5 * TPB)  # host is full of held pages: nowhere to go
    assert second.capacity == 4 * TPB
    second.suspend()
    assert not first.resume() or True  # either fits by swapping or refuses; both leave state consistent
    for cache in (first, second):
        cache.close()
    assert manager.get_storage_statistics(0)[0].free == 4
    assert manager.get_storage_statistics(1)[0].free == 4


def test_lowest_priority_then_least_recent_is_evicted_first(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path, gpu_slots=6, host_slots=2)
    engine = FakeEngine(manager)
    older = tokens_of(3, 2 * TPB)
    high = tokens_of(2, 2 * TPB)
    low = tokens_of(1, 2 * TPB)
    for tokens, priority in ((older, 35), (high, 80), (low, 10)):
        cache = manager.create_kv_cache(None, tokens, custom_priority_callback=fixed_priority(priority))
        assert cache.resume() and cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.commit(tokens)
        cache.close()
    # 2 new slots: `low` (priority 10) goes to host although it is the newest; 2 more: `older` (35) goes to host
    # and pushes `low` out of the last tier. Pure LRU would have lost `older` instead.
    fresh = manager.create_kv_cache()
    assert fresh.resume() and fresh.resize(2 * TPB)
    needing = manager.create_kv_cache()
    assert needing.resume() and needing.resize(2 * TPB)
    fresh.close()
    needing.close()
    assert manager.probe_reuse(None, low) == 0
    for tokens in (older, high):
        cache = manager.create_kv_cache(None, tokens + [0])
        assert cache.num_committed_tokens == 2 * TPB
        assert cache.resume()
        engine.check(cache, tokens + [0])
        cache.close()


def test_droppable_pages_are_dropped_at_the_last_tier(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path, gpu_slots=4, host_slots=4)
    engine = FakeEngine(manager)
    prompts = [tokens_of(seed, 4 * TPB) for seed in range(3)]
    for tokens in prompts:
        cache = manager.create_kv_cache(None, tokens)
        assert cache.resume() and cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.commit(tokens)
        cache.close()
    # 12 committed pages, 8 slots in all: the oldest prompt's pages were dropped, the others moved down.
    assert manager.probe_reuse(None, prompts[0]) == 0
    assert manager.probe_reuse(None, prompts[1]) == 4 * TPB
    assert manager.probe_reuse(None, prompts[2]) == 4 * TPB


def test_quota_shrink_and_grow_with_suspended_caches(tmp_path: Path) -> None:
    manager = tiered_manager(tmp_path, gpu_slots=16, host_slots=16)
    engine = FakeEngine(manager)
    base_address = manager.get_mem_pool_base_address(0, "key")
    caches = []
    for seed in range(3):
        tokens = tokens_of(seed, 4 * TPB)
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.resize(len(tokens), len(tokens))
        caches.append((cache, tokens))
    with pytest.raises(ValueError, match="suspended"):
        manager.resize(0, 4 * SLOT)
    for cache, _ in caches:
        cache.suspend()
    assert manager.resize(0, 4 * SLOT)
    assert manager.get_quota(0) == 4 * SLOT and manager.get_storage_statistics(0)[0].total == 4
    assert not manager.resize(1, 4 * SLOT)  # 8+ held pages on host cannot fit in 4 slots
    assert manager.get_quota(1) == 16 * SLOT
    held = manager.last_refusal  # each refusal says why, and whether freeing pages would help
    assert held is not None and held.call == "KVCacheManager.resize" and held.level == 1
    assert held.fits_empty_manager and held.pages_needed >= 8 and held.pages_available == 4
    assert "can neither be dropped nor moved" in held.detail
    assert not manager.resize(0, 64 * SLOT)  # beyond the reservation: the base address would have to move
    beyond = manager.last_refusal
    assert beyond is not None and beyond.level == 0 and not beyond.fits_empty_manager
    assert beyond.pages_available == 16 and "max_quota" in beyond.detail
    assert manager.resize(0, 16 * SLOT)
    assert manager.get_mem_pool_base_address(0, "key") == base_address
    for cache, tokens in caches:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.suspend()
    for cache, _ in caches:
        cache.close()
    with pytest.raises(ValueError, match="quota must be > 0"):
        manager.resize(0, 0)
