"""``KVCacheManager.get_usage``: per tier and pool group, used / held / reusable / free pages and bytes."""

from __future__ import annotations

from kv_cache_manager_v2 import CacheTier, GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager, PoolGroupUsage
from kv_cache_manager_v2.config import CacheTierConfig

from tests.helpers import KIB, attention, make_config

TPB = 32
SLOT_BYTES = 16 * KIB  # one layer's 8 KiB K + 8 KiB V


def counts(usage: PoolGroupUsage) -> tuple[int, int, int, int]:
    return (usage.used, usage.held, usage.reusable, usage.free)


def test_usage_separates_used_held_reusable_and_free() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT_BYTES), HostCacheTierConfig(4 * SLOT_BYTES)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    gpu, host = manager.get_usage()
    assert (gpu.level, gpu.tier, gpu.pool_group, gpu.slot_bytes) == (0, CacheTier.GPU_MEM, 0, SLOT_BYTES)
    assert (host.level, host.tier, host.total) == (1, CacheTier.HOST_MEM, 4)
    assert counts(gpu) == (0, 0, 0, 10)
    done = manager.create_kv_cache(input_tokens=[])
    assert done.resume() and done.resize(2 * TPB)
    done.commit(list(range(2 * TPB)))
    done.close()  # 2 committed blocks nobody uses: reusable
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(3 * TPB)
    waiting.suspend()  # 3 pages kept for a suspended cache: held
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(4 * TPB)  # 4 locked: used
    gpu = manager.get_usage()[0]
    assert counts(gpu) == (4, 3, 2, 1) and gpu.total == 10
    assert (gpu.used_bytes, gpu.held_bytes, gpu.reusable_bytes, gpu.free_bytes, gpu.total_bytes) == (
        4 * SLOT_BYTES, 3 * SLOT_BYTES, 2 * SLOT_BYTES, SLOT_BYTES, 10 * SLOT_BYTES)
    stats = manager.get_storage_statistics(0)[0]
    assert stats.free == gpu.free and stats.evictable == gpu.held + gpu.reusable
    for cache in (waiting, running):
        cache.close()


def test_storage_statistics_count_as_available_only_what_a_step_can_have() -> None:
    # The host tier full of a suspended cache's pages: another suspended cache's GPU pages cannot leave the GPU
    # (held pages are never dropped), so they are neither evictable nor available there, and a new cache gets
    # exactly the available pages (before, held pages counted as evictable on every tier but the last whatever
    # the tiers below held: available 6 where a resize could have 4).
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(6 * SLOT_BYTES), HostCacheTierConfig(2 * SLOT_BYTES)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    offloaded = manager.create_kv_cache()
    assert offloaded.resume() and offloaded.resize(2 * TPB)
    offloaded.suspend()
    assert offloaded.offload() == 2
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(2 * TPB)
    waiting.suspend()
    done = manager.create_kv_cache(input_tokens=[])
    assert done.resume() and done.resize(2 * TPB)
    done.commit(list(range(2 * TPB)))
    done.close()
    gpu, host = manager.get_usage()
    assert counts(gpu) == (0, 2, 2, 2) and counts(host) == (0, 2, 0, 0)
    stats, host_stats = manager.get_storage_statistics(0)[0], manager.get_storage_statistics(1)[0]
    assert (stats.free, stats.evictable, stats.available, stats.unavailable) == (2, 2, 4, 2)
    assert (host_stats.evictable, host_stats.available) == (0, 0)
    new = manager.create_kv_cache()
    assert new.resume() and not new.resize(5 * TPB) and new.resize(4 * TPB)
    for cache in (new, offloaded, waiting):
        cache.close()


def test_a_held_page_is_evictable_where_the_tier_below_can_take_it() -> None:
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(6 * SLOT_BYTES), HostCacheTierConfig(3 * SLOT_BYTES)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    waiting = manager.create_kv_cache()
    assert waiting.resume() and waiting.resize(4 * TPB)
    waiting.suspend()
    stats = manager.get_storage_statistics(0)[0]
    assert (stats.free, stats.evictable, stats.available) == (2, 3, 5)  # 3 of its 4 pages fit on the host
    new = manager.create_kv_cache()
    assert new.resume() and not new.resize(6 * TPB) and new.resize(5 * TPB)
    for cache in (new, waiting):
        cache.close()
