"""``KVCache.prefetch(level)``'s refusal counts as every other refusal does: by room, the pages still to move
against what is available (the statistics' figure); when the cache's pages would not fit the level even alone,
``fits_empty_manager`` False and ``pages_needed`` every page it would hold there, as ``can_fit`` and a resize that
never fits count. Pages already warmer than the level stay where they are and count for nothing there."""

from __future__ import annotations

from pathlib import Path

from kv_cache_manager_v2 import DiskCacheTierConfig, GpuCacheTierConfig, HostCacheTierConfig, KVCache, KVCacheManager
from kv_cache_manager_v2.config import CacheTierConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.fuzz.checks import check_refusal
from tests.helpers import KIB, attention, make_config

TPB = 32
SLOT = 16 * KIB  # attention(0, 8 KiB): one page of K and V


def _computed(manager: KVCacheManager, engine: FakeEngine, pages: int) -> KVCache:
    cache = manager.create_kv_cache()
    assert cache.resume() and cache.resize(pages * TPB)
    engine.step(cache, list(range(pages * TPB)))
    return cache


def test_an_evicting_prefetch_that_never_fits_counts_every_page_it_would_hold() -> None:
    """A cache grown by resize past what a resume may lock (5 of 10 slots), suspended and offloaded: its evicting
    prefetch brings what the limit lets it and refuses the rest, and that refusal never fits; ``pages_needed`` is
    its 8 pages, the figure its sentence states, not the 3 still on the host. Before: ``assert 3 == 8``."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(10 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=0.5))
    engine = FakeEngine(manager)
    cache = _computed(manager, engine, 8)
    cache.suspend()
    assert cache.offload() == 8
    earlier = manager.last_refusal
    assert cache.prefetch(0, evict=True) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", cache)
    assert (refusal.fits_empty_manager, refusal.pages_needed, refusal.pages_total) == (False, 8, 10), refusal
    assert "3 of this cache's pages of pool group 0 stay off the GPU" in refusal.detail, refusal.detail
    assert "this cache's 8 pages of pool group 0 on the GPU exceed the 5 it may hold there" in refusal.detail
    assert not cache.resumable_alone  # what its resume then finds: it never fits either
    cache.close()
    manager.shutdown()


def test_pages_warmer_than_the_level_do_not_count_against_it(tmp_path: Path) -> None:
    """A cache with 1 page on the GPU and 2 on disk, the host's 2 slots taken by another suspended cache: its
    ``prefetch(1)`` is refused by room (the 2 disk pages fit the 2 host slots of an empty manager; its GPU page
    never goes to the host). Before: ``fits_empty_manager`` False, its GPU page counted against the host
    (``assert (False, 2) == (True, 2)``)."""
    tiers: list[CacheTierConfig] = [
        GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(2 * SLOT), DiskCacheTierConfig(8 * SLOT, str(tmp_path)),
    ]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    first = _computed(manager, engine, 2)
    first.suspend()
    assert first.offload() == 2  # the host's 2 slots
    second = _computed(manager, engine, 3)
    second.suspend()
    assert second.offload() == 3  # to disk: the host is full
    running = _computed(manager, engine, 9)  # 1 GPU slot left free
    assert second.prefetch() == 1
    assert [(usage.used, usage.held, usage.free) for usage in manager.get_usage()] == [(9, 1, 0), (0, 2, 0), (0, 2, 6)]
    earlier = manager.last_refusal
    assert second.prefetch(1) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", second)
    assert (refusal.fits_empty_manager, refusal.pages_needed) == (True, 2), refusal
    assert (refusal.level, refusal.pages_available, refusal.pages_total) == (1, 0, 2), refusal
    for cache in (running, first, second):
        cache.close()
    manager.shutdown()


def _waiting_and_running(max_util: float, running_pages: int) -> tuple[KVCacheManager, KVCache, KVCache]:
    """A suspended cache of 4 pages offloaded to the host, then an active one of ``running_pages`` (10 GPU slots)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(10 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=max_util))
    engine = FakeEngine(manager)
    waiting = _computed(manager, engine, 4)
    waiting.suspend()
    assert waiting.offload() == 4
    return manager, waiting, _computed(manager, engine, running_pages)


def test_an_evicting_prefetch_refused_by_the_admission_limit_counts_the_pages_over_it() -> None:
    """Resume may lock 5 of 10 slots; 3 are locked by a running cache, so the waiting cache's 4 pages are 2 over:
    the prefetch brings 2 and its refusal says 2 over, as a resume's refusal by the limit would. Before:
    ``pages_over_limit`` 0 (``assert 0 == 2``)."""
    manager, waiting, running = _waiting_and_running(0.5, 3)
    earlier = manager.last_refusal
    assert waiting.prefetch(0, evict=True) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", waiting)
    assert refusal.fits_empty_manager and refusal.pages_over_limit == 2, refusal
    assert "4 for this cache and 3 that active caches lock, 2 over" in refusal.detail, refusal.detail
    running.suspend()  # releasing those 2 (and more) is what lets it fit
    assert waiting.prefetch(0, evict=True) is True
    for cache in (running, waiting):
        cache.close()
    manager.shutdown()



