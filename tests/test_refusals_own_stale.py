"""Refusals that the cache's own held stale pages cause: a cache that neither commits its computed blocks nor calls
``stop_committing`` keeps the pages that leave its window held (they may still be committed), and on a tier with
nowhere colder to put them they can take the room its own next step needs. Such a refusal says so
(``Refusal.own_stale_pages``) and names the ways out; any other refusal names none, and no way out of its own
would make that step fit."""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import GpuCacheTierConfig, HostCacheTierConfig, KVCacheManager, _KVCache
from kv_cache_manager_v2._storage.page_codec import PaddingColdPageCodec
from kv_cache_manager_v2.config import CacheTierConfig
from tests.helpers import KIB, attention, make_config


def _uncommitted_chunks(manager: KVCacheManager, end: int) -> tuple[_KVCache, list[int]]:
    """A cache computing 16-token chunks up to ``end`` without committing any (its stale pages stay held)."""
    cache = manager.create_kv_cache()
    assert cache.resume()
    for start in range(0, end, 16):
        assert cache.resize(start + 16, start), (start, cache.last_refusal)
    return cache, [7] * end


@pytest.mark.parametrize("way_out", ["commit", "stop_committing"])
def test_a_refusal_its_own_held_stale_pages_cause_says_so(way_out: str) -> None:
    """One window-32 layer, 6 GPU slots, 16-token blocks, nothing but this cache: chunks computed and never committed
    leave the window held (they may still be committed), and only a colder tier could take them, so ``resize(112, 96)`` is refused
    although ``can_fit`` says the step fits. The refusal said "other caches hold the rest", and an engine waiting
    for room because ``fits_empty_manager`` is True waited forever. It now names the 4 pages and both ways out, and
    each way out makes the step fit."""
    manager = KVCacheManager(make_config([attention(0, KIB, window=32)], gpu_quota=6 * 2 * KIB, tokens_per_block=16))
    cache, tokens = _uncommitted_chunks(manager, 96)
    assert manager.can_fit(112, 16) and not cache.resize(112, 96)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.fits_empty_manager and refusal.own_stale_pages == 4, refusal
    assert (refusal.pages_needed, refusal.pages_available) == (1, 0), refusal
    assert "this cache itself holds 4 pages" in refusal.detail and "KVCache.stop_committing()" in refusal.detail
    assert "commit the computed blocks" in refusal.detail and "other caches" not in refusal.detail, refusal.detail
    if way_out == "commit":
        cache.commit(tokens)
    else:
        cache.stop_committing()
    assert cache.resize(112, 96), cache.last_refusal
    cache.close()


def test_own_stale_pages_stay_zero_when_others_must_give_back_too() -> None:
    """8 GPU slots, a second cache holding 2 pages, the first holding its window's 2 and 4 stale uncommitted ones: a
    64-token step needs 5 new pages, and freeing the 4 would not make it fit while the other cache holds its 2, so
    the refusal blames other caches and names no stale pages; once that cache closes, they are what stands in the
    way, and the refusal says so."""
    manager = KVCacheManager(make_config([attention(0, KIB, window=32)], gpu_quota=8 * 2 * KIB, tokens_per_block=16))
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(32)
    cache, _ = _uncommitted_chunks(manager, 96)
    assert manager.can_fit(176, 80) and not cache.resize(176, 96)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.own_stale_pages == 0 and "other caches hold" in refusal.detail, refusal
    other.close()
    assert not cache.resize(176, 96)
    assert cache.last_refusal is not None and cache.last_refusal.own_stale_pages == 4, cache.last_refusal
    cache.stop_committing()
    assert cache.resize(176, 96), cache.last_refusal
    cache.close()


def _suspended_mid_chunk(manager: KVCacheManager, end: int) -> _KVCache:
    """With SWA scratch reuse (window 32, 16-token blocks): a cache computing uncommitted chunks to 96 tokens (4 held
    stale pages, blocks 4 and 5 live), then a chunk to ``end`` (2 new pages for its last two blocks, a scratch slot
    for each block in between), suspended mid-chunk: its scratch slots go, and its resume must take them again."""
    cache, _ = _uncommitted_chunks(manager, 96)
    assert cache.resize(end, 96), cache.last_refusal
    cache.suspend()
    return cache


def test_a_resume_its_own_held_stale_pages_refuse_says_so() -> None:
    """10 GPU slots: the suspended cache holds 8 (4 of them stale, uncommitted), another cache took the 2 scratch
    slots it gave back. Its resume is refused, and freeing its stale pages would make it fit (so would closing the
    other cache). The refusal said "other caches hold the rest" with no word of the 4 pages the cache itself keeps;
    it now names them and the way out a suspended cache has (``stop_committing``: ``commit`` needs an active cache),
    which makes the same resume fit."""
    manager = KVCacheManager(
        make_config([attention(0, KIB, window=32)], gpu_quota=10 * 2 * KIB, tokens_per_block=16, enable_swa_scratch_reuse=True)
    )
    cache = _suspended_mid_chunk(manager, 160)  # 2 scratch slots
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(32)
    assert not cache.resume()
    refusal = cache.last_refusal
    assert refusal is not None and refusal.call == "KVCache.resume" and refusal.fits_empty_manager, refusal
    assert refusal.own_stale_pages == 4 and (refusal.pages_needed, refusal.pages_available) == (2, 0), refusal
    assert "this cache itself holds 4 pages" in refusal.detail and "KVCache.stop_committing()" in refusal.detail
    assert "other caches" not in refusal.detail and "KVCache.commit" not in refusal.detail, refusal.detail
    cache.stop_committing()
    assert cache.resume(), cache.last_refusal
    other.close()
    cache.close()


