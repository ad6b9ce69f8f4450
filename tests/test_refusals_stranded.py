"""A refusal by room counts the GPU pages held for other caches that no colder tier can take
(``Refusal.stranded_pages``): there, suspending a cache frees nothing, so a scheduler that preempts only by
``suspend`` waits (or ping-pongs) forever. The count is what the statistics read at that moment, less the pages the
refused cache holds itself."""

from __future__ import annotations

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager, Refusal
from kv_cache_manager_v2.config import CacheTierConfig

from tests.helpers import KIB, SMALL_SLOTS, attention, make_config

TPB = 32
SLOT = 16 * KIB  # one layer's 8 KiB K and 8 KiB V page


def stranded_now(manager: KVCacheManager, pool_group: int = 0) -> int:
    """The held GPU pages that can neither be dropped nor moved colder, as a user reads them: ``get_usage()``'s
    held less what ``get_storage_statistics()``'s evictable counts beyond the reusable pages."""
    statistics = manager.get_storage_statistics(0)[pool_group]
    usage = next(entry for entry in manager.get_usage() if (entry.level, entry.pool_group) == (0, pool_group))
    return usage.held - (statistics.evictable - usage.reusable)


def refused_beside_suspended(host_slots: int) -> tuple[Refusal, int]:
    """A ``resize`` refused while a suspended cache holds 6 of the GPU's ``SMALL_SLOTS`` slots and a host tier of
    ``host_slots`` slots (none: GPU only) can take only that many of them; with ``stranded_now`` read after it."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(SMALL_SLOTS * SLOT)]
    if host_slots:
        tiers.append(HostCacheTierConfig(host_slots * SLOT))
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    preempted = manager.create_kv_cache()
    assert preempted.resume() and preempted.resize(6 * TPB)
    preempted.suspend()
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(3 * TPB)
    assert not running.resize(8 * TPB)
    refusal = running.last_refusal
    assert refusal is not None and refusal.fits_empty_manager and refusal.pages_over_limit == 0, refusal
    seen = stranded_now(manager)
    running.close()
    preempted.close()
    manager.shutdown()
    return refusal, seen


def test_gpu_only_refusal_says_suspending_frees_nothing() -> None:
    """Before: '5 GPU pages needed in pool group 0, 1 free or evictable; other caches hold the rest' (the 6 pages
    the suspended cache keeps on a GPU-only tier were not told apart from pages running caches use)."""
    refusal, seen = refused_beside_suspended(0)
    assert refusal.stranded_pages == seen == 6, (refusal, seen)
    assert "6 of pool group 0's GPU pages are held for other caches" in refusal.detail, refusal
    assert "suspending a cache frees no GPU page here" in refusal.detail, refusal


def test_stranded_count_leaves_out_what_a_colder_tier_takes() -> None:
    """A host tier with room for 2 of the suspended cache's 6 GPU pages: the other 4 are stranded."""
    refusal, seen = refused_beside_suspended(2)
    assert refusal.stranded_pages == seen == 4, (refusal, seen)
    assert "4 of pool group 0's GPU pages" in refusal.detail, refusal


def test_no_stranded_pages_no_such_sentence() -> None:
    """A host tier with room for every held page: suspending did make room, and the sentence stays as it was."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(SMALL_SLOTS * SLOT), HostCacheTierConfig(16 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    preempted = manager.create_kv_cache()
    assert preempted.resume() and preempted.resize(6 * TPB)
    preempted.suspend()
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(3 * TPB)
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(TPB)
    assert not cache.resize(8 * TPB)  # 7 more pages: 6 can move to the host, none is free
    refusal = cache.last_refusal
    assert refusal is not None and refusal.detail.endswith("other caches hold the rest"), refusal
    assert refusal.stranded_pages == 0 == stranded_now(manager), refusal
    for each in (cache, hog, preempted):
        each.close()
    manager.shutdown()


def test_the_callers_own_held_pages_are_not_counted() -> None:
    """A windowed cache whose computed blocks left its window uncommitted holds them (kept for a commit): they are
    held GPU pages no colder tier can take, but its own, so the count leaves them out (and stays within what the
    statistics say). Before: the count took only the pages the step keeps as the caller's, so it named these 2 as
    held for suspended caches ('6 of them held' with 4 held for the suspended cache)."""
    manager = KVCacheManager(make_config([attention(0, 8 * KIB, window=TPB)], gpu_quota=SMALL_SLOTS * SLOT))
    preempted = manager.create_kv_cache()
    assert preempted.resume() and preempted.resize(4 * TPB)
    preempted.suspend()
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(3 * TPB) and running.resize(4 * TPB, 3 * TPB + 1)
    assert stranded_now(manager) == 6  # its 2 computed blocks behind the window are held too
    assert not running.resize(10 * TPB, 4 * TPB)
    refusal = running.last_refusal
    assert refusal is not None and refusal.own_stale_pages == 0, refusal  # stop_committing() would not make it fit
    seen = stranded_now(manager)
    assert seen == 6 and refusal.stranded_pages == 4, (refusal, seen)
    assert "4 of pool group 0's GPU pages are held for other caches" in refusal.detail, refusal
    running.close()
    preempted.close()
    manager.shutdown()


def test_a_refused_resume_leaves_out_its_own_held_pages() -> None:
    """A suspended cache that matched a full block and a partial one holds both on a GPU-only tier; its resume needs
    one more page (the copy of the partial block) beside 6 pages another suspended cache keeps: 8 held pages stay,
    6 of them for the other cache."""
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], gpu_quota=SMALL_SLOTS * SLOT))
    prompt = list(range(1, 49))
    source = manager.create_kv_cache(None, prompt)
    assert source.resume() and source.resize(len(prompt))
    source.commit(prompt)
    source.close()
    resuming = manager.create_kv_cache(None, prompt[:40])  # holds the full block and the partial one to copy
    preempted = manager.create_kv_cache()
    assert preempted.resume() and preempted.resize(6 * TPB)
    preempted.suspend()
    running = manager.create_kv_cache()
    assert running.resume() and running.resize(2 * TPB)
    assert not resuming.resume()
    refusal = resuming.last_refusal
    assert refusal is not None and refusal.fits_empty_manager and refusal.pages_over_limit == 0, refusal
    assert stranded_now(manager) == 8 and refusal.stranded_pages == 6, refusal
    for cache in (running, preempted, resuming):
        cache.close()
    manager.shutdown()