def test_a_prefetch_that_never_fits_a_shrunk_tier_does_not_promise_that_resume_brings_them() -> None:
    """The GPU quota shrunk to 5 slots under a suspended, offloaded cache of 8 pages: its prefetch into free slots
    brings 5 and never fits, and its resume is refused as well; the sentence no longer says "resume brings them
    all". Before: it said so, then that it never fits."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(10 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    cache = _computed(manager, FakeEngine(manager), 8)
    cache.suspend()
    assert cache.offload() == 8 and manager.resize(0, 5 * SLOT)
    earlier = manager.last_refusal
    assert cache.prefetch(0) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", cache)
    assert (refusal.fits_empty_manager, refusal.pages_needed, refusal.pages_total) == (False, 8, 5), refusal
    assert "resume brings them all" not in refusal.detail, refusal.detail
    assert not cache.resume() and not cache.resumable_alone  # what the sentence no longer contradicts
    cache.close()
    manager.shutdown()


def test_an_evicting_prefetch_refused_by_room_is_checked_by_the_fuzzers_reading() -> None:
    """The host's 4 slots hold the waiting cache's 4 pages, the GPU's 10 another suspended cache's, which have
    nowhere colder to go: an evicting prefetch, within the admission limit, is refused by room. Its sentence names
    the pool group once, in its head ("4 GPU pages needed in pool group 0"), not in the clause counting the pages
    left off the GPU; the fuzzer's reading (``check_prefetch_refusal``) asked for it there, a branch it first reached
    once a 0 quota factor shifted ``test_random_driver_of_the_soak_tool``'s choices (seed 0, ``cold_codec``).
    Before: ``AssertionError: Refusal(call='KVCache.prefetch', ...)`` from ``check_prefetch_refusal``."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(4 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    waiting = _computed(manager, engine, 4)
    waiting.suspend()
    assert waiting.offload() == 4
    other = _computed(manager, engine, 10)
    other.suspend()
    earlier = manager.last_refusal
    assert waiting.prefetch(0, evict=True) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", waiting)
    assert (refusal.fits_empty_manager, refusal.pages_over_limit) == (True, 0), refusal
    assert (refusal.pages_needed, refusal.pages_available, refusal.pages_total) == (4, 0, 10), refusal
    assert refusal.detail.startswith("4 GPU pages needed in pool group 0, 0 free or evictable"), refusal.detail
    assert "4 of this cache's pages stay off the GPU" in refusal.detail, refusal.detail
    assert refusal.stranded_pages == 10, refusal  # the other cache's, which the full host cannot take
    for cache in (other, waiting):
        cache.close()
    manager.shutdown()


def test_an_evicting_prefetch_refused_by_room_counts_the_stranded_pages_as_resume_does() -> None:
    """The waiting cache keeps 1 of its 4 pages on the GPU (the host's 3 slots take the rest), another suspended
    cache holds the GPU's other 9, the host is full: the prefetch is refused by room, and as a resume's refusal
    would, it says that 9 held GPU pages have nowhere to go (10 held, less the waiting cache's own), so suspending
    frees nothing there; its resume, refused alike, states the same figure. Before: ``stranded_pages`` 0 and no
    word of them (``check_stranded``: ``assert refusal.stranded_pages == max(0, stranded - len(own))``, 0 for 9)."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * SLOT), HostCacheTierConfig(3 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers, max_util_for_resume=1.0))
    engine = FakeEngine(manager)
    waiting = _computed(manager, engine, 4)
    waiting.suspend()
    assert waiting.offload() == 3
    other = _computed(manager, engine, 9)
    other.suspend()
    earlier = manager.last_refusal
    assert waiting.prefetch(0, evict=True) is False
    refusal = check_refusal(manager, earlier, "KVCache.prefetch", waiting)
    assert (refusal.fits_empty_manager, refusal.pages_over_limit) == (True, 0), refusal
    assert refusal.stranded_pages == 9, refusal
    assert "3 of this cache's pages stay off the GPU" in refusal.detail, refusal.detail
    assert "; 9 of pool group 0's GPU pages are held for other caches" in refusal.detail, refusal.detail
    assert "suspending a cache frees no GPU page here" in refusal.detail, refusal.detail
    assert not waiting.resume()
    resumed = check_refusal(manager, refusal, "KVCache.resume", waiting)
    assert resumed.stranded_pages == refusal.stranded_pages, (resumed, refusal)
    for cache in (other, waiting):
        cache.close()
    manager.shutdown()