def test_a_resume_its_stale_pages_cannot_rescue_names_none() -> None:
    """A chunk to 224 tokens needs 6 scratch slots; another cache took 5 of them while this one was suspended and
    was suspended itself (its pages held: nowhere colder to go). Freeing the 4 stale pages leaves the resume 1 short,
    so the refusal blames other caches and names no stale pages, and stop_committing indeed does not make it fit
    (closing the other cache does)."""
    manager = KVCacheManager(
        make_config([attention(0, KIB, window=32)], gpu_quota=14 * 2 * KIB, tokens_per_block=16, enable_swa_scratch_reuse=True)
    )
    cache = _suspended_mid_chunk(manager, 224)
    other, _ = _uncommitted_chunks(manager, 80)  # 5 pages: blocks 0 and 1 stale, 2 to 4 live
    other.suspend()
    assert not cache.resume()
    refusal = cache.last_refusal
    assert refusal is not None and refusal.own_stale_pages == 0 and "other caches hold" in refusal.detail, refusal
    cache.stop_committing()
    assert not cache.resume()
    other.close()
    assert cache.resume(), cache.last_refusal
    cache.close()


def test_a_refusal_its_own_stale_pages_on_a_colder_tier_cause_says_so() -> None:
    """6 GPU slots and 3 host slots: another cache's growth moved the 3 stale uncommitted pages of a cache computing
    without committing to the host, and that other cache, suspended, holds 3 GPU pages that can go nowhere while the
    host is full of them. A step that makes nothing new stale (``resize(112, 80)``) is refused; freeing the host's
    stale pages (``stop_committing``) lets the held GPU pages move there, and the step fits. The refusal said
    "other caches hold the rest" with ``own_stale_pages`` 0 (it counted GPU pages only: a refusal with none that
    ``stop_committing()`` turns into a fit); it now counts the 3 host pages."""
    slot = 2 * KIB
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(6 * slot), HostCacheTierConfig(3 * slot)]
    manager = KVCacheManager(make_config([attention(0, KIB, window=32)], tiers=tiers, tokens_per_block=16))
    cache, _ = _uncommitted_chunks(manager, 96)  # blocks 0-2 stale, 3-5 live
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(48)  # the 3 stale pages go to the host
    other.suspend()
    assert [statistics.available for statistics in manager.get_storage_statistics(1)] == [0]
    assert manager.can_fit(112, 32) and not cache.resize(112, 80)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.own_stale_pages == 3 and "this cache itself holds 3 pages" in refusal.detail, refusal
    cache.stop_committing()
    assert cache.resize(112, 80), cache.last_refusal
    other.close()
    cache.close()


def test_a_refusal_counts_its_own_stale_pages_where_a_codec_splits_the_colder_tier() -> None:
    """One GPU pool group of a full and a window-32 layer group, which a cold-page codec stores at the host in two
    pool groups of their own (2 and 3 KiB pages). A cache computing 80 tokens without committing holds 3 stale
    window pages; another cache's growth sends 2 of them to the host, filling the window's host pool group, and,
    suspended, holds GPU pages that can go nowhere. ``resize(96, 80)`` is refused; freeing the 3 stale pages
    (``stop_committing``) makes it fit. The refusal said "other caches hold the rest" with ``own_stale_pages`` 0:
    the supposed freeing skipped every level the codec groups otherwise than the GPU. It now counts the freed
    pages under the host's own pool groups, as the real freeing does."""
    slot = 2 * KIB
    tiers: list[CacheTierConfig] = [GpuCacheTierConfig(10 * slot), HostCacheTierConfig(12 * KIB)]
    codec = PaddingColdPageCodec({0: 2 * KIB, 1: 3 * KIB})
    layers = [attention(0, KIB), attention(1, KIB, window=32)]
    manager = KVCacheManager(make_config(layers, tiers=tiers, tokens_per_block=16), cold_page_codec=codec)
    assert [statistics.total for statistics in manager.get_storage_statistics(1)] == [3, 2]
    cache, _ = _uncommitted_chunks(manager, 80)  # window blocks 0-2 stale
    other = manager.create_kv_cache()
    assert other.resume() and other.resize(16)  # 2 stale pages go to the host
    other.suspend()
    assert [statistics.available for statistics in manager.get_storage_statistics(1)] == [3, 0]
    assert manager.can_fit(96, 16) and not cache.resize(96, 80)
    refusal = cache.last_refusal
    assert refusal is not None and refusal.own_stale_pages == 3 and "this cache itself holds 3 pages" in refusal.detail, refusal
    cache.stop_committing()
    assert cache.resize(96, 80), cache.last_refusal
    other.close()
    cache.close()
