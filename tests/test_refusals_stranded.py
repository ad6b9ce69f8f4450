"""A refusal names the GPU pages held for suspended caches that no colder tier can take: there, suspending a
cache frees nothing, so a scheduler that preempts only by ``suspend`` waits (or ping-pongs) forever."""

from __future__ import annotations

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager
from kv_cache_manager_v2.config import CacheTierConfig

from tests.helpers import KIB, SMALL_SLOTS, attention, make_config

TPB = 32
SLOT = 16 * KIB  # one layer's 8 KiB K and 8 KiB V page


def refused_beside_suspended(host_slots: int) -> str:
    """The detail of a ``resize`` refused while a suspended cache holds 6 of the GPU's ``SMALL_SLOTS`` slots and a
    host tier of ``host_slots`` slots (none: GPU only) can take only that many of them."""
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
    running.close()
    preempted.close()
    manager.shutdown()
    return refusal.detail


def test_gpu_only_refusal_says_suspending_frees_nothing() -> None:
    """Before: '5 GPU pages needed in pool group 0, 1 free or evictable; other caches hold the rest' (the 6 pages
    the suspended cache pins on a GPU-only tier were not told apart from pages running caches use)."""
    detail = refused_beside_suspended(0)
    assert "6 of them held" in detail and "suspending a cache frees no GPU page here" in detail, detail


def test_stranded_count_leaves_out_what_a_colder_tier_takes() -> None:
    """A host tier with room for 2 of the suspended cache's 6 GPU pages: the other 4 are stranded."""
    detail = refused_beside_suspended(2)
    assert "4 of them held" in detail, detail


def test_no_stranded_pages_no_such_sentence() -> None:
    """A host tier that takes every held page: suspending did make room, and the sentence stays as it was."""
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(SMALL_SLOTS * SLOT), HostCacheTierConfig(16 * SLOT)]
    manager = KVCacheManager(make_config([attention(0, 8 * KIB)], tiers=tiers))
    hog = manager.create_kv_cache()
    assert hog.resume() and hog.resize(8 * TPB)
    cache = manager.create_kv_cache()
    assert cache.resume() and not cache.resize(4 * TPB)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.detail.endswith("other caches hold the rest"), refusal
    hog.close()
    cache.close()
    manager.shutdown()
