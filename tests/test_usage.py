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
