"""``get_storage_statistics`` and ``get_usage`` read the same moment on the scheduler thread: both close the caches
whose handles were dropped (queued on the ``CallGuard``) before counting, so read right after a refusal they agree;
on another thread ``get_storage_statistics`` closes nothing (the close belongs to the scheduler thread)."""

from __future__ import annotations

import threading

from kv_cache_manager_v2 import GpuCacheTierConfig, KVCacheManager, StorageStatistics
from tests.helpers import KIB, attention, make_config

TPB = 32
SLOT = 2 * 4 * KIB  # one layer's K and V, 4 KiB each per block


def manager_with_a_dropped_cache() -> tuple[KVCacheManager, int]:
    """Eight GPU slots; a cache locking four is dropped without ``close()`` right after another's refused resize.
    Returns the manager and the refused request's ``pages_available``."""
    manager = KVCacheManager(make_config([attention(0)], tiers=[GpuCacheTierConfig(8 * SLOT)], tokens_per_block=TPB))
    holder = manager.create_kv_cache(None, list(range(4 * TPB)))
    assert holder.resume() and holder.resize(4 * TPB)
    other = manager.create_kv_cache(None, list(range(1000, 1000 + 6 * TPB)))
    assert other.resume() and not other.resize(6 * TPB)  # 4 slots left
    refusal = other.last_refusal
    assert refusal is not None and refusal.pages_available == 4, refusal
    other.close()
    del holder  # dropped after the refusal: queued until the scheduler thread's next call
    return manager, refusal.pages_available


def test_both_reads_on_the_scheduler_thread_count_the_dropped_cache_closed() -> None:
    """Before: ``get_storage_statistics`` still counted the dropped cache's 4 pages (``free`` 4) while
    ``get_usage``, read next, closed it first (``free`` 8)."""
    manager, _ = manager_with_a_dropped_cache()
    statistics = manager.get_storage_statistics(0)[0]
    usage = manager.get_usage()[0]
    assert (statistics.free, statistics.available) == (usage.free, usage.free + usage.reusable) == (8, 8)
    assert manager.num_live_caches == 0


def test_on_another_thread_it_closes_nothing() -> None:
    manager, available = manager_with_a_dropped_cache()
    read: list[StorageStatistics] = []
    reader = threading.Thread(target=lambda: read.extend(manager.get_storage_statistics(0)), name="metrics")
    reader.start()
    reader.join(10)
    assert [entry.free for entry in read] == [available]  # the dropped cache's pages still in use
    assert manager.get_storage_statistics(0)[0].free == 8  # the scheduler thread's read closes it
